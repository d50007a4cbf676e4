"""Hit prediction for chat on real vLLM workers, through Envoy and the gateway
(``cachepilot experiment real-model --engine vllm --api chat``).

The completions study (:mod:`cachepilot.lab.vllm_study`) checks the exact directory in the
study's own process; this one checks the gateway itself on the traffic users send most:
``/v1/chat/completions``, multi-turn sessions that share system prompts and resend a growing
history (assistant turns included, some unicode, some content as OpenAI text parts), which
the workers render with their chat template (Gemma 3's, ``--chat-template``) and the
gateway renders the same way (:mod:`cachepilot.core.vllm_prompt`) to hash the engine's own
blocks. Two vLLM workers with a small KV cache (prefixes and histories evict each other)
run behind Envoy and the gateway (``cachepilot up --engine vllm``'s stack, with a decision
log); each (seed, policy) phase resets both prefix caches and starts the gateway afresh
with the phase's policy: ``cachepilot`` (the gateway's default, ``priced``) or
``round_robin``. Requests are streamed, ``max_tokens=1``, two sessions' turns in flight at
a time (a session's next turn waits for its previous answer, as a chat client does).

Per request: *events* is the gateway's prediction (its decision record's
``predicted_cached_tokens``, the exact directory in ``exact`` mode), *approximate* a
routing-learned directory in this process told where the gateway sent each request (as
soon as the answer's headers name the worker), and the truth is the engine's
``usage.prompt_tokens_details.cached_tokens``. TTFT is the first streamed chunk. With
``outside``, a share of the requests goes straight to a random worker, bypassing Envoy and
the gateway (the same requests, to the same worker, under both policies); the others are
scored.

The traffic is built in :mod:`cachepilot.lab.vllm_chat_traffic`, the study's own KV-event
subscriber and its diagnosis of a wrong prediction are in
:mod:`cachepilot.lab.vllm_chat_events`; this module configures and runs the phases.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cachepilot.core.directory import PrefixDirectory
from cachepilot.core.fingerprint import vllm_block_hashes, vllm_none_hash
from cachepilot.core.request import CHAT_PATH, parse_openai_body
from cachepilot.lab.vllm_chat_events import EventLog, diagnose
from cachepilot.lab.vllm_chat_events import Logged as Logged  # re-exported
from cachepilot.lab.vllm_chat_traffic import ChatRequest, outside_requests, sessions
from cachepilot.lab.vllm_chat_traffic import system_prompt as system_prompt  # re-exported
from cachepilot.lab.vllm_study import Sample, phase_record, summarise

POLICIES = ("round_robin", "cachepilot")
GATEWAY_POLICY = {"cachepilot": "priced", "round_robin": "round_robin"}


@dataclass(frozen=True)
class ChatStudyConfig:
    seeds: tuple[int, ...] = (1, 2, 3)
    policies: tuple[str, ...] = POLICIES
    workers: int = 2
    requests: int = 60  # per phase (~17 sessions)
    systems: int = 4  # shared system prompts
    system_words: int = 210  # ~300-350 tokens each
    no_system: float = 0.1  # sessions without a system prompt
    zipf: float = 1.1
    open_sessions: int = 3  # sessions whose turns interleave
    max_turns: int = 5
    user_words: tuple[int, int] = (6, 40)
    reply_words: tuple[int, int] = (15, 70)
    documents: float = 0.1  # user turns that paste a document (~150 words)
    unicode: float = 0.05  # share of words from UNICODE
    parts: float = 0.15  # messages sent as OpenAI text parts
    num_blocks: int = 64  # per worker: 2,048 tokens at block size 32, ~2-3 histories
    max_model_len: int = 1536
    concurrency: int = 2
    outside: float = 0.0


@dataclass
class ChatSample(Sample):
    session: int = -1
    turn: int = 0
    rendered_tokens: int = 0  # this process's render of the request (== prompt_tokens)
    fallback: str | None = None  # the decision record's exact_fallback
    decision: str = ""
    why: str | None = None  # a wrong hit prediction, explained from the engine's events


# -- one phase -------------------------------------------------------------------------------

async def _stream(session: Any, url: str, body: dict[str, Any],
                  on_headers: Any = None) -> dict[str, Any]:
    """POST a streamed chat completion; the answer's headers (``on_headers`` is called
    with them first), TTFT (first chunk with a choice) and usage."""
    t0 = time.perf_counter()
    async with session.post(f"{url}{CHAT_PATH}", json=body) as resp:
        if on_headers is not None:
            on_headers(resp.headers)
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: "
                               f"{(await resp.read())[:300].decode(errors='replace')}")
        ttft = usage = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
        if usage is None:
            raise RuntimeError(f"{url}: no usage in the stream")
        return {"headers": resp.headers, "ttft": ttft if ttft is not None
                else time.perf_counter() - t0, "usage": usage}


def _capped(blocks_tokens: int, n_tokens: int, bs: int) -> int:
    return min(blocks_tokens, (n_tokens - 1) // bs * bs)  # vLLM computes at least one token


async def run_phase(cfg: ChatStudyConfig, policy: str, seed: int, stack: Any, prompts: Any,
                    none_hash: bytes, events: EventLog | None = None
                    ) -> tuple[list[ChatSample], dict[str, Any]]:
    """One phase through ``stack`` (a started :class:`~cachepilot.tooling.vllm.stack.VllmStack`
    whose gateway already runs ``policy``, its caches reset); the scored samples and the
    gateway's view of the workers at the end."""
    import aiohttp

    bs = stack.spec.block_size
    addrs = stack.worker_addresses
    reqs = sessions(cfg, seed, stack.spec.served_name)
    outside = outside_requests(cfg, seed, addrs)
    approx = PrefixDirectory(cfg.num_blocks)
    for a in addrs:
        approx.add_worker(a, cfg.num_blocks)
    inflight = dict.fromkeys(addrs, 0)
    done = {r.index: asyncio.Event() for r in reqs}
    modes: dict[str, str] = {}
    samples: list[ChatSample] = []
    queue = list(reqs)
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=900)

    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def poll_modes() -> None:
            while True:
                try:
                    async with http.get(f"{stack.admin_url}/workers") as r:
                        for w in await r.json():
                            modes[w["address"]] = w["directory_mode"]
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.5)

        async def decision(decision_id: str) -> dict[str, Any]:
            for _ in range(100):  # the decision log commits in batches
                async with http.get(f"{stack.admin_url}/decisions/{decision_id}") as r:
                    if r.status == 200:
                        return (await r.json())["record"]
                await asyncio.sleep(0.2)
            raise RuntimeError(f"no decision record {decision_id}")

        async def one(req: ChatRequest) -> None:
            parsed = parse_openai_body(CHAT_PATH, json.dumps(req.body).encode())
            ids = prompts.prompt(parsed).token_ids
            hashes = vllm_block_hashes(ids, bs, none_hash)
            before = approx.match(hashes, addrs)  # the routing-learned view when sent
            seen: dict[str, Any] = {}

            def routed(headers: Any) -> None:
                worker = headers.get("x-cachepilot-worker")
                if worker in inflight:
                    seen["worker"], seen["mode"] = worker, modes.get(worker, "?")
                    seen["queued"] = inflight[worker]
                    inflight[worker] += 1
                    approx.insert(worker, hashes)

            t0 = time.monotonic()
            got = await _stream(http, stack.url, req.body, routed)
            worker = seen.get("worker")
            if worker is None:
                raise RuntimeError(f"request {req.index}: no x-cachepilot-worker header")
            inflight[worker] -= 1
            rec = await decision(got["headers"]["x-cachepilot-decision-id"])
            if rec["chosen"] != worker:
                raise RuntimeError(f"request {req.index}: routed to {rec['chosen']}, "
                                   f"answered by {worker}")
            usage = got["usage"]
            n = usage["prompt_tokens"]
            measured = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            predicted = _capped(int(rec["predicted_cached_tokens"]), n, bs)
            why = None
            if events is not None and (predicted > 0) != (measured > 0):
                await asyncio.sleep(2.0)  # a late event is what explains most
                why = diagnose(rec, predicted, measured, worker, events.entries, bs)
            samples.append(ChatSample(
                policy, seed, worker, n, measured, predicted,
                _capped(before[worker] * bs, n, bs), got["ttft"], seen["mode"], req.index,
                round(t0 - start, 3), seen["queued"], req.session, req.turn, len(ids),
                rec.get("exact_fallback"), rec["id"], why))

        async def bypass(req: ChatRequest, worker: str) -> None:
            await _stream(http, f"http://{worker}", req.body)

        async def lane() -> None:
            while queue:
                req = queue.pop(0)
                if req.after is not None:
                    await done[req.after].wait()
                try:
                    if req.index in outside:
                        await bypass(req, outside[req.index])
                    else:
                        await one(req)
                finally:
                    done[req.index].set()

        async with http.get(f"{stack.admin_url}/workers") as r:
            modes.update({w["address"]: w["directory_mode"] for w in await r.json()})
        poller = asyncio.create_task(poll_modes())
        try:
            await asyncio.gather(*(lane() for _ in range(cfg.concurrency)))
        finally:
            poller.cancel()
        async with http.get(f"{stack.admin_url}/workers") as r:
            workers = {w["address"]: w["kv_events"] for w in await r.json()}
    samples.sort(key=lambda s: s.index)
    return samples, workers


async def reset_caches(stack: Any, timeout_s: float = 60.0) -> None:
    """Empty both workers' prefix caches (vLLM publishes AllBlocksCleared at its next step,
    which a one-token request makes it take)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        for a in stack.worker_addresses:
            async with http.post(f"http://{a}/reset_prefix_cache") as r:
                r.raise_for_status()
            async with http.post(f"http://{a}/v1/completions", json={
                    "model": stack.spec.served_name, "prompt": "Hi", "max_tokens": 1}) as r:
                r.raise_for_status()


# -- the study -------------------------------------------------------------------------------

@dataclass
class _Counters:
    render_mismatches: int = 0  # our token count != the engine's prompt_tokens
    fallbacks: int = 0  # requests the gateway matched approximately
    gateway_restarts: int = 0
    per_phase: list[dict[str, Any]] = field(default_factory=list)


async def run(cfg: ChatStudyConfig, venv: Path, log_dir: Path,
              progress: Any = print) -> dict[str, Any]:
    """Every (seed, policy) phase on two workers behind Envoy and the gateway; the data the
    report reads (:func:`cachepilot.lab.vllm_report.write_outputs`), as the completions
    study's, with ``config.api == "chat"``."""
    from cachepilot.datalayer.model_files import load_prompts
    from cachepilot.tooling.vllm.model import prepare
    from cachepilot.tooling.vllm.stack import VllmStack
    from cachepilot.tooling.vllm.worker import VllmWorkerSpec

    model = prepare(venv)
    spec = VllmWorkerSpec(max_model_len=cfg.max_model_len,
                          extra_args=("--num-gpu-blocks-override", str(cfg.num_blocks)),
                          extra_env=(("VLLM_SERVER_DEV_MODE", "1"),))  # /reset_prefix_cache
    assert spec.chat_template is not None
    prompts = load_prompts(model, chat_template=spec.chat_template,
                           served_models=(spec.served_name,))
    none_hash = vllm_none_hash(spec.hash_seed)
    log_dir = log_dir.absolute()
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = VllmStack(workers=cfg.workers, venv=venv, model=model, spec=spec,
                      log_dir=str(log_dir), policy=GATEWAY_POLICY[cfg.policies[0]],
                      decision_log=str(log_dir / "decisions-start"))
    samples: list[ChatSample] = []
    phases: list[dict[str, Any]] = []
    counters = _Counters()
    subscribers: dict[str, Any] = {}
    events = EventLog()
    t_start, load_start = time.monotonic(), os.getloadavg()
    try:
        t0 = time.monotonic()
        await asyncio.to_thread(stack.start)
        progress(f"[chat study] workers, gateway and Envoy ready in "
                 f"{time.monotonic() - t0:.0f} s: {stack.url}")
        events.start({a: f"tcp://{h}:{stack.events_port}"
                      for a, h in zip(stack.worker_addresses, stack.hosts, strict=True)})
        for seed in cfg.seeds:
            for i in range(len(cfg.policies)):
                policy = cfg.policies[(i + seed) % len(cfg.policies)]  # order rotated per seed
                t0, load0 = time.monotonic(), os.getloadavg()[0]
                await reset_caches(stack)
                # A fresh gateway with the phase's policy reads the workers' histories, the
                # clear included: its directory starts empty and exact.
                await asyncio.to_thread(stack.restart_gateway, GATEWAY_POLICY[policy],
                                        str(log_dir / f"decisions-{seed}-{policy}"))
                counters.gateway_restarts += 1
                held = {w["address"]: w["kv_events"]["event_blocks"]
                        for w in await asyncio.to_thread(stack.workers_status)}
                if any(held.values()):
                    raise RuntimeError(f"the caches did not clear: {held}")
                got, subscribers = await run_phase(cfg, policy, seed, stack, prompts,
                                                   none_hash, events)
                samples += got
                ph = phase_record(got, seed, policy, time.monotonic() - t0,
                                  (load0, os.getloadavg()[0]))
                mism = sum(1 for s in got if s.rendered_tokens != s.prompt_tokens)
                falls = sum(1 for s in got if s.fallback)
                ph |= {"render_mismatches": mism, "fallbacks": falls,
                       "outside": cfg.requests - len(got), "subscribers": subscribers}
                counters.render_mismatches += mism
                counters.fallbacks += falls
                phases.append(ph)
                progress(f"[chat study] seed {seed} {policy}: {len(got)} scored requests in "
                         f"{ph['wall_s']:.0f} s; events P/R {ph['events']['precision']:.3f}/"
                         f"{ph['events']['recall']:.3f}, approximate "
                         f"{ph['approximate']['precision']:.3f}/"
                         f"{ph['approximate']['recall']:.3f}; TTFT p50 {ph['ttft_p50_s']:.2f} s"
                         f" p90 {ph['ttft_p90_s']:.2f} s; render mismatches {mism}, "
                         f"fallbacks {falls}; load {ph['loadavg_1m']}")
    finally:
        await events.stop()
        await asyncio.to_thread(stack.stop)
    return {"config": {**asdict(cfg), "api": "chat", "routers": list(cfg.policies),
                       "block_size": spec.block_size, "hash_seed": spec.hash_seed,
                       "gateway_policies": GATEWAY_POLICY},
            "workloads": {"vllm": {"kind": "chat sessions sharing system prompts (Zipf)",
                                   "systems": cfg.systems, "concurrency": cfg.concurrency}},
            "phases": phases, "summary": summarise(samples), "subscribers": subscribers,
            "checks": {"render_mismatches": counters.render_mismatches,
                       "fallbacks": counters.fallbacks,
                       "gateway_restarts": counters.gateway_restarts},
            "samples": [asdict(s) for s in samples],
            "wall_s": round(time.monotonic() - t_start, 1),
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
