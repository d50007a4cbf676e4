"""The suite's Envoy: the reference gateway's configuration for an EPP
(:func:`cachepilot.deploy.envoy.bootstrap` with ``EppEnvoyOptions``), plus virtual hosts that let
single rules be checked apart:

* ``*`` (default): the reference — ORIGINAL_DST on ``x-gateway-destination-endpoint``;
* ``metadata.conformance``: an override-host cluster reading only the EPP's ``envoy.lb``
  metadata (round robin when it is missing), so a pick that only the header carries shows;

and, for the EPP-unavailable rules, a second Envoy from the same generator pointed at an
address where nothing listens, fail-closed (``failure_mode_allow`` false, InferencePool
failureMode FailClose) or fail-open (true, FailOpen; the known workers' override-host
cluster falls back to round robin).

The subset hint comes from a request header (``x-gateway-destination-endpoint-subset`` →
``envoy.lb.subset_hint`` metadata), and Envoy does not generate ``x-request-id``, so that a
missing one is the EPP's to generate.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from cachepilot.deploy.envoy import EppEnvoyOptions, bootstrap, override_host_cluster
from cachepilot.gateway.protocol import SERVED_KEY
from cachepilot.tooling.stack import envoy_binary, free_port

METADATA_HOST = "metadata.conformance"
_T = "type.googleapis.com/envoy."


def suite_bootstrap(epp: tuple[str, int], workers: list[str], listen_port: int,
                    admin_port: int) -> dict[str, Any]:
    o = EppEnvoyOptions(listen_address="127.0.0.1", listen_port=listen_port,
                        admin_port=admin_port, epp_host=epp[0], epp_port=epp[1],
                        subset_from_header=True, generate_request_id=False,
                        message_timeout_s=30.0, route_timeout_s=60.0)
    cfg = bootstrap(o)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    served = [{"header": {"key": SERVED_KEY, "value": "%UPSTREAM_HOST%"},
               "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    hosts = hcm["route_config"]["virtual_hosts"]
    hosts[:0] = [
        {"name": "metadata", "domains": [METADATA_HOST], "routes": [
            {"name": "metadata", "match": {"prefix": "/"},
             "route": {"cluster": "pool_by_metadata", "timeout": "60s"},
             "response_headers_to_add": served}]},
    ]
    rr = {"name": "pool_round_robin", "type": "STATIC", "connect_timeout": "1s",
          "lb_policy": "ROUND_ROBIN",
          "load_assignment": {"cluster_name": "pool_round_robin", "endpoints": [{
              "lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                  "address": w.rpartition(":")[0], "port_value": int(w.rpartition(":")[2])}}}}
                  for w in workers]}]}}
    by_metadata = override_host_cluster("pool_by_metadata", tuple(workers), sources=("metadata",))
    cfg["static_resources"]["clusters"] += [rr, by_metadata]
    return cfg


def down_bootstrap(workers: list[str], fail_open: bool, listen_port: int, admin_port: int,
                   dead_port: int) -> dict[str, Any]:
    """The generator's bootstrap with the EPP unreachable."""
    return bootstrap(EppEnvoyOptions(
        listen_address="127.0.0.1", listen_port=listen_port, admin_port=admin_port,
        epp_host="127.0.0.1", epp_port=dead_port, fail_open=fail_open, workers=tuple(workers),
        health_check_interval_s=0, route_timeout_s=60.0))


class SuiteEnvoy:
    """Envoy on free loopback ports: the suite's bootstrap in front of the EPP under test,
    or (``down``: "open"/"closed") the generator's with the EPP unreachable."""

    def __init__(self, epp: tuple[str, int], workers: list[str], down: str = "") -> None:
        self.listen_port, self.admin_port = free_port(), free_port()
        if down:
            self.config = down_bootstrap(workers, down == "open", self.listen_port,
                                         self.admin_port, dead_port=free_port())
        else:
            self.config = suite_bootstrap(epp, workers, self.listen_port, self.admin_port)
        self._dir = tempfile.TemporaryDirectory(prefix="cachepilot-conformance-")
        self.config_path = Path(self._dir.name) / "envoy.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.log_path = Path(self._dir.name) / "envoy.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    async def start(self, timeout_s: float = 30.0) -> None:
        log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            [envoy_binary(), "-c", str(self.config_path), "--concurrency", "1",
             "--use-dynamic-base-id", "--log-level", "warn"], stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"envoy exited ({self._proc.returncode}): "
                                       f"{self.log_path.read_text()[-2000:]}")
                try:
                    async with s.get(f"http://127.0.0.1:{self.admin_port}/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"envoy not ready in {timeout_s}s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._dir.cleanup()
