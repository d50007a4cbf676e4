"""benchmarks/message_path.py: the path it times is a request's whole lifecycle (routed,
then released by its access log entry), and its table comes out."""

from __future__ import annotations

import subprocess
import sys

from helpers.paths import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "message_path.py"


def test_each_request_is_routed_and_released() -> None:
    mod = load_benchmark("message_path")
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    streams = mod.gateway()
    pool = next(iter(streams.director.router.pools.values()))
    bodies = mod.prompts(8, 4)
    for b in bodies * 2:
        mod.one(streams, ep.ProcessingRequest(request_body=ep.HttpBody(
            body=b, end_of_stream=True)))
    assert sum(w.assigned for w in pool.workers.values()) == 8
    assert all(w.inflight == 0 for w in pool.workers.values())  # each one released
    assert not streams.handover.unlogged and not streams.handover.ended


def test_the_table() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "1", "--requests", "20",
                        "--evict-mb", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1 and rows[0].count("|") == 5
