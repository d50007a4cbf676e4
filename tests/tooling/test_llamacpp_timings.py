"""llama-server's own per-request timings, read from its log (lines copied from a worker's
log in the real-worker study; its diagnosis compares routers with them)."""

from __future__ import annotations

import pytest

from cachepilot.tooling.llamacpp.timings import Timing, busy_share, request_timings

LOG = """\
0.01.933.343 I srv  llama_server: listening on http://127.0.0.1:47929
0.02.990.853 I slot launch_slot_: id  0 | task 0 | processing task, is_child = 0
0.03.921.111 I slot print_timing: id  0 | task 0 | prompt eval time =     775.93 ms /   303 tokens (    2.56 ms per token,   390.50 tokens per second)
0.03.921.166 I slot print_timing: id  0 | task 0 |        eval time =     154.28 ms /     8 tokens (   22.04 ms per token,    45.37 tokens per second)
0.03.921.180 I slot print_timing: id  0 | task 0 |       total time =     930.20 ms /   311 tokens
1.10.857.347 I slot print_timing: id  0 | task 16 | prompt eval time =    2245.67 ms /   728 tokens (    3.08 ms per token,   324.18 tokens per second)
1.10.857.390 I slot print_timing: id  0 | task 16 |        eval time =     167.84 ms /     8 tokens (   23.98 ms per token,    41.71 tokens per second)
"""  # noqa: E501


def test_each_request_from_its_prompt_and_decode_lines() -> None:
    first, second = request_timings(LOG)
    assert first.prompt_tokens == 303 and second.prompt_tokens == 728
    assert first.end == pytest.approx(3.921166)
    assert first.prefill_end == pytest.approx(3.921166 - 0.15428)
    assert first.prefill_s == pytest.approx(0.77593)
    # Minutes count: 1 min 10.857 s.
    assert second.end == pytest.approx(70.85739)
    assert second.prefill_start == pytest.approx(70.85739 - 0.16784 - 2.24567)
    assert request_timings("0.01.000.000 I srv  nothing timed\n") == []


def test_busy_share_is_the_part_of_a_prefill_others_ran_in() -> None:
    t = Timing(10.0, 12.0, 12.5, 700)
    assert busy_share(t, []) == 0.0
    assert busy_share(t, [Timing(9.0, 9.5, 11.0, 50)]) == pytest.approx(0.5)  # its decode too
    assert busy_share(t, [Timing(12.0, 13.0, 13.2, 600), Timing(5.0, 6.0, 7.0, 1)]) == 0.0
    assert busy_share(t, [Timing(8.0, 14.0, 15.0, 900)]) == pytest.approx(1.0)
