"""The TTFT predictor's fits on disk, so a restarted gateway predicts from what the last run
learned (:meth:`cachepilot.core.predictor.TTFTPredictor.state`). The file is a cache: one
that is missing starts the predictor from the prior, one that cannot be read is logged and
ignored, and writes replace it whole (a crash mid-write leaves the previous one)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import orjson

from cachepilot.core.predictor import TTFTPredictor

log = logging.getLogger(__name__)


def load(predictor: TTFTPredictor, path: str) -> bool:
    """Restore ``predictor`` from ``path``; False (and why, logged) if it holds nothing
    usable."""
    try:
        predictor.restore(orjson.loads(Path(path).read_bytes()))
    except FileNotFoundError:
        return False
    except (OSError, orjson.JSONDecodeError, ValueError) as err:
        log.warning("predictor state %s not used (%s): starting from the prior", path, err)
        return False
    log.info("predictor state read from %s", path)
    return True


def save(predictor: TTFTPredictor, path: str) -> None:
    tmp = f"{path}.tmp"
    try:
        Path(tmp).write_bytes(orjson.dumps(predictor.state()))
        os.replace(tmp, path)
    except OSError as err:
        log.warning("predictor state not saved to %s: %s", path, err)


async def keep_saved(predictor: TTFTPredictor, path: str, every_s: float = 10.0) -> None:
    """Save every ``every_s`` while the fits change (the gateway saves once more on stop)."""
    seen = -1
    while True:
        await asyncio.sleep(every_s)
        n = sum(f.n for f in predictor.pooled.values())
        if n != seen:
            seen = n
            save(predictor, path)
