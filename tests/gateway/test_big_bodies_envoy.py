"""1 MB and 5 MB prompts, sent chunked, through Envoy in both protocols the gateway speaks:
our own config (the body buffered and sent whole, STREAMED too) and the endpoint picker
protocol (FULL_DUPLEX_STREAMED, the gateway hands the body back in chunks). Every one is
answered by a worker, and a prompt sharing a prefix with an earlier one goes where it went."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from cachepilot.deploy.envoy import EppEnvoyOptions, render
from cachepilot.tooling.procs import wait_http_ok
from cachepilot.tooling.stack import LocalStack, StackConfig, envoy_binary, free_port

from helpers.tools import have_envoy

pytestmark = pytest.mark.skipif(not have_envoy(), reason="no envoy binary")
MODEL = "sim-llama-8b"
SIZES = (1 << 20, 5 << 20)


def chunked(size: int, tag: str):  # type: ignore[no-untyped-def]
    """A completions body of ~``size`` bytes sharing its first 90 % with every other of
    that size, sent in 64 KB chunks (no content-length: Transfer-Encoding: chunked)."""
    head = b'{"model":"%s","max_tokens":1,"prompt":"' % MODEL.encode()
    shared = (b"a long shared document " * (size // 23 + 1))[:size * 9 // 10]
    raw = head + shared + tag.encode() * (size // 10 // len(tag)) + b'"}'

    def gen():  # type: ignore[no-untyped-def]
        for i in range(0, len(raw), 65536):
            yield raw[i:i + 65536]
    return gen()


def send_all(url: str) -> None:
    with httpx.Client(timeout=60) as c:
        for size in SIZES:
            workers = []
            for tag in ("first ", "second "):
                r = c.post(f"{url}/v1/completions", content=chunked(size, tag),
                           headers={"content-type": "application/json"})
                assert r.status_code == 200, (size, r.status_code, r.text[:300])
                workers.append(r.headers.get("x-cachepilot-worker")
                               or r.headers.get("x-conformance-test-served-endpoint"))
            assert workers[0] == workers[1], (size, workers)  # the shared prefix's worker


@pytest.mark.parametrize("body_mode", ["BUFFERED", "STREAMED"])
def test_big_chunked_bodies_through_our_envoy_config(body_mode: str) -> None:
    cfg = StackConfig(workers=2, speed=1000.0, max_body_bytes=8 << 20,
                      envoy={"request_body_mode": body_mode}, worker_args=(
                          "--num-blocks", "1000000"))
    with LocalStack(config=cfg) as stack:
        send_all(stack.url)


def test_big_chunked_bodies_through_the_endpoint_picker_protocol() -> None:
    logs = Path(tempfile.mkdtemp(prefix="cachepilot-bigbody-"))
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, argv: list[str]) -> None:
        procs.append(subprocess.Popen(argv, stdout=open(logs / f"{name}.log", "wb"),  # noqa: SIM115
                                      stderr=subprocess.STDOUT))

    try:
        workers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        for i, w in enumerate(workers):
            spawn(f"worker-{i}", [sys.executable, "-m", "cachepilot", "sim-worker", "--port",
                                  w.rsplit(":", 1)[1], "--speed", "1000", "--num-blocks",
                                  "1000000"])
        grpc_port, admin, listen = free_port(), free_port(), free_port()
        spawn("gateway", [sys.executable, "-m", "cachepilot", "gateway", "--protocol", "epp",
                          "--listen", f"127.0.0.1:{grpc_port}", "--admin-port", str(admin),
                          "--workers", ",".join(workers), "--engine", "sim",
                          "--scrape-interval", "0.1"])
        opts = EppEnvoyOptions(listen_address="127.0.0.1", listen_port=listen,
                               admin_port=free_port(), epp_host="127.0.0.1",
                               epp_port=grpc_port, workers=tuple(workers))
        (logs / "envoy.yaml").write_text(render(opts))
        spawn("envoy", [envoy_binary(), "-c", str(logs / "envoy.yaml"), "--concurrency", "1",
                        "--disable-hot-restart", "-l", "warning"])
        wait_http_ok([f"http://127.0.0.1:{admin}/readyz",
                      f"http://127.0.0.1:{opts.admin_port}/ready"], hint=f"; logs in {logs}")
        send_all(f"http://127.0.0.1:{listen}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
