"""What a rule is, and what a rule's check gets: the suite's Envoy, the fake workers and an
HTTP session (:class:`Context`), and the replies it reads (:class:`Reply`).

Every rule has a class:

* ``protocol`` — required: a MUST of the protocol proposal (profile EPP-Core, ``core``);
* ``reference`` — recommended: what the reference EPP does, or what upstream fixed after users
  hit it (EPP-Core, ``extended``, one feature each);
* ``extension`` — CachePilot's own behaviour (profile CachePilot-Extensions).

and at least one :class:`~cachepilot.conformance.sources.Source`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from cachepilot.conformance.envoy import (
    ENVOY_REPLY_HEADER,
    SUBSET_LIST_HEADER,
    SUBSET_STRING_HEADER,
    SuiteEnvoy,
)
from cachepilot.conformance.sources import Source
from cachepilot.conformance.wire import Wire
from cachepilot.conformance.workers import WORKER_HEADER, FakeWorker

PROTOCOL, REFERENCE, EXTENSION = "protocol", "reference", "extension"
LEVEL = {PROTOCOL: "required", REFERENCE: "recommended", EXTENSION: "extension"}
MODEL = "conformance-fake-model"  # the upstream conformance tests' model name
REWRITE_TARGET = "conformance-fake-model-v2"
UNKNOWN_MODEL = "conformance-no-such-model"
COMPLETIONS = "/v1/completions"
NOWHERE = "192.0.2.1:9"  # TEST-NET-1: no pool has it
BASE = object()  # the suite's ordinary hint (Context.base_hint)


@dataclass
class SuiteConfig:
    epp: tuple[str, int]  # the EPP under test (gRPC ext_proc)
    workers: list[tuple[str, int]]  # its pool: where the fake workers listen (it knows them)
    epp_b: tuple[str, int] | None = None  # a second pool's EPP (rule PoolsScoped)
    workers_b: list[tuple[str, int]] = field(default_factory=list)
    model: str = MODEL
    rewrite_target: str = REWRITE_TARGET
    unknown_model: str = UNKNOWN_MODEL
    max_body_bytes: int = 8 * 1024 * 1024  # the EPP's limit (rule BodyOverLimit413)
    ready_timeout_s: float = 30.0
    # How long to wait for the EPP to notice a change of its workers (down, saturated).
    settle_timeout_s: float = 10.0
    # How long requests are watched while every worker is saturated (rule DropIs429).
    saturation_window_s: float = 3.0
    only: tuple[str, ...] = ()  # rule ids or names to run (empty: all of the profiles)
    skip: tuple[str, ...] = ()  # rule ids or names declared unsupported (reported skipped)
    profiles: tuple[str, ...] = ("epp-core", "cachepilot")


Check = Callable[["Context"], Awaitable[None]]


@dataclass(frozen=True)
class Rule:
    id: str  # P01, R01, X01
    name: str  # CamelCase, as the upstream conformance tests' short names
    cls: str  # PROTOCOL | REFERENCE | EXTENSION
    text: str
    sources: tuple[Source, ...]
    check: Check
    feature: str = ""  # the extended feature a reference rule stands for
    needs: tuple[str, ...] = ()  # "ipv6" (an IPv6 worker), "pool_b" (a second pool)
    mutates: bool = False  # changes the workers' state: run after the others

    @property
    def level(self) -> str:
        return LEVEL[self.cls]


RULES: list[Rule] = []


def rule(id: str, name: str, cls: str, text: str, *sources: Source, feature: str = "",
         needs: tuple[str, ...] = (), mutates: bool = False) -> Callable[[Check], Check]:
    assert sources, f"{id}: a rule cites its source"
    assert cls in LEVEL, cls

    def add(fn: Check) -> Check:
        RULES.append(Rule(id, name, cls, text, tuple(sources), fn, feature, needs, mutates))
        return fn
    return add


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    stream_failures: int = 0  # ext_proc streams that failed in Envoy during the request

    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def worker(self) -> str:
        """The fake worker that answered ("" if none did)."""
        return self.headers.get(WORKER_HEADER, "")

    def seen(self) -> dict[str, Any]:
        """What the worker received (the fake worker's echo)."""
        try:
            data = self.json()
        except orjson.JSONDecodeError:
            data = None
        assert isinstance(data, dict) and "conformance" in data, (
            f"not a fake worker's answer (HTTP {self.status}, "
            f"{ENVOY_REPLY_HEADER}: {self.headers.get(ENVOY_REPLY_HEADER)}): {self.body[:200]!r}")
        return data["conformance"]

    def destinations(self) -> tuple[str | None, str | None]:
        """(the destination header, the envoy.lb metadata) as the worker received them."""
        seen = self.seen()
        meta = seen.get("metadata_destination") or None
        return seen.get("destination") or None, None if meta == "-" else meta


def endpoints(value: str | None) -> list[str]:
    """The entries of a destination value ``ip:port,ip:port``."""
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def canonical(endpoint: str) -> str:
    """``ip:port`` with an IPv6 address bracketed and compressed (unparseable: as given), so
    membership can be checked apart from how an address is written."""
    host, _, port = endpoint.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return endpoint
    return f"[{ip.compressed}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _why(reply: Reply) -> str:
    out = []
    if reply.stream_failures:
        out.append("the ext_proc stream failed")
    if reply.headers.get(ENVOY_REPLY_HEADER):
        out.append(f"details {reply.headers[ENVOY_REPLY_HEADER]}")
    if reply.worker:
        out.append(f"from worker {reply.worker}")
    return f" ({'; '.join(out)})" if out else ""


def expect(reply: Reply, status: int, what: str) -> None:
    assert reply.status == status, (
        f"{what}: expected HTTP {status}, got {reply.status}{_why(reply)}: "
        f"{reply.body[:300]!r}")


def refused(reply: Reply, status: int) -> bool:
    """The EPP answered ``status`` itself: an ImmediateResponse, so neither a worker's answer
    nor Envoy's reply to a failed ext_proc stream."""
    return reply.status == status and not reply.worker and not reply.stream_failures


def expect_refused(reply: Reply, status: int, what: str) -> None:
    expect(reply, status, what)
    assert refused(reply, status), (
        f"{what}: the {status} is not an ImmediateResponse from the EPP{_why(reply)}")


@dataclass
class Context:
    cfg: SuiteConfig
    envoy: SuiteEnvoy
    workers: list[FakeWorker]  # the pool
    workers_b: list[FakeWorker]  # the second pool (empty without one)
    session: aiohttp.ClientSession
    wire: Wire

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    @property
    def ipv4(self) -> list[str]:
        return [a for a in self.addresses if not a.startswith("[")]

    @property
    def ipv6(self) -> list[str]:
        return [a for a in self.addresses if a.startswith("[")]

    @property
    def base_hint(self) -> list[str] | None:
        """The hint the suite's ordinary requests carry: the IPv4 workers, in the protocol's
        list form, when the pool has an IPv6 one; none otherwise. So only the rules about
        addresses (IPv6Endpoint, PoolWithoutHint) can reach the IPv6 worker, and an EPP
        that mis-writes IPv6 addresses fails those rules, not every rule by chance."""
        return self.ipv4 if self.ipv6 else None

    def body(self, prompt: str = "Write as if you were a critic: San Francisco",
             **extra: Any) -> dict[str, Any]:
        return {"model": self.cfg.model, "prompt": prompt, "max_tokens": 4, **extra}

    def hint_headers(self, hint: Any = BASE, hint_string: str | None = None
                     ) -> dict[str, str]:
        """The request headers the suite's Envoy turns into the subset hint."""
        hdrs = {}
        if hint is BASE:
            hint = self.base_hint
        if hint is not None:
            assert hint, "an empty list hint goes through the empty-list listener"
            hdrs[SUBSET_LIST_HEADER] = ",".join(hint)
        if hint_string is not None:
            hdrs[SUBSET_STRING_HEADER] = hint_string
        return hdrs

    async def request(self, method: str, path: str = COMPLETIONS, payload: Any = None, *,
                      data: Any = None, host: str | None = None, hint: Any = BASE,
                      hint_string: str | None = None, headers: dict[str, str] | None = None,
                      url: str = "") -> Reply:
        """One request through the suite's Envoy. ``hint``: a list of ip:port sent as the
        protocol's list subset hint (BASE: the base hint; None: no hint); ``hint_string``:
        the comma-separated string form instead."""
        hdrs = {**(headers or {}), **self.hint_headers(hint, hint_string)}
        if host:
            hdrs["Host"] = host
        if payload is not None:
            data = orjson.dumps(payload)
            hdrs.setdefault("content-type", "application/json")
        failures = await self.envoy.ext_proc_failures(self.session)
        async with self.session.request(method, (url or self.envoy.url) + path, data=data,
                                        headers=hdrs) as r:
            reply = Reply(r.status, {k.lower(): v for k, v in r.headers.items()},
                          await r.read())
        reply.stream_failures = await self.envoy.ext_proc_failures(self.session) - failures
        return reply

    async def post(self, payload: Any = None, **kw: Any) -> Reply:
        return await self.request("POST", kw.pop("path", COMPLETIONS), payload, **kw)

    async def get(self, path: str, **kw: Any) -> Reply:
        return await self.request("GET", path, **kw)

    def hits(self) -> int:
        return sum(w.hits for w in (*self.workers, *self.workers_b))

    async def until(self, check: Callable[[], Awaitable[bool]], what: str) -> None:
        deadline = time.monotonic() + self.cfg.settle_timeout_s
        while not await check():
            assert time.monotonic() < deadline, f"{what} not seen in {self.cfg.settle_timeout_s}s"
            await asyncio.sleep(0.1)

    def set_state(self, workers: Sequence[FakeWorker], **state: bool) -> None:
        for w in workers:
            for k, v in state.items():
                setattr(w, k, v)

