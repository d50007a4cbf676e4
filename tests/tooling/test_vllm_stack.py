"""``cachepilot up --engine vllm``: two real vLLM workers behind Envoy and the gateway, the
gateway following each worker's KV events (exact directory), and a one-line error when the
vLLM venv is missing.

The stack test is slow (~2-3 min: two vLLM workers start in parallel on the CPU). Needs
``make vllm-venv vllm-model``; skips without them unless CACHEPILOT_REQUIRE_VLLM=1 (CI).
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from cachepilot.cli import main
from cachepilot.core.directory import common_prefix
from cachepilot.core.fingerprint import load_vllm_tokenizer, vllm_block_hashes, vllm_none_hash
from cachepilot.core.request import parse_openai_body
from cachepilot.datalayer.model_files import load_prompts
from cachepilot.tooling.vllm import model
from cachepilot.tooling.vllm.worker import CHAT_TEMPLATE, HASH_SEED

from helpers.polling import until
from helpers.vllm_env import SHARED, VENV, prepared_model


def test_up_without_the_vllm_venv_is_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CACHEPILOT_VLLM_VENV", str(tmp_path / "nowhere"))
    r = CliRunner().invoke(main, ["up", "--engine", "vllm", "--port", "0"])
    assert r.exit_code == 1
    assert f"no vLLM venv at {tmp_path / 'nowhere'}: run make vllm-venv" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_up_engine_vllm_routes_on_exact_events(tmp_path: Path) -> None:
    hf = prepared_model()
    tok = load_vllm_tokenizer(str(hf / "tokenizer.json"))
    prompts = [SHARED + f"Question {q}: " + "what does a parcel of this kind cost? " * 3
               for q in ("one", "two")]
    hashes = [vllm_block_hashes(tok(p), 32, vllm_none_hash(HASH_SEED)) for p in prompts]
    shared = next(k for k, (a, b) in enumerate(zip(*hashes, strict=False)) if a != b)
    assert shared >= 4
    chat = [{"role": "system", "content": SHARED},
            {"role": "user", "content": "Which label do fragile items need?"},
            {"role": "assistant", "content": "The red label."},
            {"role": "user", "content": "And how long do I have to return them?"}]
    rendered = load_prompts(hf, chat_template=CHAT_TEMPLATE)
    chat_ids = [rendered.prompt(parse_openai_body("/v1/chat/completions", json.dumps(
        {"model": model.SERVED_NAME, "messages": m}).encode())).token_ids
        for m in (chat[:2], chat)]
    # The next turn re-sends the first: the full blocks they share are reused.
    chat_hashes = [vllm_block_hashes(i, 32, vllm_none_hash(HASH_SEED)) for i in chat_ids]
    chat_shared = common_prefix(*chat_hashes)
    assert chat_shared >= 4

    env = {**os.environ, "CACHEPILOT_VLLM_VENV": str(VENV), "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "up.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "cachepilot", "up", "--engine", "vllm",
                                 "--port", "0"], stdout=sink, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        def up() -> bool:
            assert proc.poll() is None, out.read_text()
            return "CachePilot is up" in out.read_text()

        until(up, 600, "CachePilot up", interval=1)
        text = out.read_text()
        url = re.search(r"CachePilot is up: (http://\S+)/v1", text)[1]
        admin = re.search(r"gateway admin: (http://\S+)/workers", text)[1]
        with httpx.Client(timeout=300) as client:
            ws = client.get(f"{admin}/workers").json()
            assert len(ws) == 2 and {w["directory_mode"] for w in ws} == {"exact"}
            assert {w["address"].split(":")[0] for w in ws} == {"127.0.0.2", "127.0.0.3"}
            got = []
            for p in prompts:
                r = client.post(f"{url}/v1/completions", json={
                    "model": model.SERVED_NAME, "prompt": p, "max_tokens": 1,
                    "temperature": 0})
                r.raise_for_status()
                got.append((r.headers.get("x-cachepilot-worker"),
                            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0))
            # The second request shares `shared` full blocks with the first: the gateway sends
            # it where the engine announced them, and the engine has them all.
            assert got[0][1] == 0 and got[1][1] == shared * 32, got
            assert got[0][0] == got[1][0] and got[0][0], got
            # The second prompt's new blocks are announced after its step.
            want = len(set(hashes[0]) | set(hashes[1]))

            def announced() -> dict[str, dict]:
                ws = {w["address"]: w for w in client.get(f"{admin}/workers").json()}
                return ws if ws[got[0][0]]["kv_events"]["event_blocks"] == want else {}

            ws = until(announced, 30, "the second prompt's blocks announced", interval=0.1)
            # Chat: a conversation and its next turn, rendered by the gateway with the same
            # template the workers got: routed to its prefix, hit as predicted.
            chats = []
            for turns in (chat[:2], chat):
                r = client.post(f"{url}/v1/chat/completions", json={
                    "model": model.SERVED_NAME, "messages": turns, "max_tokens": 1,
                    "temperature": 0})
                r.raise_for_status()
                chats.append((r.headers.get("x-cachepilot-worker"),
                              r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0))
        held = ws[got[0][0]]["kv_events"]
        assert held["mode"] == "exact" and held["event_blocks"] == want, held
        assert held["wire_format"]["generation"] == "G8" and held["error"] is None
        assert chats[0][0] == chats[1][0] and chats[1][1] == chat_shared * 32, chats
        assert all(w["kv_events"]["holes"] == 0 and w["kv_events"]["malformed"] == 0
                   for w in ws.values())
        print(f"\n(worker, cached_tokens) {got}; shared blocks {shared}; event blocks {want}; "
              f"chat {chats}, shared {chat_shared}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_the_gateway_is_told_the_batch_size_the_workers_run() -> None:
    """vLLM does not export max_num_seqs: the stack passes the same number to the workers
    and to the gateway's cost model, so a full batch is priced as one (core.cost.ahead_of)."""
    from cachepilot.cli.gateway import parse_cost
    from cachepilot.tooling.vllm.stack import VllmStack

    stack = VllmStack(workers=2)
    stack.model = Path("model")
    worker = stack.spec.args(Path("venv"), Path("model"), 8000, 5557)
    n = worker[worker.index("--max-num-seqs") + 1]
    gateway = stack.gateway_args()
    assert parse_cost(gateway[gateway.index("--cost") + 1]).max_batch == int(n) == 128
