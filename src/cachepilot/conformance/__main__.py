"""``python -m cachepilot.conformance --epp HOST:PORT [--profile epp-core] [--report FILE]``:
run the EPP conformance suite; exit status 0 when every required rule of the chosen profiles
passed (skips are reported), 1 when one failed, 2 when the suite could not run."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
from pathlib import Path

import orjson

from cachepilot.conformance.report import Implementation, conformance_report, dump, text
from cachepilot.conformance.rules import LEVEL, MODEL, REWRITE_TARGET, UNKNOWN_MODEL, SuiteConfig
from cachepilot.conformance.run import PROFILES, catalog, find, run_suite

DEFAULT_WORKERS = "127.0.0.1:18001,127.0.0.1:18002,127.0.0.1:18003,[::1]:18004"
DEFAULT_WORKERS_B = "127.0.0.1:18011,127.0.0.1:18012"


def _host_port(text: str, flag: str) -> tuple[str, int]:
    """``ip:port`` or ``[ipv6]:port`` → (host, port); an IPv6 host must be bracketed."""
    host, sep, port = text.strip().rpartition(":")
    bare = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or (
            ":" in bare and not host.startswith("[")):
        raise SystemExit(f"{flag}: expected host:port or [ipv6]:port, got {text!r}")
    return bare, int(port)


def _workers(text: str, flag: str) -> list[tuple[str, int]]:
    out = [_host_port(w, flag) for w in text.split(",") if w.strip()]
    for host, _ in out:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise SystemExit(f"{flag}: {host!r} is not an IP address (the protocol names "
                             "endpoints as ip:port)") from None
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m cachepilot.conformance",
        description="Endpoint picker conformance, black box, through a real Envoy. The EPP "
                    "under test must already know the workers (--workers) as its pool and "
                    f"serve the models {MODEL!r} and {REWRITE_TARGET!r}. docs/epp.md.")
    ap.add_argument("--epp", required=True, help="the EPP's ext_proc gRPC address, host:port")
    ap.add_argument("--workers", default=DEFAULT_WORKERS,
                    help="the pool: where the suite's fake workers listen (give the EPP these;"
                         f" at least two IPv4, one IPv6 for IPv6Endpoint); {DEFAULT_WORKERS}")
    ap.add_argument("--epp-b", default="", help="a second pool's EPP (rule PoolsScoped)")
    ap.add_argument("--workers-b", default=DEFAULT_WORKERS_B,
                    help=f"the second pool's workers (with --epp-b); {DEFAULT_WORKERS_B}")
    ap.add_argument("--profile", choices=[*PROFILES, "all"], default="all",
                    help="epp-core: the protocol (required) and the reference behaviour "
                         "(recommended); cachepilot: CachePilot's extensions; all: both")
    ap.add_argument("--report", type=Path, help="write the YAML conformance report here")
    ap.add_argument("--organization", default="")
    ap.add_argument("--project", default="")
    ap.add_argument("--url", default="")
    ap.add_argument("--version", default="", help="the EPP's version: a tag or a commit")
    ap.add_argument("--contact", action="append", default=[])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--rewrite-target", default=REWRITE_TARGET)
    ap.add_argument("--unknown-model", default=UNKNOWN_MODEL)
    ap.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    ap.add_argument("--only", default="", help="comma-separated rule ids or names")
    ap.add_argument("--skip", default="",
                    help="comma-separated rule ids or names the EPP declares unsupported "
                         "(reported as skipped)")
    ap.add_argument("--strict", action="store_true",
                    help="the recommended (reference) rules must pass too")
    ap.add_argument("--ready-timeout", type=float, default=30.0)
    ap.add_argument("--settle-timeout", type=float, default=10.0)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--list", action="store_true", help="list the rules and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.list:
        for r in catalog():
            print(f"{r.id} {LEVEL[r.cls]:11} {r.name:32} {r.text}")
            for s in r.sources:
                print(f"{'':16}{s.cite()}")
        return 0
    keys = [x for x in (*a.only.split(","), *a.skip.split(",")) if x.strip()]
    unknown = [k for k in keys if find(k) is None]
    if unknown:
        raise SystemExit(f"no such rule(s): {', '.join(unknown)} (see --list)")
    profiles = tuple(PROFILES) if a.profile == "all" else (a.profile,)
    cfg = SuiteConfig(
        epp=_host_port(a.epp, "--epp"), workers=_workers(a.workers, "--workers"),
        epp_b=_host_port(a.epp_b, "--epp-b") if a.epp_b else None,
        workers_b=_workers(a.workers_b, "--workers-b") if a.epp_b else [],
        model=a.model, rewrite_target=a.rewrite_target, unknown_model=a.unknown_model,
        max_body_bytes=a.max_body_bytes, ready_timeout_s=a.ready_timeout,
        settle_timeout_s=a.settle_timeout, profiles=profiles,
        only=tuple(k.strip() for k in a.only.split(",") if k.strip()),
        skip=tuple(k.strip() for k in a.skip.split(",") if k.strip()))
    if sum(":" not in h for h, _ in cfg.workers) < 2:
        raise SystemExit("--workers: at least two IPv4 workers are needed")
    report = asyncio.run(run_suite(cfg))
    if a.report:
        impl = Implementation(a.organization, a.project, a.url, a.version, a.contact)
        a.report.write_text(dump(conformance_report(report, impl)))
    if a.json:
        print(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        if report.error:
            print(f"the suite could not run: {report.error}", file=sys.stderr)
        print(text(report))
    if report.error:
        return 2
    if a.strict and any(r.outcome == "failed" for r in report.results):
        return 1
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
