"""``python -m cachepilot.conformance --epp HOST:PORT [--workers ip:port,…]``: run the EPP
conformance suite; exit status 0 when every required rule passed, 1 when one failed, 2 when
the suite could not run."""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson

from cachepilot.conformance.suite import (
    MODEL,
    REWRITE_TARGET,
    RULES,
    UNKNOWN_MODEL,
    SuiteConfig,
    run_suite,
)

DEFAULT_WORKERS = "127.0.0.1:18001,127.0.0.1:18002,127.0.0.1:18003"


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"{flag}: expected host:port, got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cachepilot.conformance",
        description="Endpoint picker conformance through a real Envoy. The EPP under test must "
                    "already know the workers (--workers) as its pool's endpoints and serve "
                    f"the models {MODEL!r} and {REWRITE_TARGET!r}.")
    ap.add_argument("--epp", required=True, help="the EPP's ext_proc gRPC address, host:port")
    ap.add_argument("--workers", default=DEFAULT_WORKERS,
                    help="where the suite's fake workers listen (give the EPP these); "
                         f"default {DEFAULT_WORKERS}")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--rewrite-target", default=REWRITE_TARGET)
    ap.add_argument("--unknown-model", default=UNKNOWN_MODEL)
    ap.add_argument("--only", default="", help="comma-separated rule names")
    ap.add_argument("--strict", action="store_true",
                    help="the optional rules (not required by the reference) must pass too")
    ap.add_argument("--ready-timeout", type=float, default=30.0)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--list", action="store_true", help="list the rules and exit")
    a = ap.parse_args(argv)
    if a.list:
        for r in RULES:
            print(f"{r.name:32} {'required' if r.required else 'optional'}  {r.text}")
        return 0
    only = tuple(x.strip() for x in a.only.split(",") if x.strip())
    unknown = set(only) - {r.name for r in RULES}
    if unknown:
        raise SystemExit(f"--only: no such rule(s): {', '.join(sorted(unknown))} (see --list)")
    cfg = SuiteConfig(epp=_host_port(a.epp, "--epp"),
                      workers=[_host_port(w, "--workers") for w in a.workers.split(",") if w],
                      model=a.model, rewrite_target=a.rewrite_target,
                      unknown_model=a.unknown_model, ready_timeout_s=a.ready_timeout,
                      only=only)
    report = asyncio.run(run_suite(cfg))
    if a.strict:
        for r in report.results:
            r.required = True
    if a.json:
        print(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        if report.error:
            print(f"the suite could not run: {report.error}", file=sys.stderr)
        for r in report.results:
            mark = "PASS" if r.passed else ("FAIL" if r.required else "fail (optional)")
            print(f"{mark:16} {r.name:32} {r.seconds:6.2f}s  {r.detail}")
        n = sum(r.passed for r in report.results)
        print(f"{n}/{len(report.results)} rules passed; "
              f"{'CONFORMANT' if report.passed else 'NOT CONFORMANT'}")
    if report.error:
        return 2
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
