"""The chat study on vLLM (lab/vllm_chat_study.py) without vLLM: its traffic (sessions whose
turns resend a growing history), its report on hand-made samples (bars, exactness checks,
outside traffic) and the CLI's ``--api chat`` path end to end on canned data (the slow path,
real workers behind the gateway, is the study itself: docs/results/vllm-chat)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from cachepilot.cli import main
from cachepilot.lab import vllm_chat_study as chat
from cachepilot.lab.output import StudyOutput
from cachepilot.lab.vllm_report import bar_for, meets, prediction, write_outputs
from cachepilot.lab.vllm_study import phase_record, summarise


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def test_sessions_resend_a_growing_history() -> None:
    cfg = chat.ChatStudyConfig(requests=60)
    reqs = chat.sessions(cfg, 1, "gemma")
    assert reqs == chat.sessions(cfg, 1, "gemma")  # the same requests under every policy
    assert reqs != chat.sessions(cfg, 2, "gemma")
    assert len(reqs) == 60 and [r.index for r in reqs] == list(range(60))
    by_index = {r.index: r for r in reqs}
    follow_ups = 0
    for r in reqs:
        msgs = r.body["messages"]
        assert r.body["stream"] and r.body["max_tokens"] == 1
        assert r.body["stream_options"] == {"include_usage": True}
        assert msgs[-1]["role"] == "user"
        roles = [m["role"] for m in msgs if m["role"] != "system"]
        assert roles == ["user", "assistant"] * r.turn + ["user"]  # Gemma's alternation
        if r.after is None:
            assert r.turn == 0
            continue
        follow_ups += 1
        prev = by_index[r.after]
        assert prev.index < r.index and (prev.session, prev.turn + 1) == (r.session, r.turn)
        # The previous request's messages, then the reply and a new question.
        assert msgs[:len(prev.body["messages"])] == prev.body["messages"]
        assert [m["role"] for m in msgs[len(prev.body["messages"]):]] == ["assistant", "user"]
    assert follow_ups >= 20
    systems = {_text(r.body["messages"][0]["content"]) for r in reqs
               if r.body["messages"][0]["role"] == "system"}
    assert 2 <= len(systems) <= cfg.systems  # shared by sessions
    text = json.dumps([r.body for r in reqs], ensure_ascii=False)
    assert any(ord(c) > 0x3000 for c in text)  # CJK, emoji
    assert '"type": "text"' in text  # some content as OpenAI text parts
    out = chat.outside_requests(replace(cfg, outside=0.3), 1, ["a:1", "b:1"])
    assert out == chat.outside_requests(replace(cfg, outside=0.3), 1, ["a:1", "b:1"])
    assert 8 <= len(out) <= 30 and set(out.values()) == {"a:1", "b:1"}
    assert chat.outside_requests(cfg, 1, ["a:1", "b:1"]) == {}


def test_the_gateways_renderer_chains_the_turns() -> None:
    """Each turn's full blocks (the gateway's renderer and vLLM's hashes) are a prefix of
    the next turn's: what a worker cached for a turn is a hit for the next one."""
    from cachepilot.core.fingerprint import vllm_block_hashes, vllm_none_hash
    from cachepilot.core.request import CHAT_PATH, parse_openai_body
    from cachepilot.datalayer.model_files import load_prompts
    from cachepilot.tooling.vllm import model
    from cachepilot.tooling.vllm.worker import CHAT_TEMPLATE

    folder = model.prepared()
    if folder is None:
        pytest.skip("model not prepared: make vllm-model")
    prompts = load_prompts(folder, chat_template=CHAT_TEMPLATE)
    reqs = chat.sessions(chat.ChatStudyConfig(requests=40), 3, "gemma")
    hashes = {r.index: vllm_block_hashes(prompts.prompt(parse_openai_body(
        CHAT_PATH, json.dumps(r.body).encode())).token_ids, 32, vllm_none_hash("0"))
        for r in reqs}
    for r in reqs:
        if r.after is not None:
            prev = hashes[r.after]
            assert hashes[r.index][:len(prev)] == prev
    assert max(len(h) for h in hashes.values()) * 32 < chat.ChatStudyConfig.max_model_len


def _samples(seed: int, policy: str, outside: bool) -> list[chat.ChatSample]:
    # (measured, events, approximate): events right but for one false hit in round robin's
    # seed-2 phase; approximate misses what outside traffic stored.
    cases = [(0, 0, 0), (320, 320, 320), (384, 384, 0 if outside else 384), (0, 0, 64),
             (448, 448, 448), (352, 352, 352)]
    if policy == "round_robin" and seed == 2:
        cases[0] = (0, 96, 0)
    return [chat.ChatSample(policy, seed, f"127.0.0.{2 + i % 2}:8000", 500, m, e, a,
                            (0.4 if m else 2.5) + 0.01 * i, "exact", i, float(i), 0,
                            session=i // 2, turn=i % 2, rendered_tokens=500,
                            decision=f"d{seed}{i}",
                            why="false hit: late" if (m == 0) != (e == 0) else None)
            for i, (m, e, a) in enumerate(cases)]


def _data(outside: float) -> dict[str, Any]:
    cfg = chat.ChatStudyConfig(seeds=(1, 2, 3), requests=6, outside=outside)
    phases, samples = [], []
    for seed in cfg.seeds:
        for policy in ("round_robin", "cachepilot"):
            got = _samples(seed, policy, bool(outside))
            samples += got
            phases.append(phase_record(got, seed, policy, 12.0, (3.0, 3.5))
                          | {"render_mismatches": 0, "fallbacks": 0, "outside": 0})
    return {"config": {**asdict(cfg), "api": "chat", "routers": ["round_robin", "cachepilot"],
                       "block_size": 32, "hash_seed": "0",
                       "gateway_policies": chat.GATEWAY_POLICY},
            "workloads": {"vllm": {}}, "phases": phases, "summary": summarise(samples),
            "subscribers": {"127.0.0.2:8000": {"mode": "exact", "batches": 40, "gaps": 0,
                                               "holes": 0, "malformed": 0}},
            "checks": {"render_mismatches": 0, "fallbacks": 0, "gateway_restarts": 6},
            "samples": [asdict(s) for s in samples], "wall_s": 300.0,
            "loadavg_start": [3.0, 3.0, 3.0], "loadavg_end": [3.4, 3.0, 3.0]}


def test_report_on_chat_samples(tmp_path: Path) -> None:
    data = _data(0.0)
    assert bar_for(data["config"]) == 0.98
    pred = prediction(data["samples"], ["round_robin", "cachepilot"])
    ev = pred["round_robin"]["events"]["pooled"]
    assert (ev["tp"], ev["fp"], ev["fn"]) == (12, 1, 0)
    assert meets(pred, 0.98, "cachepilot") and not meets(pred, 0.98, "round_robin")
    assert not meets(pred, 0.98)  # 24 / 25 = 0.96 over all requests
    write_outputs(data, StudyOutput(tmp_path, "cachepilot experiment real-model --api chat"))
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# CachePilot on two real vLLM workers: chat through the gateway")
    assert "`cachepilot experiment real-model --api chat`" in text
    assert "Envoy and the gateway" in text and "`priced`" in text
    assert "differed from the engine's `prompt_tokens` 0 times" in text
    assert "≥ 0.98 on all 36 requests: **missed**" in text
    assert "per policy: round_robin missed; cachepilot met" in text
    assert "| 2 | round_robin | 0 | 127.0.0.2:8000 | 96 | 0 | 0 | false hit: late |" in text
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["bar"] == 0.98 and doc["meets_bar"] is False
    assert doc["meets_bar_by_policy"] == {"round_robin": False, "cachepilot": True}
    assert doc["checks"]["gateway_restarts"] == 6 and "samples" not in doc


def test_outside_traffic_has_the_lower_bar(tmp_path: Path) -> None:
    data = _data(0.3)
    assert bar_for(data["config"]) == 0.95
    assert bar_for({"outside": 0.3}) == 0.98  # the completions study's bar is unchanged
    pred = write_outputs(data, StudyOutput(tmp_path, "cmd"))
    assert pred["all"]["approximate"]["pooled"]["fn"] == 6  # what outside traffic stored
    text = (tmp_path / "report.md").read_text()
    assert "**Outside traffic**: 30%" in text and "bypassing Envoy and the gateway" in text
    assert "≥ 0.95 on all 36 requests: **met**" in text  # 24 / 25 = 0.96


def test_cli_api_chat_writes_the_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``real-model --engine vllm --api chat --json``: the chat study's run (canned here),
    its folder with the reproducing command, and the completions study's keys."""
    from cachepilot.tooling.vllm import stack

    seen: dict[str, Any] = {}

    async def fake_run(cfg: chat.ChatStudyConfig, venv: Path, log_dir: Path,
                       progress: Any = print) -> dict[str, Any]:
        seen["cfg"] = cfg
        return _data(cfg.outside)

    monkeypatch.setattr(stack, "missing", lambda venv=None: None)
    monkeypatch.setattr(chat, "run", fake_run)
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    res = CliRunner().invoke(main, ["experiment", "real-model", "--engine", "vllm", "--api",
                                    "chat", "--outside", "0.3", "--seeds", "1,2,3", "--out",
                                    str(out), "--logs", str(logs), "--json"])
    assert res.exit_code == 0, res.output
    assert isinstance(seen["cfg"], chat.ChatStudyConfig) and seen["cfg"].outside == 0.3
    printed = orjson.loads(res.output)
    assert set(printed) == {"summary", "prediction"}
    assert set(printed["prediction"]) == {"round_robin", "cachepilot", "all"}
    assert set(printed["summary"]["cachepilot"]) >= {"events", "approximate",
                                                      "ttft_p50_predicted_hit_s"}
    doc = json.loads((out / "results.json").read_text())
    assert doc["command"] == ("cachepilot experiment real-model --engine vllm --api chat "
                              f"--json --out {out} --requests 60 --workers 2 --seeds 1,2,3 "
                              "--outside 0.3 --concurrency 2")
    assert (logs / "vllm-study.json").exists()


def test_diagnose_reads_the_engines_events() -> None:
    """A wrong prediction explained: a false hit whose block 0 the engine removed in a step
    announced after the decision; a missed hit on a block announced after it (a request the
    gateway never routed); a false hit the events had already refuted (our bug)."""
    from cachepilot.records.schema import hash_hex

    w, t = "127.0.0.2:8000", 1000.0
    rec = {"time": t, "hashes": [hash_hex(h) for h in (11, 12, 13)]}
    log = [chat.Logged(w, t - 5, t - 5, "BlockStored", frozenset({11, 12, 13})),
           chat.Logged("127.0.0.3:8000", t + 0.1, t + 0.1, "BlockRemoved", frozenset({11})),
           chat.Logged(w, t + 0.4, t + 0.3, "BlockRemoved", frozenset({11, 12}))]
    why = chat.diagnose(rec, 96, 0, w, log, 32)
    assert why.startswith("false hit: block 0 announced 5.00 s before; its BlockRemoved came "
                          "+0.40 s after the decision (engine step stamped +0.30 s)"), why
    assert chat.diagnose(rec, 96, 96, w, log, 32) == ""  # right
    late = [chat.Logged(w, t + 0.8, t + 0.7, "BlockStored", frozenset({11, 12}))]
    why = chat.diagnose(rec, 0, 64, w, late, 32)
    assert why.startswith("missed hit: block 1 announced +0.80 s after the decision"), why
    known = [chat.Logged(w, t - 1, t - 1, "BlockRemoved", frozenset({11}))]
    assert chat.diagnose(rec, 96, 0, w, known, 32).startswith(
        "false hit: block 0's BlockRemoved came 1.00 s before the decision")
    assert chat.diagnose(rec, 96, 0, w, [], 32) == ("false hit: block 0 pending (routed, not "
                                                    "announced); no removal of it seen after "
                                                    "the decision")
