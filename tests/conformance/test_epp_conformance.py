"""The EPP conformance suite (cachepilot.conformance) through a real Envoy against our gateway
in endpoint picker mode: two pools (one with an IPv6 worker), each its own gateway, every
rule of every profile; one pytest test per rule, from one run of the suite."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from cachepilot.conformance import Report, SuiteConfig, catalog, run_suite
from cachepilot.conformance.rules import MODEL, REWRITE_TARGET
from cachepilot.core import BlockConfig, Weights
from cachepilot.core.router import static_router
from cachepilot.gateway.director import GatewayOptions
from cachepilot.gateway.server import GatewayConfig
from cachepilot.tooling.stack import free_port

from helpers.gateway_thread import GatewayThread
from helpers.tools import envoy_problem

_PROBLEM = envoy_problem()
if _PROBLEM:
    print(f"skipping the EPP conformance tests: {_PROBLEM}")
pytestmark = [pytest.mark.envoy, pytest.mark.skipif(bool(_PROBLEM), reason=_PROBLEM or "")]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _gateway(workers: list[tuple[str, int]], protocol: str) -> GatewayThread:
    router = static_router([_address(*w) for w in workers], policy="priced", weights=Weights(),
                           models=(MODEL, REWRITE_TARGET), block=BlockConfig(16, 4.0),
                           capacity_blocks=4096, engine="vllm")
    config = GatewayConfig(grpc_address=f"127.0.0.1:{free_port()}", admin_port=0,
                           scrape_interval_s=0.25, calibrate=False,
                           options=GatewayOptions(protocol=protocol))
    return GatewayThread(router, config)


def _run(protocol: str, only: tuple[str, ...] = ()) -> Report:
    workers = [("127.0.0.1", free_port()) for _ in range(3)] + [("::1", free_port())]
    workers_b = [("127.0.0.1", free_port()) for _ in range(2)]
    with _gateway(workers, protocol) as a, _gateway(workers_b, protocol) as b:
        cfg = SuiteConfig(epp=("127.0.0.1", a.gateway.grpc_port), workers=workers,
                          epp_b=("127.0.0.1", b.gateway.grpc_port), workers_b=workers_b,
                          saturation_window_s=1.0, only=only)
        report = asyncio.run(run_suite(cfg))
    for r in report.results:
        print(f"{r.outcome:7} {r.id} {r.name} {r.seconds:.2f}s {r.detail}")
    assert not report.error, report.error
    return report


@pytest.fixture(scope="module")
def report() -> Iterator[Report]:
    yield _run("epp")


def test_every_rule_ran(report: Report) -> None:
    """Nothing skipped: an IPv6 worker and a second pool were given."""
    assert [r.id for r in report.results] == [r.id for r in catalog()]
    assert {r.outcome for r in report.results} <= {"passed", "failed"}


@pytest.mark.parametrize("rule_id", [r.id for r in catalog()])
def test_rule(report: Report, rule_id: str) -> None:
    """Every rule, recommended and extension ones included: CachePilot implements them."""
    result = report.by_id(rule_id)
    assert result.outcome == "passed", f"{rule_id} {result.name}: {result.detail}"


def test_auto_protocol_takes_plain_ext_proc_streams_as_epp() -> None:
    """--protocol auto (the default): streams without our x-cachepilot-* metadata are EPP."""
    report = _run("auto", only=("P01", "P02", "P05", "P11", "P12", "R05"))
    assert [r.id for r in report.results] == ["P01", "P02", "P05", "P11", "P12", "R05"]
    assert [r.id for r in report.results if not r.passed] == []
