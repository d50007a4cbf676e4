"""Engine Prometheus text → :class:`WorkerMetrics`, for each engine a worker may run.

Pure parsing (prometheus-client's parser); fetching lives in ``cachepilot.datalayer.scrape``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache

from prometheus_client.parser import text_string_to_metric_families

from cachepilot.core.workers import WorkerMetrics

ENGINES = ("vllm", "sglang", "llamacpp", "sim")

# Engine → (waiting, running, KV usage names in order of preference, prefix queries, hits).
_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "waiting": ("vllm:num_requests_waiting",),
        "running": ("vllm:num_requests_running",),
        # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; accept both.
        "kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "queries": ("vllm:prefix_cache_queries",),
        "hits": ("vllm:prefix_cache_hits",),
    },
    "sglang": {
        "waiting": ("sglang:num_queue_reqs",),
        "running": ("sglang:num_running_reqs",),
        "kv": ("sglang:token_usage",),
        "queries": (),
        "hits": (),
    },
    "llamacpp": {
        # llama-server has no KV gauge; deferred requests wait for a free slot.
        "waiting": ("llamacpp:requests_deferred",),
        "running": ("llamacpp:requests_processing",),
        "kv": (),
        # prompt_tokens_total counts processed (uncached) tokens only: queries add the hits.
        "queries": ("llamacpp:prompt_tokens_total",),
        "hits": ("llamacpp:prompt_tokens_cached_total",),
    },
}
_NAMES["sim"] = _NAMES["vllm"]  # the simulated worker speaks vLLM's names
# Engines whose "queries" counter excludes cached tokens (checked on llama-server's /metrics).
_QUERIES_EXCLUDE_HITS = frozenset({"llamacpp"})


@cache
def _read_lines(engine: str) -> re.Pattern[str]:
    """The lines of the families :func:`parse_metrics` reads for ``engine``: their samples
    (a counter's with ``_total``) and their ``# HELP`` / ``# TYPE`` lines."""
    names = {n for group in _NAMES[engine].values() for n in group}
    names |= {"vllm:cache_config_info", "process_start_time_seconds"}
    alts = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    return re.compile(rf"^(?:# (?:HELP|TYPE) )?(?:{alts})(?:_total)?[ {{\t].*$", re.M)


def _samples(text: str, engine: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of the families read, by name. Only their lines reach prometheus-client's
    parser: a vLLM worker's /metrics is ~600 lines (~52 KB, histograms mostly), which the
    parser takes ~11 ms for, on the CPUs the engine runs on (tests/data/vllm_metrics.txt;
    benchmarks/metrics_parse.py); its ~15 lines we read take a few per cent of that."""
    wanted = "\n".join(m.group(0) for m in _read_lines(engine).finditer(text))
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(wanted + "\n" if wanted else ""):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _first(samples: dict[str, list[tuple[dict[str, str], float]]],
           names: Iterable[str]) -> float | None:
    """Sum over label sets (vLLM labels by model_name/engine) of the first name present.
    Counters may appear with a ``_total`` suffix depending on the client library."""
    for name in names:
        for candidate in (name, f"{name}_total"):
            if candidate in samples:
                return sum(v for _, v in samples[candidate])
    return None


def parse_metrics(text: str, engine: str, scraped_at: float) -> WorkerMetrics:
    """Parse one scrape. Raises ValueError for text that is not Prometheus exposition or
    that lacks the queue gauges (a scrape that cannot tell load must not look idle)."""
    if engine not in _NAMES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    names = _NAMES[engine]
    samples = _samples(text, engine)
    waiting = _first(samples, names["waiting"])
    running = _first(samples, names["running"])
    if waiting is None or running is None:
        raise ValueError(f"{engine} metrics lack {names['waiting'][0]} or {names['running'][0]}")
    kv = _first(samples, names["kv"])
    queries = _first(samples, names["queries"])
    hits = _first(samples, names["hits"])
    if queries is not None and engine in _QUERIES_EXCLUDE_HITS:
        queries += hits or 0.0
    block_size = num_blocks = None
    for labels, _ in samples.get("vllm:cache_config_info", []):
        block_size = _int(labels.get("block_size"))
        num_blocks = _int(labels.get("num_gpu_blocks"))
    return WorkerMetrics(
        waiting=int(waiting), running=int(running),
        kv_usage=None if kv is None else min(max(kv, 0.0), 1.0),
        block_size=block_size, num_blocks=num_blocks,
        prefix_queries=queries, prefix_hits=hits,
        scraped_at=scraped_at,
        # prometheus_client's process collector (vLLM with one API server: its default
        # registry); the engine's identity across restarts at the same address.
        process_start=_first(samples, ("process_start_time_seconds",)),
    )


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None
