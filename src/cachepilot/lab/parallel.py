"""Run a study's (workload, seed) tasks on a process pool, reporting progress."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from typing import Any

Progress = Callable[[int, int, str], None]


def process_count(processes: int | None = None) -> int:
    """The processes a study runs on: as asked, or up to 2 (the machines this runs on)."""
    return processes or min(2, os.cpu_count() or 1)


def run_tasks(fn: Callable[[Any], dict[str, Any]], tasks: Sequence[Any],
              processes: int | None = None, progress: Progress | None = None,
              label: Callable[[Any], str] = str) -> list[dict[str, Any]]:
    """``fn`` over ``tasks`` on :func:`process_count` processes, in any order. Put the
    longest tasks first: it keeps every process busy to the end."""
    procs = process_count(processes)
    out: list[dict[str, Any]] = []
    if procs > 1:
        ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
        with ctx.Pool(procs) as pool:
            for i, (t, r) in enumerate(pool.imap_unordered(_with_task(fn), tasks), 1):
                out.append(r)
                if progress:
                    progress(i, len(tasks), label(t))
    else:
        for i, t in enumerate(tasks, 1):
            out.append(fn(t))
            if progress:
                progress(i, len(tasks), label(t))
    return out


class _with_task:
    def __init__(self, fn: Callable[[Any], dict[str, Any]]) -> None:
        self.fn = fn

    def __call__(self, task: Any) -> tuple[Any, dict[str, Any]]:
        return task, self.fn(task)
