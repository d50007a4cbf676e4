"""The suite's Envoy: the reference gateway's configuration for an EPP
(:func:`bootstrap`: ext_proc with headers SEND, bodies FULL_DUPLEX_STREAMED both
ways, trailers SEND, fail-closed, the served-endpoint report in ``envoy.lb``), with what lets
one rule be checked apart from the others:

* the pool's clusters use Envoy's override-host load balancer over the known workers (the
  reference's ORIGINAL_DST cluster cannot route the protocol's ``ip:port,ip:port`` list),
  reading the header and the ``envoy.lb`` metadata (``*``), the header alone
  (``header.conformance``) or the metadata alone (``metadata.conformance``); with neither
  they fall back to round robin, and the fake worker says what it received;
* every upstream request carries the EPP's ``envoy.lb`` metadata as a header
  (``x-conformance-metadata-destination``), so the header and the metadata can be compared
  in full;
* the subset hint comes from request headers: ``x-conformance-subset-list: a,b`` becomes the
  protocol's list (a Lua filter), ``x-conformance-subset-string`` the comma-separated string
  form; a second listener sets the empty list;
* ``fail-open.conformance``: the same EPP with ``failure_mode_allow`` (InferencePool
  failureMode FailOpen) on that route;
* ``pool-b.conformance``: a second pool and its own EPP (per-route ext_proc override);
* every local reply carries ``x-conformance-envoy-reply`` (its response code details, when
  any): an EPP's ImmediateResponse is one too, so the suite tells it from Envoy's reply to a
  failed ext_proc stream by Envoy's counters (:meth:`SuiteEnvoy.ext_proc_failures`);
* Envoy does not generate ``x-request-id``: a missing one is the EPP's to generate.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from cachepilot.conformance.workers import METADATA_ECHO_HEADER
from cachepilot.deploy.envoy import EppEnvoyOptions, bootstrap, override_host_cluster
from cachepilot.gateway.protocol import (
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from cachepilot.tooling.stack import envoy_binary, free_port

HEADER_HOST = "header.conformance"
METADATA_HOST = "metadata.conformance"
FAIL_OPEN_HOST = "fail-open.conformance"
POOL_B_HOST = "pool-b.conformance"
SUBSET_LIST_HEADER = "x-conformance-subset-list"
SUBSET_STRING_HEADER = "x-conformance-subset-string"
ENVOY_REPLY_HEADER = "x-conformance-envoy-reply"
_T = "type.googleapis.com/envoy."
_EXT_PROC = "envoy.filters.http.ext_proc"
_OVERWRITE = "OVERWRITE_IF_EXISTS_OR_ADD"
_FAILURES = r"ext_proc\.(streams_failed|message_timeouts|spurious_msgs_received)$"

_LUA_LIST_HINT = f"""
function envoy_on_request(h)
  local v = h:headers():get("{SUBSET_LIST_HEADER}")
  if v ~= nil then
    h:headers():remove("{SUBSET_LIST_HEADER}")
    local t = {{}}
    for s in string.gmatch(v, "[^,]+") do table.insert(t, s) end
    h:streamInfo():dynamicMetadata():set("{SUBSET_NAMESPACE}", "{SUBSET_KEY}", t)
  end
end
"""


def _lua_list_hint() -> dict[str, Any]:
    return {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": _T + "extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": _LUA_LIST_HINT}}}


def _string_hint() -> dict[str, Any]:
    return {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": _T + "extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [{"header": SUBSET_STRING_HEADER, "remove": True,
                           "on_header_present": {"metadata_namespace": SUBSET_NAMESPACE,
                                                 "key": SUBSET_KEY, "type": "STRING"}}]}}


def _empty_list_hint() -> dict[str, Any]:
    return {"name": "envoy.filters.http.set_metadata", "typed_config": {
        "@type": _T + "extensions.filters.http.set_metadata.v3.Config",
        "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET_KEY: []}}]}}


def _route(cluster: str, name: str, per_filter: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    route: dict[str, Any] = {
        "name": name, "match": {"prefix": "/"},
        "route": {"cluster": cluster, "timeout": "60s", "idle_timeout": "60s"},
        "request_headers_to_add": [{"header": {
            "key": METADATA_ECHO_HEADER,
            "value": f"%DYNAMIC_METADATA({LB_METADATA_NAMESPACE}:{DESTINATION_HEADER})%"},
            "append_action": _OVERWRITE}],
        "response_headers_to_add": [{"header": {"key": SERVED_KEY, "value": "%UPSTREAM_HOST%"},
                                     "append_action": _OVERWRITE}]}
    if per_filter:
        route["typed_per_filter_config"] = {_EXT_PROC: {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": per_filter}}
    return route


def _vhost(name: str, domains: list[str], route: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "domains": domains, "routes": [route]}


def suite_bootstrap(epp: tuple[str, int], workers: list[str], ports: dict[str, int],
                    epp_b: tuple[str, int] | None = None, workers_b: list[str] | None = None
                    ) -> dict[str, Any]:
    """``ports``: listen (the main listener), empty (the empty-list listener), admin."""
    o = EppEnvoyOptions(listen_address="127.0.0.1", listen_port=ports["listen"],
                        admin_port=ports["admin"], epp_host=epp[0], epp_port=epp[1],
                        workers=tuple(workers), generate_request_id=False,
                        message_timeout_s=30.0, route_timeout_s=60.0)
    cfg = bootstrap(o)
    listener = cfg["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"].append(
        {"remove": METADATA_ECHO_HEADER})
    hcm["local_reply_config"] = {"mappers": [{
        "filter": {"status_code_filter": {"comparison": {
            "op": "GE", "value": {"default_value": 0, "runtime_key": "conformance.stamp"}}}},
        "headers_to_add": [{"header": {"key": ENVOY_REPLY_HEADER,
                                       "value": "%RESPONSE_CODE_DETAILS%"},
                            "append_action": _OVERWRITE}]}]}
    filters = hcm["http_filters"]
    at = next(i for i, f in enumerate(filters) if f["name"] == _EXT_PROC)
    filters[at:at] = [_lua_list_hint(), _string_hint()]
    clusters = cfg["static_resources"]["clusters"]
    at_pool = next(i for i, c in enumerate(clusters) if c["name"] == "inference_pool")
    clusters[at_pool] = override_host_cluster("inference_pool", tuple(workers),
                                            sources=("header", "metadata"))
    clusters += [override_host_cluster("pool_by_header", tuple(workers), sources=("header",)),
                 override_host_cluster("pool_by_metadata", tuple(workers),
                                     sources=("metadata",))]
    vhosts = [_vhost("header", [HEADER_HOST], _route("pool_by_header", "header")),
              _vhost("metadata", [METADATA_HOST], _route("pool_by_metadata", "metadata")),
              _vhost("fail-open", [FAIL_OPEN_HOST],
                     _route("inference_pool", "fail-open", {"failure_mode_allow": True}))]
    if epp_b is not None:
        epp_cluster = next(c for c in clusters if c["name"] == "epp")
        b = copy.deepcopy(epp_cluster)
        b["name"] = "epp_b"
        b["load_assignment"] = {"cluster_name": "epp_b", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": epp_b[0],
                                                         "port_value": epp_b[1]}}}}]}]}
        clusters += [b, override_host_cluster("pool_b", tuple(workers_b or ()),
                                            sources=("header", "metadata"))]
        vhosts.append(_vhost("pool-b", [POOL_B_HOST], _route("pool_b", "pool-b", {
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp_b"}, "timeout": "10s"}})))
    vhosts.append(_vhost("pool", ["*"], _route("inference_pool", "pool")))
    hcm["route_config"]["virtual_hosts"] = vhosts
    # The empty-list listener: the same chain, the hint set to [] for every request.
    empty = copy.deepcopy(listener)
    empty["name"] = "empty_subset"
    empty["address"] = {"socket_address": {"address": "127.0.0.1",
                                           "port_value": ports["empty"]}}
    ehcm = empty["filter_chains"][0]["filters"][0]["typed_config"]
    ehcm["stat_prefix"] = "empty_subset"
    ehcm["http_filters"][at:at + 2] = [_empty_list_hint()]
    ehcm["route_config"] = {"name": "empty", "virtual_hosts": [
        _vhost("pool", ["*"], _route("inference_pool", "pool"))]}
    cfg["static_resources"]["listeners"].append(empty)
    return cfg


class SuiteEnvoy:
    """Envoy on free loopback ports, in front of the EPP under test (and a second pool's)."""

    def __init__(self, epp: tuple[str, int], workers: list[str],
                 epp_b: tuple[str, int] | None = None, workers_b: list[str] | None = None
                 ) -> None:
        self.ports = {"listen": free_port(), "empty": free_port(), "admin": free_port()}
        self.config = suite_bootstrap(epp, workers, self.ports, epp_b, workers_b)
        self._dir = tempfile.TemporaryDirectory(prefix="cachepilot-conformance-")
        self.config_path = Path(self._dir.name) / "envoy.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.log_path = Path(self._dir.name) / "envoy.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['listen']}"

    @property
    def empty_subset_url(self) -> str:
        """Where every request carries the empty list as its subset hint."""
        return f"http://127.0.0.1:{self.ports['empty']}"

    async def ext_proc_failures(self, session: aiohttp.ClientSession) -> int:
        """Streams to an EPP that failed (a gRPC error, a message timeout, a message out of
        place), over every listener: a reply while this stays put is not a failure's."""
        async with session.get(f"http://127.0.0.1:{self.ports['admin']}/stats",
                               params={"filter": _FAILURES}) as r:
            text = await r.text()
        return sum(int(line.rpartition(": ")[2]) for line in text.splitlines()
                   if line.rpartition(": ")[2].isdigit())

    async def version(self) -> str:
        async with aiohttp.ClientSession() as s, s.get(
                f"http://127.0.0.1:{self.ports['admin']}/server_info") as r:
            return str((await r.json(content_type=None)).get("version", ""))

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
                    async with s.get(f"http://127.0.0.1:{self.ports['admin']}/ready") as r:
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
