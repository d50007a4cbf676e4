"""The machine-readable report, in the shape of the inference extension's conformance
reports (``conformance/conformancereport.go``, which embeds Gateway API's
``conformance/apis/v1`` ConformanceReport; sigs.k8s.io/yaml writes keys sorted, and the
statistics keys as Go spells them): one entry per profile under ``profiles`` with ``core``
(the protocol rules) and ``extended`` (the reference rules, one feature each). Beyond that
schema, ``rules`` lists every rule with its class, level, citations and outcome. In the shape
of, not submittable: upstream takes reports from its own suite only."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import yaml

from cachepilot.conformance.rules import LEVEL
from cachepilot.conformance.run import PROFILES, Report, Result, catalog
from cachepilot.conformance.sources import GIE_RELEASE, PROTOCOL_VERSION


@dataclass
class Implementation:
    organization: str = ""
    project: str = ""
    url: str = ""
    version: str = ""  # a tag or a commit, not a branch
    contact: list[str] = field(default_factory=list)


def _status(results: list[Result]) -> dict[str, Any]:
    stats = {"Passed": sum(r.outcome == "passed" for r in results),
             "Failed": sum(r.outcome == "failed" for r in results),
             "Skipped": sum(r.outcome == "skipped" for r in results)}
    result = ("failure" if stats["Failed"] else "partial" if stats["Skipped"] else "success")
    out: dict[str, Any] = {"result": result, "statistics": stats}
    failed = [r.name for r in results if r.outcome == "failed"]
    skipped = [r.name for r in results if r.outcome == "skipped"]
    if failed:
        out["failedTests"] = failed
    if skipped:
        out["skippedTests"] = skipped
    return out


def _summary(core: dict[str, Any]) -> str:
    s = core["statistics"]
    if core["result"] == "success":
        return "Core tests succeeded."
    if core["result"] == "partial":
        return f"Core tests partially succeeded with {s['Skipped']} test skips."
    return f"Core tests failed with {s['Failed']} test failures."


def profile_report(profile: str, report: Report) -> dict[str, Any]:
    name, core_cls, ext_cls = PROFILES[profile]
    core = _status([r for r in report.results if r.cls == core_cls])
    out: dict[str, Any] = {"name": name, "summary": _summary(core), "core": core}
    if ext_cls is not None:
        ext_results = [r for r in report.results if r.cls == ext_cls]
        features = {r.id: r.feature for r in catalog()}
        extended = _status(ext_results)
        for key, have in (("supportedFeatures", True), ("unsupportedFeatures", False)):
            names = sorted(features[r.id] for r in ext_results if r.passed == have)
            if names:  # omitempty, as upstream
                extended[key] = names
        out["extended"] = extended
    return out


def conformance_report(report: Report, impl: Implementation,
                       now: dt.datetime | None = None) -> dict[str, Any]:
    rules = {r.id: r for r in catalog()}
    date = (now or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "GatewayAPIInferenceExtensionVersion": GIE_RELEASE,
        "apiVersion": "gateway.networking.k8s.io/v1",
        "date": date,
        "eppProtocolVersion": PROTOCOL_VERSION,
        "gatewayAPIChannel": "",
        "gatewayAPIVersion": "",
        "implementation": {"contact": list(impl.contact), "organization": impl.organization,
                           "project": impl.project, "url": impl.url, "version": impl.version},
        "kind": "ConformanceReport",
        "mode": "default",
        "profiles": [profile_report(p, report) for p in report.profiles],
        "rules": [{"class": r.cls, "detail": r.detail, "feature": rules[r.id].feature,
                   "id": r.id, "level": LEVEL[r.cls], "name": r.name, "result": r.outcome,
                   "seconds": r.seconds, "sources": [s.as_dict() for s in rules[r.id].sources],
                   "text": rules[r.id].text}
                  for r in report.results],
        "suite": {"dataPlane": f"envoy {report.envoy_version}".strip(),
                  "error": report.error},
    }


def dump(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=True, allow_unicode=True, width=100)


def text(report: Report) -> str:
    """One line per rule: outcome, id, class, name, time, why it failed or was skipped."""
    lines = []
    for r in report.results:
        mark = {"passed": "PASS", "skipped": "SKIP"}.get(
            r.outcome, "FAIL" if r.cls != "reference" else "fail")
        lines.append(f"{mark:5} {r.id} {LEVEL[r.cls]:11} {r.name:32} {r.seconds:6.2f}s"
                     f"  {r.detail}".rstrip())
    counts = {c: [r for r in report.results if r.cls == c] for c in LEVEL}
    summary = ", ".join(f"{LEVEL[c]} {sum(r.passed for r in rs)}/{len(rs)} passed"
                        + (f" ({sum(r.outcome == 'skipped' for r in rs)} skipped)"
                           if any(r.outcome == "skipped" for r in rs) else "")
                        for c, rs in counts.items() if rs)
    verdict = "CONFORMANT" if report.passed else "NOT CONFORMANT"
    lines.append(f"{summary}; {verdict} (required and extension rules)")
    return "\n".join(lines)
