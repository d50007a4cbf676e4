"""--predictor-state: the TTFT predictor's fits survive a gateway restart, and a file that is
not one is logged and ignored, never a failed start."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from cachepilot.core.cost import CostModel, Weights
from cachepilot.core.fingerprint import BlockConfig
from cachepilot.core.predictor import STATE_VERSION, TTFTPredictor, WorkerFit
from cachepilot.core.router import static_router
from cachepilot.gateway import predictor_state
from cachepilot.gateway.server import Gateway, GatewayConfig


def learned() -> TTFTPredictor:
    """A predictor whose pool fit saw 40 first tokens of a 120 ms + 3.5 ms/token worker."""
    p = TTFTPredictor()
    fit = WorkerFit.start(CostModel().ttft, p.cfg)
    for i in range(40):
        tokens = 100.0 + 50 * i
        fit.update((1.0, tokens, 0.0, 0.0, 0.0), 120.0 + 3.5 * tokens, p.cfg)
    p.pooled["default"] = fit
    return p


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    path = str(tmp_path / "state.json")
    predictor_state.save(learned(), path)
    fresh = TTFTPredictor()
    assert predictor_state.load(fresh, path)
    assert fresh.pooled["default"].params() == learned().pooled["default"].params()
    assert not (tmp_path / "state.json.tmp").exists()


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"version": 99, "pools": {}}',
                                     b'{"version": 1, "pools": {"default": {"n": 3}}}'])
def test_a_file_that_is_not_a_state_is_logged_and_ignored(
        tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    fresh = TTFTPredictor()
    with caplog.at_level(logging.WARNING):
        assert not predictor_state.load(fresh, str(path))
    assert fresh.pooled == {}
    assert "starting from the prior" in caplog.text and str(path) in caplog.text


def test_a_missing_file_starts_from_the_prior_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert not predictor_state.load(TTFTPredictor(), str(tmp_path / "none.json"))
    assert caplog.text == ""


async def test_the_gateway_reads_it_at_start_and_saves_it_at_stop(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    predictor_state.save(learned(), str(path))

    def gateway() -> Gateway:
        router = static_router(["127.0.0.1:1"], policy="priced", weights=Weights(), models=(),
                               block=BlockConfig(16), capacity_blocks=1000, engine="vllm")
        return Gateway(router, GatewayConfig(grpc_address="127.0.0.1:0", admin_port=0,
                                             stall_after_s=0, predictor_state=str(path)))

    gw = gateway()
    await gw.start()
    try:
        assert gw.predictor is not None
        assert gw.predictor.pooled["default"].n == 40  # restored before serving
    finally:
        await gw.stop()
    path.unlink()
    gw = gateway()
    await gw.start()
    assert gw.predictor is not None and gw.predictor.pooled == {}  # nothing to read: cold
    await gw.stop()
    assert orjson.loads(path.read_bytes()) == {"version": STATE_VERSION, "pools": {}}
