"""Decision log storage and the recorder: durability, privacy, overload, retention."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from cachepilot.core.lifecycle import Outcome
from cachepilot.records import NullRecorder, Recorder, open_log, open_recorder
from cachepilot.records.schema import (
    SCHEMA_VERSION,
    check_record,
    decision_to_record,
    hash_hex,
    hashes_hex,
    outcome_fields,
    record_hashes,
)
from cachepilot.records.store import Store

from helpers.paths import ROOT
from helpers.polling import until
from helpers.records import make_router, route

MARKER = "ZEBRA-QUOKKA-4417 is the secret prompt marker"


def test_record_roundtrip_and_outcome_merge(tmp_path: Path) -> None:
    router, pool = make_router()
    decisions = route(router, 50)
    with Recorder(tmp_path / "log") as rec:
        for d in decisions:
            assert rec.decision(d, pool)
        rec.outcome(decisions[3].id, Outcome(status=200, ttft_ms=41.5, ttft_kind="first_token"))
        rec.outcome(decisions[3].id,
                    Outcome(cached_tokens=0, completed_at=9.5, completion_tokens=12))
        assert rec.flush()
        got = rec.get(decisions[3].id)  # read through the writer's own environment
        assert got is not None and got["outcome"]["ttft_ms"] == 41.5
        assert open_log(tmp_path / "log") is rec.store  # same-process readers share it
    log = open_log(tmp_path / "log")
    recs = list(log)
    assert [r["id"] for r in recs] == [d.id for d in decisions]  # arrival order
    r3 = log.get(decisions[3].id)
    d3 = decisions[3]
    assert r3["schema_version"] == SCHEMA_VERSION
    assert r3["chosen"] == d3.chosen and r3["margin_ms"] == d3.margin_ms
    assert record_hashes(r3) == list(d3.hashes)
    assert len(r3["candidates"]) == 3 and r3["candidates"][0]["metrics"]["num_blocks"] == 2000
    assert r3["cost"]["prefill_ms_per_token"] == pool.spec.cost.prefill_ms_per_token
    out = r3["outcome"]
    assert out["status"] == 200 and out["completion_tokens"] == 12  # both reports merged
    assert out["ttft_error_ms"] == pytest.approx(41.5 - d3.winner.predicted_ttft_ms)
    assert out["measured_hit"] is False
    assert out["hit_predicted_right"] is (not d3.predicted_hit)
    assert log.get(decisions[4].id)["outcome"] is None
    assert log.get("nope") is None
    log.close()


def test_hashes_one_string_and_the_old_list_read_alike() -> None:
    """Schema 3 writes the hashes as one string of 16-digit groups; schemas 1 and 2 wrote a
    list of them. Both read back as the same ints, the top bit and a wider int included."""
    hashes = [0, 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]
    text = hashes_hex(hashes)
    assert text == "".join(hash_hex(h) for h in hashes) and len(text) == 16 * len(hashes)
    assert record_hashes({"hashes": text}) == hashes
    assert record_hashes({"hashes": [hash_hex(h) for h in hashes]}) == hashes
    assert hashes_hex([2**64 + 5]) == hash_hex(5)  # wider than 64 bits: masked, as before
    assert hashes_hex([]) == "" and record_hashes({"hashes": ""}) == []
    with pytest.raises(ValueError, match="16-digit"):
        record_hashes({"id": "x", "hashes": "abc"})


def test_gateway_calls_as_made_by_the_ext_proc_processor(tmp_path: Path) -> None:
    """The gateway's sink calls: decision(d) without a pool (found through the router),
    outcome in the gateway's vocabulary (ttft_kind, aborted, None for unknowns)."""
    from cachepilot.records.stats import summarize

    router, pool = make_router()
    d1, d2 = route(router, 2)
    with Recorder(tmp_path / "log", router=router) as rec:
        for d, kind in ((d1, "first_token"), (d2, "first_byte")):
            rec.decision(d)
            rec.outcome(d.id, Outcome(status=200, aborted=False, ttft_ms=30.0, ttft_kind=kind,
                        first_byte_ms=5.0, completed_at=3.0))
    log = open_log(tmp_path / "log")
    r1, r2 = log.get(d1.id), log.get(d2.id)
    assert r1["cost"] == pool.spec.cost.to_dict() and "metrics" in r1["candidates"][0]
    assert r1["outcome"]["ttft_kind"] == "first_token"
    assert r2["outcome"]["ttft_kind"] == "first_byte"
    assert r1["outcome"]["aborted"] is False and "cached_tokens" not in r1["outcome"]
    assert summarize(log)["ttft"]["n"] == 1  # only the streamed one is a real TTFT
    log.close()


def test_an_idle_writer_backs_off_and_still_writes_the_next_record(tmp_path: Path) -> None:
    """With nothing to write the writer's tick doubles up to idle_tick_s (it ticked every
    linger_s, 50 times a second, before); a record after a quiet spell is written within
    about one idle tick, without a flush."""
    router, pool = make_router()
    d = route(router, 1)[0]
    with Recorder(tmp_path / "log", linger_s=0.02, idle_tick_s=0.5) as rec:
        waits: list[float | None] = []
        wait = rec._wake.wait

        def counted(timeout: float | None = None) -> bool:
            waits.append(timeout)
            return wait(timeout)

        rec._wake.wait = counted  # type: ignore[method-assign]
        time.sleep(1.5)
        assert len(waits) <= 10, waits  # ticking every 20 ms: ~75
        assert max(t for t in waits if t is not None) == 0.5
        rec.decision(d, pool)
        until(lambda: rec.get(d.id), timeout=5.0, what="the record written without a flush")


def test_schema_version_checked() -> None:
    router, _ = make_router()
    rec = decision_to_record(route(router, 1)[0])
    check_record(rec)
    with pytest.raises(ValueError, match="schema"):
        check_record({**rec, "schema_version": SCHEMA_VERSION + 1})


def test_a_log_of_an_older_schema_is_written_on(tmp_path: Path) -> None:
    """An upgraded gateway keeps its --decision-log: records of schema 2 (hashes as a list)
    and new ones sit side by side and read alike; a log of a newer schema is refused."""
    router, pool = make_router()
    old, new = route(router, 2)
    store = Store(tmp_path / "log")
    rec = decision_to_record(old, pool=pool)
    store.write([{**rec, "schema_version": 2, "hashes": [hash_hex(h) for h in old.hashes]}])
    with store.env.begin(write=True) as txn:
        txn.put(b"schema_version", b"2", db=store._meta)
    store.close()
    with Recorder(tmp_path / "log") as recorder:
        assert recorder.decision(new, pool) and recorder.flush()
    log = open_log(tmp_path / "log")
    got = {r["id"]: r for r in log}
    assert got[old.id]["schema_version"] == 2
    assert got[new.id]["schema_version"] == SCHEMA_VERSION
    assert record_hashes(got[old.id]) == list(old.hashes)
    assert record_hashes(got[new.id]) == list(new.hashes)
    log.close()
    store = Store(tmp_path / "log")  # the writer marked the log with the newest schema
    with store.env.begin(write=True) as txn:
        assert txn.get(b"schema_version", db=store._meta) == str(SCHEMA_VERSION).encode()
        txn.put(b"schema_version", str(SCHEMA_VERSION + 1).encode(), db=store._meta)
    store.close()
    with pytest.raises(ValueError, match="reads"):
        Store(tmp_path / "log")


def test_an_outcome_is_stored_as_what_it_says() -> None:
    """Unknowns (None) are left out, so a later report can fill them in; who answered goes
    under ``extra``; whether the driver observed the end is the driver's, not stored."""
    fields = outcome_fields(Outcome(status=200, ttft_ms=12.5, ttft_kind="first_token",
                                    answered_by="10.0.0.1:8000", observed=True))
    assert fields == {"status": 200, "ttft_ms": 12.5, "ttft_kind": "first_token",
                      "aborted": False, "extra": {"answered_by": "10.0.0.1:8000"}}


_KILLED_WRITER = textwrap.dedent("""
    import sys
    sys.path[:0] = {paths!r}
    from helpers.records import make_router, route
    from cachepilot.core.lifecycle import Outcome
    from cachepilot.records import Recorder

    router, pool = make_router()
    rec = Recorder(sys.argv[1], batch_size=64)
    n = 0
    while True:
        for d in route(router, 100):
            rec.decision(d, pool)
            rec.outcome(d.id, Outcome(status=200, ttft_ms=50.0, ttft_kind="first_token"))
            n += 1
        rec.flush()
        print(f"committed {{n}} {{d.id}}", flush=True)
""")


def test_records_survive_a_killed_writer(tmp_path: Path) -> None:
    """SIGKILL the writing process mid-stream: every record it saw committed is there,
    every record there is whole, and what is there is a gap-free prefix of what it wrote."""
    # tests/ on its path, as pytest's pythonpath has it: the writer imports the helpers.
    script = _KILLED_WRITER.format(paths=[str(ROOT / "tests")])
    path = tmp_path / "log"
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    committed = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            committed = int(line.split()[1])
            if committed >= 500:
                break
        # Kill it mid-round: once the log holds records beyond the last commit it reported,
        # it is writing a round it has not committed yet.
        reader = open_log(path)
        try:
            until(lambda: len(reader) > committed, timeout=30,
                  what=f"the writer storing records beyond the {committed} it committed")
        finally:
            reader.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert committed >= 500
    log = open_log(path)
    recs = list(log)  # every record is parsed and schema-checked on the way out
    counters = [int(r["id"].split("-")[1], 16) for r in recs]
    assert len(recs) >= committed
    assert counters == list(range(1, len(recs) + 1))  # nothing lost before the last commit
    for r in recs[:committed]:
        assert r["outcome"] is not None and r["outcome"]["ttft_ms"] == 50.0
    log.close()
    # The log takes new writes after the crash, and continues the order.
    with Recorder(path) as rec:
        router, pool = make_router()
        router._id_prefix = "after"
        d = route(router, 1)[0]
        rec.decision(d, pool)
    log = open_log(path)
    assert log.last_id() == d.id and len(log) == len(recs) + 1
    log.close()


def _raw_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in path.iterdir() if p.is_file())


def test_no_prompt_text_unless_captured(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    router, pool = make_router()
    d = route(router, 1, prompt=MARKER * 20)[0]
    with Recorder(tmp_path / "plain") as rec:
        rec.decision(d, pool, prompt=MARKER * 20)
    assert len(open_log(tmp_path / "plain")) == 1
    assert b"ZEBRA-QUOKKA" not in _raw_bytes(tmp_path / "plain")
    # The same call with capture on stores it, and says so loudly: the test above can fail.
    with caplog.at_level(logging.WARNING, "cachepilot.records"), \
            Recorder(tmp_path / "captured", capture_prompts=True) as rec:
        rec.decision(d, pool, prompt=MARKER * 20)
    assert b"ZEBRA-QUOKKA" in _raw_bytes(tmp_path / "captured")
    assert any("prompt capture is ON" in r.message for r in caplog.records)


def _dropped(kind: str, reason: str) -> float:
    return REGISTRY.get_sample_value("cachepilot_decision_records_dropped_total",
                                     {"kind": kind, "reason": reason}) or 0.0


def test_overload_drops_are_counted_and_logged(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    router, pool = make_router()
    decisions = route(router, 200)
    rec = Recorder(tmp_path / "log", queue_size=16, batch_size=4)
    gate = threading.Event()
    write = rec.store.write

    def stalled_write(**kw):  # a disk that stops answering
        gate.wait(10)
        return write(**kw)

    rec.store.write = stalled_write  # type: ignore[method-assign]
    before = _dropped("decision", "queue_full")
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, "cachepilot.records"):
        accepted = [rec.decision(d, pool) for d in decisions]
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0  # the request path never waited for the stalled writer
    dropped = accepted.count(False)
    assert 0 < dropped <= 200 - 16
    assert rec.dropped["decision:queue_full"] == dropped
    assert _dropped("decision", "queue_full") - before == dropped
    assert any("dropped" in r.message for r in caplog.records)
    gate.set()
    rec.close()
    log = open_log(tmp_path / "log")
    assert len(log) == accepted.count(True) == rec.written["decision"]
    log.close()


def test_normal_load_drops_nothing(tmp_path: Path) -> None:
    router, pool = make_router()
    decisions = route(router, 3000)
    with Recorder(tmp_path / "log") as rec:
        for d in decisions:
            assert rec.decision(d, pool)
            assert rec.outcome(d.id, Outcome(status=200, ttft_ms=20.0, ttft_kind="first_token"))
    assert rec.dropped == {} and rec.written == {"decision": 3000, "outcome": 3000}
    log = open_log(tmp_path / "log")
    recs = list(log.records(chunk=700))  # iteration resumes correctly across chunks
    assert [r["id"] for r in recs] == [d.id for d in decisions]
    assert all(r["outcome"]["ttft_ms"] == 20.0 for r in recs)
    log.close()


def test_metrics_go_to_the_given_registry(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    router, pool = make_router()
    with Recorder(tmp_path / "log", registry=registry) as rec:
        for d in route(router, 5):
            rec.decision(d, pool)
    assert registry.get_sample_value("cachepilot_decision_records_written_total",
                                     {"kind": "decision"}) == 5
    with Recorder(tmp_path / "log2", registry=registry) as rec:  # a second one shares them
        rec.outcome("missing", Outcome(status=500))
    assert registry.get_sample_value("cachepilot_decision_records_dropped_total",
                                     {"kind": "outcome", "reason": "no_decision"}) == 1


def test_orphan_outcome_is_counted(tmp_path: Path) -> None:
    with Recorder(tmp_path / "log") as rec:
        rec.outcome("never-recorded", Outcome(status=200))
        rec.flush()
        assert rec.dropped == {"outcome:no_decision": 1}
        assert rec.store.outcome_count() == 0


def test_retention_by_age_and_size(tmp_path: Path) -> None:
    router, pool = make_router()
    decisions = route(router, 1500)
    store = Store(tmp_path / "log", max_bytes=1 << 20, max_age_s=3600)
    records = [decision_to_record(d, pool=pool) for d in decisions]
    for i in range(0, 1500, 100):
        store.write(records[i:i + 100])
    assert store.used_bytes() > 1 << 20
    store.prune()
    assert store.used_bytes() <= 1 << 20
    kept = [r["id"] for r in store]
    assert 0 < len(kept) < 1500
    assert kept == [d.id for d in decisions[-len(kept):]]  # the newest survive
    assert store.get(decisions[0].id) is None
    # An hour and a bit later everything has aged out.
    assert store.prune(now_ns=time.time_ns() + int(3700e9)) == len(kept)
    assert len(store) == 0 and store.used_bytes() < 64 << 10
    store.close()


def test_open_recorder_and_null(tmp_path: Path) -> None:
    assert isinstance(open_recorder(None), NullRecorder)
    null = open_recorder("")
    router, pool = make_router()
    d = route(router, 1)[0]
    assert null.decision(d, pool) is False and null.get(d.id) is None
    rec = open_recorder(tmp_path / "x", durable=False)
    assert isinstance(rec, Recorder)
    rec.close()
    assert rec.decision(d) is False and rec.dropped == {"decision:closed": 1}
    assert os.path.exists(tmp_path / "x" / "data.mdb")
