"""Why CachePilot's hit rate on real workers differs from the peers': read the decision logs a
``cachepilot experiment real-peers`` run kept (``--logs DIR``: one ``<workload>-<seed>-cachepilot``
folder per phase) and print

* **the predicted reuse**: what the gateway expected the engine to reuse on the worker it
  chose against what the engine reused (cold, partial, warm);
* **the prediction's bias** by kind of request: the measured TTFT over the TTFT the router
  predicted for the worker it chose, for cold requests (under half the prompt cached) and
  warm ones, with or without a queue ahead (the predictor has to learn what the calibrated
  prior misses; a phase of 20 requests is shorter than its warm-up);
* **the requests sent away from their prefix's holder** (a prompt whose first blocks, past
  the system prompt, an earlier request of the phase placed elsewhere): what was predicted on
  both workers, what the chosen one measured, and a rough counterfactual for the holder (when
  the requests it was busy with completed, plus the holder's own predicted time for this
  one; both from the request's arrival, time held included);
* **how flow control dispatched** (held or not, and why);
* **how long a held request waited after its worker freed**: from the last answer that ended
  on the worker it went to, before its dispatch, to the dispatch (what holding costs beyond
  the engine's own queue, where a peer's request waits instead);
* **the engine's own prefill time** (llama.cpp workers: each worker's log prints every
  request's prompt evaluation): the cold prefills (over ``COLD_TOKENS`` tokens evaluated)
  under each router, how often the other worker was busy during them (on shared cores two
  prefills at once slow each other), and the same prompt's prefill under CachePilot over
  its prefill under each peer, paired by (workload, seed, tokens), for all of them and for
  those that had the machine to themselves: what the engine, not the path, took longer;
* with ``--samples`` (the study's ``samples.json``), **cold repeats**: each router's requests
  by whether an earlier request of the phase brought their document (the sample's label
  names it) and how much of them the engine served from cache: a document's first
  request is cold under any router; a repeat served cold is a miss some placement might have
  avoided; and the share of all requests cold, which decides on which side of the gap between
  a prefill (~2 s) and a hit (~0.2 s) the median falls;
* with ``--samples``, **the same request through each router
  when both got the same cache outcome** (both cold: under a fifth of the prompt cached; both
  warm: over four fifths): CachePilot's TTFT minus the peer's, paired by (workload, seed,
  request), for all such requests and for those CachePilot did not hold. Placement cannot
  explain a difference there: it is the path and the engine (and, when held, the hold).

    python benchmarks/real_peers_diagnosis.py runs/real-peers-221-225-logs \
        --samples docs/results/real-peers/221-225/samples.json
    python benchmarks/real_peers_diagnosis.py \
        --samples docs/results/real-peers-vllm-chat/samples.json    # no logs: the cold repeats

Several runs (on different seeds) together: name every run's logs, and each run's samples
with its own ``--samples``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Any

from cachepilot.lab.stats import paired_ratio
from cachepilot.records.schema import record_hashes
from cachepilot.records.store import Store
from cachepilot.tooling.llamacpp.timings import busy_share, request_timings

SKIP_BLOCKS = 4  # the system prompt's blocks: every request shares them
COLD_TOKENS = 400  # prompt tokens evaluated: a document's prefill, not a question's
ALONE = 0.05  # the other workers busy for at most this share of a prefill: alone
KEY_BLOCKS = 8  # the blocks after them that name the document


def phases(roots: list[Path]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for d in sorted(d for root in roots for d in root.glob("*-cachepilot/decisions")):
        out[d.parent.name] = sorted(Store(d, readonly=True), key=lambda r: r["time"])
    return out


def chosen(r: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in r["candidates"] if c["worker"] == r["chosen"])


def bias(cells: dict[str, list[dict[str, Any]]]) -> None:
    groups: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for recs in cells.values():
        for r in recs:
            o = r.get("outcome") or {}
            if not o.get("ttft_ms") or o.get("ttft_kind") != "first_token":
                continue
            c = chosen(r)
            kind = "cold" if (o.get("cached_tokens") or 0) < r["tokens"] / 2 else "warm"
            kind += ", queue ahead" if c["queue_ms"] > 1 else ""
            groups[kind].append((o["ttft_ms"], c["predicted_ttft_ms"]))
    print("| request | n | measured ÷ predicted (median) | measured ms | predicted ms |")
    print("|---|---:|---:|---:|---:|")
    for kind, v in sorted(groups.items()):
        print(f"| {kind} | {len(v)} | {statistics.median(a / b for a, b in v):.2f} | "
              f"{statistics.median(a for a, _ in v):.0f} | "
              f"{statistics.median(b for _, b in v):.0f} |")


def diversions(cells: dict[str, list[dict[str, Any]]]) -> None:
    print("\n| phase | dispatch | held ms | chosen: predicted / measured ms | holder: "
          "predicted (queue) / counterfactual ms |")
    print("|---|---|---:|---:|---:|")
    right = wrong = 0
    for name, recs in cells.items():
        held: dict[tuple[str, ...], set[str]] = {}
        for r in recs:
            hs = record_hashes(r)
            key = tuple(hs[SKIP_BLOCKS:SKIP_BLOCKS + KEY_BLOCKS])
            prev = held.setdefault(key, set())
            if prev and r["chosen"] not in prev and len(hs) > SKIP_BLOCKS + KEY_BLOCKS:
                o, f = r.get("outcome") or {}, r.get("flow") or {}
                for h in sorted(prev):
                    busy = [x for x in recs if x["chosen"] == h and x["time"] < r["time"]
                            and (x.get("outcome") or {}).get("completed_at", 0) > r["time"]]
                    free_at = max((x["outcome"]["completed_at"] for x in busy),
                                  default=r["time"])
                    hc = next((c for c in r["candidates"] if c["worker"] == h), None)
                    if hc is None:  # a log kept from an earlier run, on other workers
                        continue
                    own = hc["predicted_ttft_ms"] - hc["queue_ms"]
                    # Both from the arrival: a held request's decision came at its dispatch.
                    held_ms = f.get("held_ms", 0.0)
                    counter = held_ms + (free_at - r["time"]) * 1000.0 + own
                    measured = o.get("ttft_ms", 0.0) + held_ms
                    right, wrong = (right + 1, wrong) if measured <= counter else (right, wrong + 1)
                    print(f"| {name} | {f.get('dispatch', 'direct')} | {f.get('held_ms', 0):.0f} | "
                          f"{r['predicted_ttft_ms']:.0f} / {measured:.0f} | "
                          f"{hc['predicted_ttft_ms']:.0f} ({hc['queue_ms']:.0f}) / "
                          f"{counter:.0f} |")
            prev.add(r["chosen"])
    print(f"\nsent away from the holder: {right + wrong}; the measured time (held time "
          f"included) at most the counterfactual in {right}, above it in {wrong}")


def share_kind(cached: float, tokens: float) -> str:
    """A prompt by the share of it cached: cold under a fifth, warm over four fifths."""
    f = cached / tokens if tokens else 0.0
    return "cold" if f < 0.2 else "warm" if f > 0.8 else "partial"


def predicted_reuse(cells: dict[str, list[dict[str, Any]]]) -> collections.Counter:
    """What the gateway expected the engine to reuse on the worker it chose against what the
    engine reused, each as cold / partial / warm of the prompt, by workload (a slot engine
    restoring a prompt from its cache reuses it only up to a context checkpoint: partial).
    Prints the table; returns the counts."""
    counts: collections.Counter = collections.Counter()
    for name, recs in cells.items():
        workload = name.split("-")[0]
        for r in recs:
            cached = (r.get("outcome") or {}).get("cached_tokens")
            if cached is None or not r["tokens"]:
                continue
            counts[(workload, share_kind(r["predicted_cached_tokens"], r["tokens"]),
                    share_kind(cached, r["tokens"]))] += 1
    kinds = ("cold", "partial", "warm")
    print("\n| workload | predicted | engine: cold | partial | warm |\n|---|---|---:|---:|---:|")
    for workload in sorted({k[0] for k in counts}):
        for p in kinds:
            if any(counts[(workload, p, e)] for e in kinds):
                print(f"| {workload} | {p} | "
                      + " | ".join(str(counts[(workload, p, e)]) for e in kinds) + " |")
    return counts


def dispatches(cells: dict[str, list[dict[str, Any]]]) -> None:
    counts = collections.Counter(
        ((r.get("flow") or {}).get("hold_reason") or "not held",
         (r.get("flow") or {}).get("dispatch", "direct"))
        for recs in cells.values() for r in recs)
    print("\n| held because | dispatched | requests |\n|---|---|---:|")
    for (why, how), n in counts.most_common():
        print(f"| {why} | {how} | {n} |")


def release_gaps(cells: dict[str, list[dict[str, Any]]]) -> None:
    gaps = []
    for recs in cells.values():
        ended: dict[str, list[float]] = collections.defaultdict(list)
        for r in recs:
            done = (r.get("outcome") or {}).get("completed_at")
            if done:
                ended[r["chosen"]].append(done)
        for r in recs:
            f = r.get("flow") or {}
            if f.get("held_ms", 0.0) <= 0.0:
                continue
            before = [t for t in ended[r["chosen"]] if t <= r["time"]]
            if before:
                gaps.append((r["time"] - max(before)) * 1000.0)
    if not gaps:
        print("\nno held request went to a worker after one of its answers ended")
        return
    q = statistics.quantiles(gaps, n=10) if len(gaps) > 1 else gaps * 9
    print(f"\nheld, then dispatched after an answer on their worker ended: {len(gaps)}; "
          f"from that end to the dispatch, median {statistics.median(gaps):.0f} ms, "
          f"p90 {q[-1]:.0f} ms")


def engine_prefills(roots: list[Path]) -> None:
    # (workload, seed, tokens) -> router -> (prefill s, share of it the others were busy)
    cold: dict[tuple[str, str, int], dict[str, tuple[float, float]]] = (
        collections.defaultdict(dict))
    for phase in sorted(p for root in roots for p in root.iterdir()):
        logs = sorted(phase.glob("llama-*.log"))
        if not logs:
            continue
        workload, seed, router = phase.name.split("-", 2)
        # Each log's first request is the stack's calibration, before the phase.
        reqs = {log: request_timings(log.read_text(errors="replace"))[1:] for log in logs}
        for log, mine in reqs.items():
            others = [r for other, rs in reqs.items() if other != log for r in rs]
            for t in mine:
                if t.prompt_tokens > COLD_TOKENS and t.prefill_s > 0:
                    cold[(workload, seed, t.prompt_tokens)][router] = (t.prefill_s,
                                                                       busy_share(t, others))
    if not cold:
        return
    routers = sorted({r for c in cold.values() for r in c}, key=lambda r: (r != "cachepilot", r))
    print(f"\nThe engine's own cold prefills (over {COLD_TOKENS} tokens evaluated; llama-server's "
          "logs): how often another worker was busy during them, and how long they took.\n")
    print("| router | cold prefills | others busy during it (> 5 %) | mean busy share | "
          f"prefill ms, alone (≤ {ALONE:.0%}) | prefill ms, others busy over half |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in routers:
        v = [c[r] for c in cold.values() if r in c]
        alone = [t for t, share in v if share <= ALONE]
        shared = [t for t, share in v if share > 0.5]
        print(f"| {r} | {len(v)} | {sum(s > ALONE for _, s in v) / len(v):.0%} | "
              f"{statistics.mean(s for _, s in v):.2f} | "
              + (f"{statistics.median(alone) * 1000:.0f} ({len(alone)})" if alone else "–")
              + " | " + (f"{statistics.median(shared) * 1000:.0f} ({len(shared)})"
                         if shared else "–") + " |")
    print("\n| CachePilot ÷ | same prompt | prefill ratio [95 %] | both alone | ratio [95 %] |")
    print("|---|---:|---:|---:|---:|")
    for peer in routers[1:]:
        both = [c for c in cold.values() if "cachepilot" in c and peer in c]
        alone = [c for c in both if c["cachepilot"][1] <= ALONE and c[peer][1] <= ALONE]
        cells = []
        for group in (both, alone):
            d = paired_ratio([c["cachepilot"][0] for c in group], [c[peer][0] for c in group])
            cells += [str(d["n"]), "–" if d["n"] < 2 else
                      f"{1 + d['rel']:.3f} [{1 + d['rel_lo']:.3f}, {1 + d['rel_hi']:.3f}]"]
        print(f"| {peer} | " + " | ".join(cells) + " |")


def _held_ms(r: dict[str, Any]) -> float:
    return (r.get("flow") or {}).get("held_ms", 0.0)


def same_outcome(samples: list[dict[str, Any]],
                 cells_by_phase: dict[str, list[dict[str, Any]]] | None = None) -> None:
    held = set()
    for name, recs in (cells_by_phase or {}).items():
        workload, seed = name.split("-")[:2]
        # A request is numbered in arrival order; its record was made at dispatch (a held
        # one after requests that arrived later), so arrival = decision time - time held.
        arrived = sorted(recs, key=lambda r: r["time"] - _held_ms(r) / 1000.0)
        held |= {(workload, int(seed), i) for i, r in enumerate(arrived) if _held_ms(r) > 0.0}
    cells: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = collections.defaultdict(dict)
    for x in samples:
        if x["ok"] and x["prompt_tokens"]:
            cells[(x["workload"], x["seed"], x["request"])][x["router"]] = x
    peers = sorted({r for c in cells.values() for r in c} - {"cachepilot"})
    print("\n| CachePilot − | both | pairs | TTFT difference ms, median | mean | "
          "not held: pairs | median |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for peer in peers:
        for kind in ("cold", "warm"):
            d = [((c["cachepilot"]["ttft_s"] - c[peer]["ttft_s"]) * 1000.0, key not in held)
                 for key, c in cells.items() if "cachepilot" in c and peer in c
                 and all(share_kind(c[r]["cached_tokens"], c[r]["prompt_tokens"]) == kind
                         for r in ("cachepilot", peer))]
            if d:
                free = [x for x, not_held in d if not_held]
                all_ = [x for x, _ in d]
                print(f"| {peer} | {kind} | {len(d)} | {statistics.median(all_):+.1f} | "
                      f"{statistics.mean(all_):+.1f} | {len(free)} | "
                      + (f"{statistics.median(free):+.1f} |" if free else "– |"))


def cold_repeats(samples: list[dict[str, Any]]) -> dict[tuple[str, str], collections.Counter]:
    """Per (workload, router): requests by first of their document in the phase (the
    sample's label names it: ``lab.real_traffic.label``) or a repeat, and cold, partial or
    warm; ``predicted hit`` counts CachePilot's cold repeats the gateway expected to hit.
    Prints the table; returns the counts."""
    first: dict[tuple[str, int, str, int], bool] = {}
    seen: set[tuple[str, int, str, str]] = set()
    for x in sorted(samples, key=lambda x: x["request"]):
        doc = (x["workload"], x["seed"], x["router"], x["label"])
        first[(x["workload"], x["seed"], x["router"], x["request"])] = doc not in seen
        seen.add(doc)
    counts: dict[tuple[str, str], collections.Counter] = collections.defaultdict(
        collections.Counter)
    ttfts: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for x in samples:
        key = (x["workload"], x["seed"], x["router"], x["request"])
        if not (x["ok"] and x["prompt_tokens"]):
            continue
        c = counts[(x["workload"], x["router"])]
        kind = share_kind(x["cached_tokens"], x["prompt_tokens"])
        c[("first" if first[key] else "repeat", kind)] += 1
        if not first[key] and kind == "cold" and x.get("predicted_hit"):
            c["predicted hit"] += 1
        ttfts[(x["workload"], x["router"])].append(x["ttft_s"] * 1000.0)
    print("\n| workload | router | requests | first: cold / partial / warm | repeats: cold / "
          "partial / warm | cold repeats predicted to hit | cold share | p50 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (workload, router), c in sorted(counts.items()):
        n = sum(v for k, v in c.items() if isinstance(k, tuple))
        cold = c[("first", "cold")] + c[("repeat", "cold")]
        hit = str(c["predicted hit"]) if router == "cachepilot" else "–"
        print(f"| {workload} | {router} | {n} | "
              + " / ".join(str(c[("first", k)]) for k in ("cold", "partial", "warm")) + " | "
              + " / ".join(str(c[("repeat", k)]) for k in ("cold", "partial", "warm"))
              + f" | {hit} | {cold / n:.2f} | "
              f"{statistics.median(ttfts[(workload, router)]):.0f} |")
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", type=Path, nargs="*",
                    help="the study's --logs directory (none: only what --samples shows)")
    ap.add_argument("--samples", type=Path, action="append", default=[],
                    help="the study's samples.json: the same request through each router")
    args = ap.parse_args()
    samples = [x for f in args.samples for x in json.loads(f.read_text())]
    if not args.logs:
        if not samples:
            raise SystemExit("name the study's --logs directories, or its --samples")
        cold_repeats(samples)
        return
    cells = phases(args.logs)
    if not cells:
        raise SystemExit(f"no *-cachepilot/decisions under {' '.join(map(str, args.logs))}")
    print(f"{len(cells)} CachePilot phases, {sum(map(len, cells.values()))} decisions\n")
    bias(cells)
    predicted_reuse(cells)
    diversions(cells)
    dispatches(cells)
    release_gaps(cells)
    engine_prefills(args.logs)
    if samples:
        cold_repeats(samples)
        same_outcome(samples, cells)


if __name__ == "__main__":
    main()
