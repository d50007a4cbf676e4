"""A real Prometheus server on loopback, for developer tooling and tests: it scrapes the
gateway's ``/metrics`` and answers PromQL over its HTTP API, so the dashboard's queries are
evaluated by Prometheus itself rather than by a re-implementation of PromQL.

The binary comes from Debian's ``prometheus`` package (``apt-get install prometheus``, 2.42
on bookworm; it also brings ``promtool``). Neither is on PyPI; :func:`prometheus_binary` says
how to install it when it is missing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from cachepilot.tooling.procs import Processes, http_get
from cachepilot.tooling.stack import free_port

INSTALL_HINT = "install Debian's prometheus package: apt-get install -y prometheus"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        raise RuntimeError(f"no prometheus binary on PATH: {INSTALL_HINT}")
    return found


def promtool_binary() -> str | None:
    return shutil.which("promtool")


class PromQLError(RuntimeError):
    """Prometheus refused a query (bad syntax, unknown function, …) or failed it."""


class Prometheus:
    """``prometheus`` scraping ``targets`` (host:port, path /metrics) every
    ``scrape_interval_s``, its TSDB in a temporary directory; a context manager."""

    def __init__(self, targets: list[str], *, scrape_interval_s: float = 1.0,
                 log_dir: Path | None = None, job: str = "cachepilot-gateway") -> None:
        self.targets = targets
        self.scrape_interval_s = scrape_interval_s
        self.job = job
        self.dir = Path(log_dir or tempfile.mkdtemp(prefix="cachepilot-prometheus-"))
        self.processes = Processes(self.dir)
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        self.dir.mkdir(parents=True, exist_ok=True)
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        config = {"global": {"scrape_interval": interval, "evaluation_interval": interval,
                             "scrape_timeout": interval},
                  "scrape_configs": [{"job_name": self.job,
                                      "static_configs": [{"targets": self.targets}]}]}
        cfg = self.dir / "prometheus.yml"
        cfg.write_text(json.dumps(config))  # YAML is a superset of JSON
        self.port = free_port()
        self.processes.spawn("prometheus", [
            prometheus_binary(), f"--config.file={cfg}",
            f"--storage.tsdb.path={self.dir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"])
        try:
            self.processes.wait_ready([f"{self.url}/-/ready"], timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.processes.stop()

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the HTTP API -------------------------------------------------------------------------
    def _api(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        code, body = http_get(url, timeout=30.0)
        try:
            reply = json.loads(body)
        except ValueError as exc:
            raise PromQLError(f"{path}: HTTP {code}: {body[:200]!r}") from exc
        if reply.get("status") != "success":
            raise PromQLError(f"{reply.get('errorType')}: {reply.get('error')} "
                              f"({params.get('query', '')})")
        return reply["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector: ``[{"metric": {...}, "value": [t, "v"]}, …]``."""
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        data = self._api("query", params)
        return data["result"] if data["resultType"] == "vector" else [
            {"metric": {}, "value": data["result"]}]

    def query_range(self, expr: str, start: float, end: float, step_s: float
                    ) -> list[dict[str, Any]]:
        """A range query: ``[{"metric": {...}, "values": [[t, "v"], …]}, …]``."""
        return self._api("query_range", {"query": expr, "start": f"{start:.3f}",
                                         "end": f"{end:.3f}", "step": f"{step_s:g}"})["result"]

    def wait_scraped(self, timeout_s: float = 30.0) -> None:
        """Until every target has been scraped successfully once."""
        deadline = time.monotonic() + timeout_s
        while True:
            up = self.query(f'up{{job="{self.job}"}}')
            if len(up) == len(self.targets) and all(r["value"][1] == "1" for r in up):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Prometheus never scraped {self.targets} "
                                   f"(logs: {self.dir})")
            time.sleep(0.25)
