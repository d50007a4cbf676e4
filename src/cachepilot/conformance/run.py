"""The run: start the fake workers and the suite's Envoy, wait until the EPP routes, run
the rules of the chosen profiles (those that change the workers' state last), stop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cachepilot.conformance import (
    rules_bodies,
    rules_headers,
    rules_routing,
    rules_state,
    rules_subset,
)
from cachepilot.conformance.envoy import SuiteEnvoy
from cachepilot.conformance.rules import (
    EXTENSION,
    PROTOCOL,
    REFERENCE,
    RULES,
    Context,
    Rule,
    SuiteConfig,
)
from cachepilot.conformance.wire import Wire
from cachepilot.conformance.workers import FakeWorker

# Importing a rules module registers its rules in RULES.
_MODULES = (rules_routing, rules_subset, rules_bodies, rules_headers, rules_state)
# Profile → (its name in the report, the class of its core rules, of its extended rules).
PROFILES: dict[str, tuple[str, str, str | None]] = {
    "epp-core": ("EPP-Core", PROTOCOL, REFERENCE),
    "cachepilot": ("CachePilot-Extensions", EXTENSION, None),
}
_ORDER = {PROTOCOL: 0, REFERENCE: 1, EXTENSION: 2}


def catalog() -> list[Rule]:
    """Every rule, in the order run: the others, then those that change the workers."""
    return sorted(RULES, key=lambda r: (r.mutates, _ORDER[r.cls], r.id))


def find(key: str) -> Rule | None:
    key = key.strip().lower()
    return next((r for r in catalog() if key in (r.id.lower(), r.name.lower())), None)


def profile_classes(profiles: tuple[str, ...]) -> set[str]:
    out = set()
    for p in profiles:
        _, core, extended = PROFILES[p]
        out |= {core} | ({extended} if extended else set())
    return out


@dataclass
class Result:
    id: str
    name: str
    cls: str
    outcome: str  # passed | failed | skipped
    seconds: float = 0.0
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)
    error: str = ""  # the suite could not run (Envoy, workers, EPP never ready)
    envoy_version: str = ""
    profiles: tuple[str, ...] = ()

    def by_id(self, rid: str) -> Result:
        return next(r for r in self.results if r.id == rid)

    def failed(self, cls: str | None = None) -> set[str]:
        return {r.id for r in self.results if r.outcome == "failed"
                and (cls is None or r.cls == cls)}

    @property
    def passed(self) -> bool:
        """Every required (protocol) rule, and every extension rule run, passed or was
        skipped (a skip is reported)."""
        return not self.error and not any(
            r.outcome == "failed" for r in self.results if r.cls in (PROTOCOL, EXTENSION))

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "error": self.error, "envoy": self.envoy_version,
                "results": [r.__dict__ for r in self.results]}


def _skip_reason(rule: Rule, cfg: SuiteConfig, ctx_has: dict[str, bool]) -> str:
    if any(k.lower() in (rule.id.lower(), rule.name.lower()) for k in cfg.skip):
        return "declared unsupported (--skip)"
    missing = [n for n in rule.needs if not ctx_has.get(n)]
    if missing:
        return {"ipv6": "no IPv6 worker given (--workers)",
                "pool_b": "no second pool given (--epp-b, --workers-b)"}[missing[0]]
    return ""


def selected(cfg: SuiteConfig) -> list[Rule]:
    classes = profile_classes(cfg.profiles)
    return [r for r in catalog() if r.cls in classes
            and (not cfg.only or any(k.lower() in (r.id.lower(), r.name.lower())
                                     for k in cfg.only))]


async def _wait_ready(ctx: Context) -> None:
    """Until the EPP routes (it may need to find the workers first)."""
    deadline = time.monotonic() + ctx.cfg.ready_timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = await ctx.post(ctx.body("ready?"))
            if r.status == 200:
                return
            last = f"HTTP {r.status}: {r.body[:200]!r}"
        except aiohttp.ClientError as exc:
            last = str(exc)
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the EPP did not route a request in {ctx.cfg.ready_timeout_s}s "
                       f"(last: {last})")


async def run_rule(rule: Rule, ctx: Context) -> Result:
    t0 = time.monotonic()
    try:
        await rule.check(ctx)
        res = Result(rule.id, rule.name, rule.cls, "passed")
    except AssertionError as exc:
        res = Result(rule.id, rule.name, rule.cls, "failed", detail=str(exc))
    except Exception as exc:  # a broken answer fails the rule, not the run
        res = Result(rule.id, rule.name, rule.cls, "failed",
                     detail=f"{type(exc).__name__}: {exc}")
    res.seconds = round(time.monotonic() - t0, 3)
    return res


async def run_suite(cfg: SuiteConfig) -> Report:
    """Start the workers and Envoy, wait for the EPP, run the rules, stop."""
    report = Report(profiles=cfg.profiles)
    workers = [FakeWorker(h, p) for h, p in cfg.workers]
    workers_b = [FakeWorker(h, p) for h, p in cfg.workers_b] if cfg.epp_b else []
    envoy = SuiteEnvoy(cfg.epp, [w.address for w in workers], cfg.epp_b,
                       [w.address for w in workers_b])
    wire = Wire(cfg.epp)
    try:
        for w in (*workers, *workers_b):
            await w.start()
        await envoy.start()
        report.envoy_version = await envoy.version()
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
            ctx = Context(cfg, envoy, workers, workers_b, session, wire)
            await _wait_ready(ctx)
            has = {"ipv6": bool(ctx.ipv6) and len(ctx.ipv4) >= 2,
                   "pool_b": bool(workers_b)}
            for rule in selected(cfg):
                reason = _skip_reason(rule, cfg, has)
                if reason:
                    report.results.append(Result(rule.id, rule.name, rule.cls, "skipped",
                                                 detail=reason))
                    continue
                report.results.append(await run_rule(rule, ctx))
    except (OSError, RuntimeError) as exc:
        report.error = str(exc)
    finally:
        envoy.stop()
        await wire.close()
        for w in (*workers, *workers_b):
            await w.stop()
    return report
