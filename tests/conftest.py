from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachepilot.core import BlockConfig, Pool, PoolSpec, Router, WorkerMetrics

WORKERS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def make_router(policy: str = "priced", workers: tuple[str, ...] = WORKERS, now: float = 100.0,
                **spec: object) -> Router:
    pool = Pool(PoolSpec(policy=policy, block=BlockConfig(16, 4.0), **spec))  # type: ignore[arg-type]
    for w in workers:
        pool.upsert_worker(w)
        pool.update_metrics(w, WorkerMetrics(scraped_at=now, kv_usage=0.1))
    return Router([pool], id_prefix="t")


@pytest.fixture
def router() -> Router:
    return make_router()


def have_command(name: str) -> bool:
    """Installed beside the interpreter (CI runs .venv/bin/python without activating the
    venv, so its bin/ is not on PATH) or on PATH."""
    return (Path(sys.executable).parent / name).exists() or shutil.which(name) is not None


def have_envoy() -> bool:
    return have_command("envoy")


def until(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy (for tests outside an event loop;
    the shared machines are too noisy for fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what} not met in {timeout}s"
        time.sleep(0.02)
    return result
