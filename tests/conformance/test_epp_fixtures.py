"""The conformance suite against EPPs that are not CachePilot: the independent EPP written
from the protocol text alone passes every protocol rule (so the required tier encodes no
CachePilot quirk) and fails the recommended ones it does not implement; the complete EPP
passes the whole EPP-Core profile; each deliberately broken EPP fails exactly its rules
(mutation testing of the suite). Also the report and the command line."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cachepilot.conformance import Report, SuiteConfig, catalog, run_suite
from cachepilot.conformance.__main__ import main
from cachepilot.conformance.report import Implementation, conformance_report, profile_report
from cachepilot.conformance.rules import EXTENSION, PROTOCOL, REFERENCE
from cachepilot.tooling.stack import free_port

from helpers.broken_epps import BROKEN, CompleteEpp
from helpers.independent_epp import MinimalEpp
from helpers.tools import envoy_problem

_PROBLEM = envoy_problem()
pytestmark = [pytest.mark.envoy, pytest.mark.skipif(bool(_PROBLEM), reason=_PROBLEM or "")]
_IDS = {r.cls: {x.id for x in catalog() if x.cls == r.cls} for r in catalog()}
# What the independent EPP does not do (none of it is in the protocol).
MINIMAL_FAILS = {"R01", "R03", "R04", "R05", "R06", "R07", "X01", "X02", "X03"}


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _run(cls: type[MinimalEpp], profiles: tuple[str, ...] = ("epp-core",),
               only: tuple[str, ...] = ()) -> Report:
    """A pool of three IPv4 workers and one IPv6, a second pool of two, an EPP of ``cls``
    for each."""
    workers = [("127.0.0.1", free_port()) for _ in range(3)] + [("::1", free_port())]
    workers_b = [("127.0.0.1", free_port()) for _ in range(2)]
    a = cls([_address(*w) for w in workers])
    b = cls([_address(*w) for w in workers_b])
    try:
        cfg = SuiteConfig(epp=("127.0.0.1", await a.start()), workers=workers,
                          epp_b=("127.0.0.1", await b.start()), workers_b=workers_b,
                          saturation_window_s=1.0, settle_timeout_s=3.0, profiles=profiles,
                          only=only)
        return await run_suite(cfg)
    finally:
        await a.stop()
        await b.stop()


@pytest.fixture(scope="module")
def reports() -> Iterator[dict[str, Report]]:
    """Every fixture EPP's run, three at a time (most of a run is waiting)."""
    cases: dict[str, tuple[type[MinimalEpp], tuple[str, ...]]] = {
        "minimal": (MinimalEpp, ("epp-core", "cachepilot")),
        "complete": (CompleteEpp, ("epp-core",)),
        **{name: (cls, ("epp-core",)) for name, (cls, _) in BROKEN.items()}}

    async def all_runs() -> dict[str, Report]:
        gate = asyncio.Semaphore(3)

        async def one(cls: type[MinimalEpp], profiles: tuple[str, ...]) -> Report:
            async with gate:
                return await _run(cls, profiles)
        done = await asyncio.gather(*(one(*c) for c in cases.values()))
        return dict(zip(cases, done, strict=True))
    out = asyncio.run(all_runs())
    for name, rep in out.items():
        print(name, rep.error, sorted(rep.failed()))
    yield out


def _check_ran(report: Report, classes: set[str]) -> None:
    assert not report.error, report.error
    assert {r.id for r in report.results} == set().union(*(_IDS[c] for c in classes))
    skipped = [r.id for r in report.results if r.outcome == "skipped"]
    assert not skipped, f"skipped: {skipped}"


def test_independent_epp_passes_every_protocol_rule(reports: dict[str, Report]) -> None:
    report = reports["minimal"]
    _check_ran(report, {PROTOCOL, REFERENCE, EXTENSION})
    failed = {r.id: r.detail for r in report.results if r.cls == PROTOCOL and not r.passed}
    assert not failed, failed
    # It implements none of the reference's extras nor CachePilot's, and the suite says so.
    assert report.failed() == MINIMAL_FAILS


def test_complete_epp_passes_epp_core(reports: dict[str, Report]) -> None:
    report = reports["complete"]
    _check_ran(report, {PROTOCOL, REFERENCE})
    assert {r.id: r.detail for r in report.results if not r.passed} == {}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_epp_fails_exactly_its_rules(reports: dict[str, Report], name: str) -> None:
    report = reports[name]
    _check_ran(report, {PROTOCOL, REFERENCE})
    expected = BROKEN[name][1]
    details = {r.id: r.detail for r in report.results if not r.passed}
    assert set(details) == expected, details


def test_every_rule_can_fail() -> None:
    """Each protocol and reference rule is failed by some broken EPP, each extension rule by
    the independent one: no rule passes whatever the EPP does."""
    caught = set().union(*(fails for _, fails in BROKEN.values())) | MINIMAL_FAILS
    assert {r.id for r in catalog()} <= caught


def test_rules_are_classed_and_cited() -> None:
    for r in catalog():
        assert r.cls in (PROTOCOL, REFERENCE, EXTENSION)
        assert r.sources, r.id
        for s in r.sources:
            cite = s.cite()
            # Upstream text is cited at a commit (or by its URL); CachePilot's own docs may not be.
            assert cite.startswith(("https://", "CachePilot ")) or " @" in cite, (r.id, cite)
        if r.cls != EXTENSION:
            assert all(not s.cite().startswith("CachePilot ") for s in r.sources), r.id
        assert (r.cls == REFERENCE) == bool(r.feature), r.id
    protocol_cites = {s.cite() for r in catalog() if r.cls == PROTOCOL for s in r.sources}
    assert all(any("004-endpoint-picker-protocol" in c for c in {s.cite() for s in r.sources})
               for r in catalog() if r.cls == PROTOCOL), protocol_cites


def test_report_has_the_upstream_shape(reports: dict[str, Report]) -> None:
    impl = Implementation("example", "fixture-epp", "https://example.com/epp", "v0.1.0",
                          ["https://example.com/issues"])
    doc = yaml.safe_load(yaml.safe_dump(conformance_report(reports["subset-list-only"], impl)))
    assert doc["GatewayAPIInferenceExtensionVersion"] == "v1.6.0"
    assert doc["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert doc["kind"] == "ConformanceReport"
    assert doc["implementation"]["project"] == "fixture-epp"
    [profile] = doc["profiles"]
    assert profile["name"] == "EPP-Core"
    assert profile["core"] == {"result": "success", "statistics": {
        "Passed": len(_IDS[PROTOCOL]), "Failed": 0, "Skipped": 0}}
    assert profile["summary"] == "Core tests succeeded."
    ext = profile["extended"]
    assert ext["result"] == "failure" and ext["failedTests"] == ["SubsetHintString"]
    assert ext["statistics"] == {"Passed": len(_IDS[REFERENCE]) - 1, "Failed": 1, "Skipped": 0}
    assert ext["unsupportedFeatures"] == ["SubsetHintString"]
    assert "SubsetHintString" not in ext["supportedFeatures"]
    assert "unsupportedFeatures" not in profile_report("epp-core", reports["complete"])["extended"]
    assert len(ext["supportedFeatures"]) == len(_IDS[REFERENCE]) - 1
    by_id = {r["id"]: r for r in doc["rules"]}
    assert by_id["P06"]["class"] == "protocol" and by_id["P06"]["level"] == "required"
    assert by_id["R07"]["result"] == "failed" and by_id["R07"]["level"] == "recommended"
    assert any("L42 @84436a96b9e6" in s["citation"] for s in by_id["P06"]["sources"])


def test_command_line_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    """``--profile epp-core --report FILE`` against an EPP running in another thread."""
    workers = [("127.0.0.1", free_port()) for _ in range(3)] + [("::1", free_port())]
    epp = CompleteEpp([_address(*w) for w in workers])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(epp.start(), loop).result(10)
    out = tmp_path / "report.yaml"
    try:
        status = main(["--epp", f"127.0.0.1:{port}", "--profile", "epp-core",
                       "--workers", ",".join(_address(*w) for w in workers),
                       "--only", "P01,P03,P15,R07", "--report", str(out),
                       "--project", "fixture-epp", "--version", "v0.1.0"])
    finally:
        asyncio.run_coroutine_threadsafe(epp.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    assert status == 0, capsys.readouterr().out
    doc = yaml.safe_load(out.read_text())
    [profile] = doc["profiles"]
    assert profile["core"]["statistics"] == {"Passed": 2, "Failed": 0, "Skipped": 1}
    assert profile["core"]["skippedTests"] == ["PoolsScoped"]
    assert profile["summary"] == "Core tests partially succeeded with 1 test skips."
    assert [r["id"] for r in doc["rules"]] == ["P01", "P03", "R07", "P15"]
    text = capsys.readouterr().out
    assert "SKIP  P15 required" in text and "PASS  R07 recommended" in text


def test_command_line_lists_every_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--epp", "127.0.0.1:1", "--list"]) == 0
    text = capsys.readouterr().out
    for r in catalog():
        assert f"{r.id} {r.level}" in text
