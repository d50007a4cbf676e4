"""What llama-server's own log says each request took.

At a request's end llama-server logs its prompt evaluation and its decode, stamped with the
time since the worker started (``M.SS.mmm.uuu``)::

    0.03.921.111 I slot print_timing: … | prompt eval time =  775.93 ms /  303 tokens (…)
    0.03.921.166 I slot print_timing: … |        eval time =  154.28 ms /    8 tokens (…)

The engine's own prefill time, without the path to it: what
``benchmarks/real_peers_diagnosis.py`` compares across routers. Times are each worker's own
(its start is within a few ms of its neighbours' in a study, which starts them together).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_STAMP = r"^(\d+)\.(\d+)\.(\d+)\.(\d+) "
_PROMPT = re.compile(_STAMP + r".*prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens")
_DECODE = re.compile(_STAMP + r".*\|\s+eval time =\s+([\d.]+) ms")


@dataclass(frozen=True)
class Timing:
    """One request, in seconds since the worker started."""

    prefill_start: float
    prefill_end: float
    end: float
    prompt_tokens: int  # evaluated: the prompt less what the cache held

    @property
    def prefill_s(self) -> float:
        return self.prefill_end - self.prefill_start


def _stamp(m: re.Match[str]) -> float:
    return int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3 + int(m[4]) / 1e6


def request_timings(log: str) -> list[Timing]:
    """Every request a llama-server log reports, in the order they ended."""
    out, prompt = [], None
    for line in log.splitlines():
        if m := _PROMPT.search(line):
            prompt = (float(m[5]) / 1e3, int(m[6]))
        elif (m := _DECODE.search(line)) and prompt is not None:
            end, decode = _stamp(m), float(m[5]) / 1e3
            out.append(Timing(end - decode - prompt[0], end - decode, end, prompt[1]))
            prompt = None
    return out


def busy_share(t: Timing, others: list[Timing]) -> float:
    """The share of ``t``'s prefill during which ``others`` (another worker's requests,
    prefill or decode) were running: on shared cores, work that slows it."""
    if t.prefill_s <= 0:
        return 0.0
    busy = sum(max(0.0, min(t.prefill_end, o.end) - max(t.prefill_start, o.prefill_start))
               for o in others)
    return busy / t.prefill_s
