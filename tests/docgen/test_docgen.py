"""The docs site's generated reference (cachepilot.docgen) covers what the code has: every CLI
command and option, every CRD field, every Helm value, every metric the gateway exports,
every header constant and admin route, every decision-record field. The pages are built
from the code at `make docs` time; these tests fail when the generator would leave
something out (or cannot describe it)."""

from __future__ import annotations

import json
import re

import click
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from cachepilot.docgen import PAGES, cli, crd, helm, http, metrics, records, render
from cachepilot.gateway.gateway_metrics import GatewayMetrics

from helpers.paths import ROOT


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return render(ROOT)


def test_every_page_renders_and_is_in_the_nav(pages: dict[str, str]) -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for path, text in pages.items():
        assert text.startswith("# ") and "Generated from the code" in text
        assert path in nav, f"{path} is generated but not in mkdocs.yml's nav"
    assert set(pages) == set(PAGES)
    # Generated pages must not shadow hand-written ones.
    for path in pages:
        assert not (ROOT / "docs" / path).exists(), f"docs/{path} would shadow the generated page"


def test_cli_page_has_every_command_and_option(pages: dict[str, str]) -> None:
    text = pages[cli.PATH]
    names = cli.commands()
    assert {"cachepilot gateway", "cachepilot decisions stats",
            "cachepilot experiment seed-claims"} <= set(names)
    root, ctx = cli.root()
    for cmd, cctx in cli.walk(root, ctx):
        assert f"`{cctx.command_path}` {{#{cli.anchor(cctx.command_path)}}}" in text
        section = text.split(f"`{cctx.command_path}` {{#", 1)[1].split("\n#", 1)[0]
        for p in cmd.get_params(cctx):
            if isinstance(p, click.Option) and not p.hidden:
                for opt in p.opts:
                    assert f"`{opt}" in section or f" {opt}" in section or f"/ {opt}" in section, (
                        f"{cctx.command_path}: {opt} missing")


def test_crd_page_has_every_field(pages: dict[str, str]) -> None:
    text = pages[crd.PATH]
    paths = crd.spec_paths() + crd.status_paths()
    assert "spec.routing.cost.prefillMsPerToken" in paths
    for p in paths:
        assert f"`{p}`" in text, p
    for short in crd.crd.SHORT_NAMES:
        assert f"`{short}`" in text
    # Every cost-model field is described (from CostModel's comments or the generator).
    for name in crd.crd.COST_FIELDS.values():
        row = next(r for r in text.splitlines() if r.startswith(f"| `spec.routing.cost.{name}`"))
        assert row.rstrip(" |").split("|")[-1].strip(), f"{name} has no description"


def test_helm_page_has_every_value(pages: dict[str, str]) -> None:
    text = pages[helm.PATH]
    values = yaml.safe_load((ROOT / "charts/cachepilot/values.yaml").read_text())
    schema = json.loads((ROOT / "charts/cachepilot/values.schema.json").read_text())

    def leaves(d: dict, prefix: str = "") -> list[str]:
        out = []
        for k, v in d.items():
            out.append(prefix + k)
            if isinstance(v, dict) and v:
                out += leaves(v, prefix + k + ".")
        return out

    documented = set(helm.documented(ROOT))
    defaults = {r.split("|")[1].strip().strip("`"): r.split("|")[2].strip()
                for r in text.splitlines() if r.startswith("| `")}
    for key in leaves(values):  # a flow mapping ({cpu: 250m}) shows as its key's default
        parts = key.split(".")
        deepest = next(".".join(parts[:i]) for i in range(len(parts), 0, -1)
                       if ".".join(parts[:i]) in documented)
        assert deepest == key or defaults[deepest], key
    for key in schema["properties"]:
        assert f"`{key}`" in text, key
    for key in documented:
        assert f"| `{key}` |" in text


def test_helm_comment_parser() -> None:
    keys = dict(helm.keys("# top\na:\n  # about b\n  b: 1  # trailing\n\n  # orphan\n\n  c: x\n"
                          "d: [1, 2]\n"))
    assert keys == {"a": "top", "a.b": "about b trailing", "a.c": "", "d": ""}


def test_metrics_page_has_every_exported_metric(pages: dict[str, str]) -> None:
    text = pages[metrics.PATH]
    m = GatewayMetrics(CollectorRegistry())
    exposed = generate_latest(m.registry).decode()
    families = set(re.findall(r"^# TYPE (\S+) ", exposed, re.M))
    families -= {f for f in families if f.endswith("_created")}  # a counter's timestamp
    listed = {x.name for x in metrics.metrics()}
    for fam in families:
        kind = re.search(rf"^# TYPE {re.escape(fam)} (\S+)", exposed, re.M)[1]
        name = f"{fam}_total" if kind == "counter" and not fam.endswith("_total") else fam
        assert name in listed, name
    for x in metrics.metrics():
        assert f"`{x.name}`" in text
        assert x.help
    assert "cachepilot_decision_records_dropped_total" in listed


def test_http_page_has_every_header_and_admin_route(pages: dict[str, str]) -> None:
    text = pages[http.PATH]
    for name, header in http.header_constants().items():
        assert name in http.HEADERS, f"protocol.{name} has no description in docgen.http"
        assert f"`{header}`" in text
    routes = http.admin_routes()
    assert "/workers" in routes
    assert set(routes) == set(http.ADMIN)


def test_record_page_has_every_field(pages: dict[str, str]) -> None:
    text = pages[records.PATH]
    rec = records.example()
    for key in rec:
        assert key in records.TOP, f"record key {key!r} has no description in docgen.records"
        assert f"| `{key}` |" in text
    for key in rec["candidates"][0]:
        assert f"| `{key}` |" in text
    for key in rec["outcome"]:
        assert f"| `{key}` |" in text
