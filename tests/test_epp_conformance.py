"""The EPP conformance suite (cachepilot.conformance) through a real Envoy against our gateway
in endpoint picker mode: one pytest test per protocol rule, from one run of the suite."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator

import pytest
from google.protobuf import struct_pb2

from cachepilot.conformance import RULES, Report, SuiteConfig, run_suite
from cachepilot.conformance.suite import MODEL, REWRITE_TARGET
from cachepilot.core import BlockConfig, Weights
from cachepilot.core.router import static_router
from cachepilot.gateway.director import GatewayOptions
from cachepilot.gateway.server import GatewayConfig
from cachepilot.tooling.stack import envoy_binary, free_port

from gateway_thread import GatewayThread


def _envoy_problem() -> str | None:
    """Why Envoy cannot run here (None: it can)."""
    try:
        out = subprocess.run([envoy_binary(), "--version"], capture_output=True, timeout=30)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"envoy cannot run: {exc}"
    return None if out.returncode == 0 else f"envoy --version failed: {out.stderr[-300:]!r}"


_PROBLEM = _envoy_problem()
if _PROBLEM:
    print(f"skipping the EPP conformance tests: {_PROBLEM}")
pytestmark = [pytest.mark.envoy, pytest.mark.skipif(bool(_PROBLEM), reason=_PROBLEM or "")]


def _gateway(workers: list[tuple[str, int]], protocol: str) -> GatewayThread:
    addrs = [f"{h}:{p}" for h, p in workers]
    router = static_router(addrs, policy="priced", weights=Weights(),
                           models=(MODEL, REWRITE_TARGET), block=BlockConfig(16, 4.0),
                           capacity_blocks=4096, engine="vllm")
    config = GatewayConfig(grpc_address=f"127.0.0.1:{free_port()}", admin_port=0,
                           scrape_interval_s=0.25, calibrate=False,
                           options=GatewayOptions(protocol=protocol))
    return GatewayThread(router, config)


def _run(protocol: str, only: tuple[str, ...] = ()) -> Report:
    workers = [("127.0.0.1", free_port()) for _ in range(3)]
    with _gateway(workers, protocol) as gw:
        cfg = SuiteConfig(epp=("127.0.0.1", gw.gateway.grpc_port), workers=workers, only=only)
        report = asyncio.run(run_suite(cfg))
    for r in report.results:
        print(f"{'PASS' if r.passed else 'FAIL'} {r.name} {r.seconds:.2f}s {r.detail}")
    assert not report.error, report.error
    return report


@pytest.fixture(scope="module")
def report() -> Iterator[Report]:
    yield _run("epp")


@pytest.mark.parametrize("name", [r.name for r in RULES])
def test_rule(report: Report, name: str) -> None:
    """Every rule, optional ones included: CachePilot implements them all."""
    result = next(r for r in report.results if r.name == name)
    assert result.passed, f"{name}: {result.detail}\n(rule: {result.text})"


def test_auto_protocol_takes_plain_ext_proc_streams_as_epp() -> None:
    """--protocol auto (the default): streams without our x-cachepilot-* metadata are EPP."""
    report = _run("auto", only=("destination_header", "subset_hint_respected",
                                "served_endpoint_reported", "request_body_large_intact"))
    assert [r.name for r in report.results if not r.passed] == []


_SUBSET_RULES = ("destination_header", "subset_hint_respected", "subset_none_eligible_503",
                 "bad_body_400")


@pytest.mark.parametrize(("broken", "with_", "only", "fails"), [
    # blind to envoy.lb.subset_hint: the subset rules fail, the others pass
    ("cachepilot.gateway.epp.subset_hint", lambda msg: None, _SUBSET_RULES,
     {"subset_hint_respected", "subset_none_eligible_503"}),
    # the destination in the header only, no envoy.lb metadata (then the proxy's served
    # report contradicts the pick, and our EPP takes the picked worker for unreachable:
    # the rules after it would fail too, so they are not run here)
    ("cachepilot.gateway.epp.lb_metadata", lambda target: struct_pb2.Struct(),
     ("destination_header", "destination_metadata", "bad_body_400"), {"destination_metadata"}),
], ids=["ignores-subset-hint", "no-lb-metadata"])
def test_suite_fails_a_broken_epp(monkeypatch: pytest.MonkeyPatch, broken: str, with_: object,
                                  only: tuple[str, ...], fails: set[str]) -> None:
    """The suite can fail: a broken EPP fails exactly the rules it breaks."""
    monkeypatch.setattr(broken, with_)
    report = _run("epp", only=only)
    assert {r.name for r in report.results if not r.passed} == fails
