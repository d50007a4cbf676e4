"""``cachepilot explain ID``: one decision as a table of candidates and terms, plus why."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from cachepilot.core.lifecycle import FIRST_TOKEN
from cachepilot.core.policies import make_policy
from cachepilot.records.store import Store


def find(log: Store, decision_id: str) -> dict[str, Any] | None:
    """A record by id; ``last`` is the most recent one."""
    if decision_id == "last":
        last = log.last_id()
        return None if last is None else log.get(last)
    return log.get(decision_id)


def _eligible(record: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [c for c in record["candidates"] if c["eligible"]]


def runner_up(record: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The best eligible candidate other than the winner (ties: first recorded)."""
    others = [c for c in _eligible(record) if c["worker"] != record["chosen"]]
    return max(others, key=lambda c: c["value"]) if others else None


def winner(record: Mapping[str, Any]) -> Mapping[str, Any]:
    return next(c for c in record["candidates"] if c["worker"] == record["chosen"])


def _tolerance(policy: str) -> float:
    try:
        return make_policy(policy).tie_tolerance
    except ValueError:
        return 0.0


def _filtered_summary(record: Mapping[str, Any]) -> str:
    counts: dict[str, int] = {}
    for c in record["candidates"]:
        if not c["eligible"]:
            counts[c["filtered"] or "ineligible"] = counts.get(c["filtered"] or "ineligible", 0) + 1
    return ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))


def plain_reason(record: Mapping[str, Any]) -> str:
    """One sentence in plain words: why this worker and not the runner-up."""
    w = winner(record)
    r = runner_up(record)
    name = record["chosen"]
    if r is None:
        others = _filtered_summary(record)
        return f"{name} was the only eligible worker" + (f" (others: {others})." if others
                                                         else ".")
    policy = record["policy"]
    margin = record["margin_ms"]
    if margin <= _tolerance(policy):
        return (f"{name} and {r['worker']} tied under {policy} (values within "
                f"{_tolerance(policy):g}); the request's hash picked {name} "
                f"(predicted TTFT {w['predicted_ttft_ms']:.0f} vs "
                f"{r['predicted_ttft_ms']:.0f} ms).")
    if policy == "round_robin":
        return f"round robin: it was {name}'s turn (decision #{record['seq']} of the pool)."
    if policy == "least_loaded":
        return (f"least loaded: {name} had {w['waiting'] + w['running']} requests queued or "
                f"running, {r['worker']} had {r['waiting'] + r['running']}.")
    if policy == "overlap_only":
        return (f"longest cached prefix: {name} holds {w['matched_tokens']} of the "
                f"{record['tokens']} prompt tokens, {r['worker']} {r['matched_tokens']}.")
    wt = record.get("weights") or {}
    parts = {
        "cached prefix": (wt.get("prefill", 1.0) * (w["saved_ms"] - r["saved_ms"]),
                          f"{w['matched_tokens']} vs {r['matched_tokens']} cached tokens"),
        "shorter queue": (wt.get("load", 1.0) * (r["queue_ms"] - w["queue_ms"]),
                          f"{w['queue_ms']:.0f} vs {r['queue_ms']:.0f} ms"),
        "less KV pressure": (wt.get("kv", 1.0) * (r["kv_ms"] - w["kv_ms"]),
                             f"{w['kv_ms']:.0f} vs {r['kv_ms']:.0f} ms"),
    }
    ranked = sorted(parts.items(), key=lambda kv: -kv[1][0])
    pros = [f"{label} ({detail}, {ms:+.0f} ms)" for label, (ms, detail) in ranked if ms > 0.5]
    cons = [f"{label.split()[-1]} ({detail}, {ms:+.0f} ms)" for label, (ms, detail) in ranked
            if ms < -0.5]
    why = "; ".join(pros) if pros else "no single term stood out"
    line = (f"{name} beat {r['worker']} by {margin:.0f} ms of priced value "
            f"(predicted TTFT {w['predicted_ttft_ms']:.0f} vs {r['predicted_ttft_ms']:.0f} ms): "
            f"{why}")
    if cons:
        line += f", despite {'; '.join(cons)}"
    return line + "."


_HOLD_WHY = {
    "pool_full": "every worker was busy (at the gate's depth) when it arrived",
    "prefix_holder_busy": "the busy worker holding its prefix was priced lower (its first "
                          "token, and the delay to later arrivals) than recomputing the "
                          "prefix elsewhere",
    "queued_behind": "others were already held in its pool",
}
_DISPATCH_HOW = {
    "direct": "routed at once",
    "fair": "its tenant's turn (the least-served eligible tenant, oldest request first)",
    "locality": "a locality pick: an open worker held its prefix",
    "holder": "its prefix holder opened",
    "holder_timeout": "its prefix holder stayed busy past the wait allowed; went elsewhere",
}


def turn_line(record: Mapping[str, Any]) -> str | None:
    """A replica's turn in one sentence (None: not held for one)."""
    waited = record.get("turn_ms") or 0.0
    if waited <= 0:
        return None
    return (f"turn: this replica held it {waited:.1f} ms before routing it, for the "
            "placements of the replicas before it (a long, uncached prompt)")


def flow_line(record: Mapping[str, Any]) -> str | None:
    """Flow control's part in one sentence: the tenant and band, how long the request was
    held and why, and how it was dispatched (None: flow control did not see it)."""
    f = record.get("flow")
    if not f:
        return None
    who = f"tenant {f.get('tenant')!r}, band {f.get('priority', 0)}"
    if f.get("objective"):
        who += f" (objective {f['objective']!r})"
    held = f.get("held_ms", 0.0)
    if not f.get("hold_reason"):
        line = f"flow: {who}; not held ({_DISPATCH_HOW['direct']})"
    else:
        why = _HOLD_WHY.get(f["hold_reason"], f["hold_reason"])
        how = _DISPATCH_HOW.get(f.get("dispatch", ""), f.get("dispatch", "?"))
        line = (f"flow: {who}; held {held:.0f} ms because {why} ({f.get('position', 0)} "
                f"held ahead of it then); dispatched by {how}")
        if f.get("dispatch") == "locality":
            line += f", saving {f.get('gain_ms', 0.0):.0f} ms of prefill over the fair pick"
        if f.get("holder"):
            line += f"; waited for {f['holder']}"
        line += (f"; its tenant was {f.get('lag_tokens', 0.0):,.0f} weighted tokens ahead of "
                 "the band's least-served")
    if f.get("slo_ms") is not None:
        met = {True: "predicted to meet it", False: "no worker predicted to meet it",
               None: "not judged"}[f.get("slo_met")]
        line += f"; TTFT target {f['slo_ms']:g} ms: {met}"
    return line + "."


def _fmt_ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


_ROWS: tuple[tuple[str, Any], ...] = (
    ("status", lambda c: "eligible" if c["eligible"] else (c["filtered"] or "no")),
    ("cached blocks/tokens", lambda c: f"{c['matched_blocks']}/{c['matched_tokens']}"),
    ("wait/run/inflight", lambda c: f"{c['waiting']}/{c['running']}/{c['inflight']}"),
    ("KV usage", lambda c: f"{100 * c['kv_usage']:.0f}%"),
    ("metrics age ms", lambda c: _fmt_ms(c["metrics_age_ms"])),
    ("saved ms", lambda c: _fmt_ms(c["saved_ms"])),
    ("prefill ms", lambda c: _fmt_ms(c["prefill_ms"])),
    ("queue ms", lambda c: _fmt_ms(c["queue_ms"])),
    ("KV pressure ms", lambda c: _fmt_ms(c["kv_ms"])),
    ("predicted TTFT ms", lambda c: _fmt_ms(c["predicted_ttft_ms"])),
    # Not this request's TTFT: the delay its prefill would add to later arrivals there.
    ("congestion ms", lambda c: _fmt_ms(c.get("congestion_ms", 0.0))),
    # Slot engines: the prefill later requests would redo for what this placement overwrites.
    ("eviction ms", lambda c: _fmt_ms(c.get("eviction_ms", 0.0))),
    # Flow control's closed workers are valued too: what waiting for one would be worth.
    ("value", lambda c: f"{c['value']:.1f}" if c["eligible"]
     or c.get("filtered") in ("closed", "slo") else "–"),
)


def table(record: Mapping[str, Any]) -> Table:
    """Terms as rows, one column per worker (the winner starred)."""
    t = Table(title=(f"decision {record['id']} · pool {record['pool']} · model {record['model']}"
                     f" · policy {record['policy']}"), title_justify="left")
    t.add_column("")
    for c in record["candidates"]:
        won = c["worker"] == record["chosen"]
        t.add_column(("★ " if won else "") + c["worker"], justify="right",
                     style="bold green" if won else ("dim" if not c["eligible"] else None))
    for label, fmt in _ROWS:
        t.add_row(label, *(fmt(c) for c in record["candidates"]))
    return t


def outcome_lines(record: Mapping[str, Any]) -> list[str]:
    out = record.get("outcome") or {}
    pred = record.get("predicted_ttft_ms")
    lines = []
    ttft = out.get("ttft_ms")
    if ttft is None:
        lines.append(f"TTFT: predicted {_fmt_ms(pred)} ms; measured: no outcome recorded")
    else:
        kind = out.get("ttft_kind", "?")
        note = "" if kind == FIRST_TOKEN else ", not streamed: includes generation"
        lines.append(f"TTFT: predicted {_fmt_ms(pred)} ms, measured {ttft:.1f} ms "
                     f"({kind}{note}), error {ttft - (pred or 0.0):+.1f} ms")
    cached = out.get("cached_tokens")
    predicted = record.get("predicted_cached_tokens", 0)
    hit = "hit" if record.get("predicted_hit") else "miss"
    if cached is None:
        lines.append(f"cache: predicted {hit} ({predicted} tokens); worker reported nothing")
    else:
        lines.append(f"cache: predicted {hit} ({predicted} tokens); worker reported {cached} "
                     f"cached tokens ({'right' if out.get('hit_predicted_right') else 'wrong'})")
    if "status" in out:
        lines.append(f"status: {out['status']}" + (f" ({out['error']})" if "error" in out else ""))
    return lines


def render(record: Mapping[str, Any], console: Console) -> None:
    w = record.get("weights") or {}
    weights = ", ".join(f"{k}={v:g}" for k, v in sorted(w.items()))
    console.print(table(record))
    console.print(f"request: {record['tokens']} tokens, {record['blocks']} blocks of "
                  f"{record['block_size']}, {record.get('uncached_tokens', 0)} uncached on the "
                  f"winner · time {record['time']:.3f} · seq {record['seq']} · weights {weights}")
    r = runner_up(record)
    margin = (f"by {record['margin_ms']:.1f} over {r['worker']}" if r is not None
              else "(no other eligible worker)")
    console.print(f"winner: [bold]{record['chosen']}[/bold] {margin}")
    for line in outcome_lines(record):
        console.print(line)
    console.print(f"why: {plain_reason(record)}")
    line = flow_line(record)
    if line:
        console.print(line)
    line = turn_line(record)
    if line:
        console.print(line)
    if record.get("extra"):  # schema 1: a policy's learned state (the adaptive weight)
        console.print(f"extra: {record['extra']}")


def summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """The explanation as JSON (the gateway's admin API serves this beside the record)."""
    r = runner_up(record)
    out = record.get("outcome") or {}
    return {
        "id": record["id"], "policy": record["policy"], "chosen": record["chosen"],
        "runner_up": r["worker"] if r is not None else None, "margin_ms": record["margin_ms"],
        "predicted_ttft_ms": record.get("predicted_ttft_ms"),
        "measured_ttft_ms": out.get("ttft_ms"), "ttft_kind": out.get("ttft_kind"),
        "predicted_hit": record.get("predicted_hit"),
        "predicted_cached_tokens": record.get("predicted_cached_tokens"),
        "reported_cached_tokens": out.get("cached_tokens"),
        "reason": plain_reason(record), "router_reason": record.get("reason"),
        "flow": record.get("flow"), "waited": flow_line(record),
        "turn_ms": record.get("turn_ms") or 0.0,
    }
