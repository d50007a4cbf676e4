"""Does scraping a llama-server slow its prefill?

llama-server answers ``/metrics`` and ``/slots`` from the loop that runs inference, between
batches, and the gateway asked for both every scrape (0.25 s by default for llama.cpp; now
1 s, /slots only while a request is processing, and the connection closed: the kept-alive
connection this poller holds is what costs, benchmarks/llama_idle_cpu.py). This
starts one worker as the real-worker studies run it (``LlamaWorkerSpec``: one thread, one
slot, the host prompt cache) and times cold prompts (new text each, ``--words`` words, one
token out) sent straight to it, in pairs: one with nothing else talking to the worker, one
while a poller fetches ``/metrics`` and ``/slots`` every ``--interval`` seconds, the pair's
order alternating. With ``--beside gateway`` the other side has a real ``cachepilot
gateway`` for this worker beside it instead (its own scrape loop at ``--interval``: /metrics,
/slots while a prompt is processing, its event loop and threads), started once and frozen
(SIGSTOP) for the quiet side. Prints each side's median, and the per-pair ratios' median
and geometric mean with its 95 % interval (``cachepilot.lab.stats.paired_ratio``: t on the
log ratios).

    make .venv/.installed-llamacpp      # pip install -e '.[dev,llamacpp]': llama.cpp, httpx
    python benchmarks/llama_scrape_interference.py --pairs 12
    python benchmarks/llama_scrape_interference.py --pairs 30 --beside gateway --interval 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx

from cachepilot.lab.stats import paired_ratio
from cachepilot.tooling.llamacpp.worker import LlamaCppMissing, LlamaWorkerSpec, model_path
from cachepilot.tooling.procs import wait_http_ok
from cachepilot.tooling.stack import free_port

WORDS = ["the", "a", "cache", "prefix", "model", "token", "router", "gateway", "engine",
         "block", "hash", "of", "and", "to"]


def poll(base: str, interval_s: float, stop: threading.Event) -> None:
    """The gateway's scrape of one llama.cpp worker, without the gateway."""
    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            for path in ("/metrics", "/slots"):
                with contextlib.suppress(httpx.HTTPError):  # a scrape that fails is one too
                    client.get(base + path)
            stop.wait(interval_s)


class Beside:
    """What runs beside the worker on the scraped side: a poller thread, or a gateway
    process frozen in between."""

    def __init__(self, kind: str, base: str, interval_s: float) -> None:
        self.kind, self.base, self.interval_s = kind, base, interval_s
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.gateway: subprocess.Popen[bytes] | None = None
        if kind == "gateway":
            admin = free_port()
            self.gateway = subprocess.Popen(
                [sys.executable, "-m", "cachepilot", "gateway", "--engine", "llamacpp",
                 "--workers", base.removeprefix("http://"),
                 "--listen", f"127.0.0.1:{free_port()}", "--admin-port", str(admin),
                 "--scrape-interval", f"{interval_s:g}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            wait_http_ok([f"http://127.0.0.1:{admin}/readyz"], timeout_s=60)
            self.off()

    def on(self) -> None:
        if self.gateway is not None:
            os.kill(self.gateway.pid, signal.SIGCONT)
        else:
            self.stop = threading.Event()
            self.thread = threading.Thread(target=poll, args=(self.base, self.interval_s,
                                                              self.stop))
            self.thread.start()
        time.sleep(self.interval_s)

    def off(self) -> None:
        if self.gateway is not None:
            os.kill(self.gateway.pid, signal.SIGSTOP)
        elif self.thread is not None:
            self.stop.set()
            self.thread.join()

    def close(self) -> None:
        if self.gateway is not None:
            os.kill(self.gateway.pid, signal.SIGCONT)
            self.gateway.terminate()
            self.gateway.wait(10)
        else:
            self.off()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--words", type=int, default=700, help="prompt length (fits the slot)")
    ap.add_argument("--interval", type=float, default=0.25, help="the scrape interval (s)")
    ap.add_argument("--beside", choices=["poller", "gateway"], default="poller",
                    help="what scrapes the worker on the scraped side")
    args = ap.parse_args()
    try:
        argv = LlamaWorkerSpec().args(model_path(), port := free_port())
    except LlamaCppMissing as err:
        print(err, file=sys.stderr)
        return 2
    worker = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    rng = random.Random(7)
    times: dict[str, list[float]] = {"quiet": [], "scraped": []}
    beside = None
    try:
        wait_http_ok([base + "/health"], timeout_s=120)
        with httpx.Client(timeout=120.0) as client:

            def cold() -> float:
                prompt = " ".join(rng.choice(WORDS) for _ in range(args.words))
                t0 = time.perf_counter()
                r = client.post(base + "/v1/completions",
                                json={"prompt": prompt, "max_tokens": 1})
                r.raise_for_status()
                return (time.perf_counter() - t0) * 1000

            cold()  # warm-up
            beside = Beside(args.beside, base, args.interval)
            for i in range(args.pairs):
                for side in ("quiet", "scraped") if i % 2 == 0 else ("scraped", "quiet"):
                    if side == "scraped":
                        beside.on()
                    times[side].append(cold())
                    if side == "scraped":
                        beside.off()
                print(f"pair {i + 1}/{args.pairs}: quiet {times['quiet'][-1]:.0f} ms, "
                      f"scraped {times['scraped'][-1]:.0f} ms", flush=True)
    finally:
        if beside is not None:
            beside.close()
        worker.terminate()
        worker.wait(10)
    ratios = [s / q for q, s in zip(times["quiet"], times["scraped"], strict=True)]
    what = ("a gateway scraping" if args.beside == "gateway" else "/metrics and /slots")
    print(f"\n{args.words}-word cold prompts, {what} every {args.interval:g} s")
    for side, xs in times.items():
        print(f"{side:>8}: median {statistics.median(xs):.0f} ms over {len(xs)}")
    paired = paired_ratio(times["scraped"], times["quiet"])
    print(f"scraped ÷ quiet, per pair: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); geometric mean "
          f"{1 + paired['rel']:.3f} [{1 + paired['rel_lo']:.3f}, {1 + paired['rel_hi']:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
