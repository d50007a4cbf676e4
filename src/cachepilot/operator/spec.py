"""CachePilotPool bodies → the plain values the controller works with (Pod bodies:
:mod:`cachepilot.operator.pods`).

Everything here is pure: parsing, validation, label selectors, port resolution. The API
server already applies the CRD schema, but the operator validates again because a pool may
come from a cluster whose CRD is older or missing its schema, and an invalid pool must end
up as a condition with a reason, never as an exception in a handler (kopf would retry it
forever).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cachepilot.core import BlockConfig, CostModel, PoolSpec, Weights
from cachepilot.core.flow.config import FlowConfig
from cachepilot.core.policies import LIVE_POLICIES
from cachepilot.datalayer.engine_metrics import ENGINES
from cachepilot.datalayer.kv_events import Endpoints
from cachepilot.operator import crd
from cachepilot.operator.pods import PodView as PodView  # re-exported
from cachepilot.operator.pods import PortRef as PortRef  # re-exported
from cachepilot.operator.pods import host_port as host_port  # re-exported
from cachepilot.operator.pods import pod_view as pod_view  # re-exported
from cachepilot.operator.pods import resolve_port


class InvalidSpec(ValueError):
    """A pool spec the operator cannot route with; ``reason`` becomes the condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator == "In":
            return present and labels[self.key] in self.values
        if self.operator == "NotIn":
            return not present or labels[self.key] not in self.values
        if self.operator == "Exists":
            return present
        return not present  # DoesNotExist


@dataclass(frozen=True, slots=True)
class Selector:
    """A Kubernetes label selector (matchLabels are ANDed with matchExpressions)."""

    requirements: tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    port: PortRef
    path: str
    interval_s: float
    timeout_s: float
    stale_after_s: float
    engine: str


@dataclass(frozen=True, slots=True)
class TokenizerSource:
    """Where the gateway reads the pool's engines' prompt path (``spec.routing.tokenizer``):
    files mounted into the gateway's pod, loaded by
    :func:`cachepilot.datalayer.model_files.load_prompts` when the pool is applied."""

    path: str  # a model folder (tokenizer.json, tokenizer_config.json, …) or tokenizer.json
    chat_template: str | None = None  # the file the engines got with --chat-template
    content_format: str = "auto"
    lora_modules: tuple[str, ...] = ()  # name=path, as the engines' --lora-modules
    served_model_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where each worker pod publishes vLLM's KV-cache events (``--kv-events-config``).

    The port is the same for every pod (``port``) or read from a pod annotation
    (``port_annotation``: pods without it publish nothing we follow). ``replay_port`` is the
    publisher's ``replay_endpoint``; ``None`` means the events port + 1, the convention of
    ``cachepilot gateway --kv-events-port`` and of our sample workers.
    """

    port: PortRef
    port_annotation: str | None
    replay_port: PortRef
    replay: bool
    topic: str


@dataclass(frozen=True, slots=True)
class WorkerSource:
    """Which pods are a pool's workers and on which ports: from a CachePilotPool's own
    ``selector``/``port``, or from an InferencePool's ``selector``/``targetPorts`` (each
    target port of a pod is a worker of its own, as the endpoint picker protocol says)."""

    selector: Selector
    ports: tuple[PortRef, ...]
    raw_selector: Mapping[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A validated pool: what to select, where to send and scrape, how to route.

    ``source`` is ``None`` only for a CachePilotPool whose ``inferencePoolRef`` names an
    InferencePool the operator has not seen (yet): such a pool cannot be routed.
    """

    source: WorkerSource | None
    scrape: ScrapeConfig
    spec: PoolSpec
    generation: int = 0
    inference_pool: str | None = None  # spec.inferencePoolRef.name
    kv_events: KVEventsConfig | None = None
    tokenizer: TokenizerSource | None = None

    @property
    def selector(self) -> Selector:
        assert self.source is not None
        return self.source.selector

    @property
    def port(self) -> PortRef:
        """The serving port when the pool has one (CachePilotPools always do)."""
        assert self.source is not None
        return self.source.ports[0]


def parse_selector(raw: Any) -> Selector:
    if not isinstance(raw, Mapping) or not raw:
        raise InvalidSpec("InvalidSelector", "spec.selector is missing or empty: it would "
                          "select every pod in the namespace")
    reqs: list[Requirement] = []
    match_labels = raw.get("matchLabels") or {}
    if not isinstance(match_labels, Mapping):
        raise InvalidSpec("InvalidSelector", "spec.selector.matchLabels must be a map")
    for k, v in sorted(match_labels.items()):
        reqs.append(Requirement(str(k), "In", frozenset({str(v)})))
    for expr in raw.get("matchExpressions") or []:
        op = expr.get("operator") if isinstance(expr, Mapping) else None
        key = expr.get("key") if isinstance(expr, Mapping) else None
        values = expr.get("values") or [] if isinstance(expr, Mapping) else []
        if not key or op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise InvalidSpec("InvalidSelector", f"bad matchExpression {expr!r}")
        if op in ("In", "NotIn") and not values:
            raise InvalidSpec("InvalidSelector", f"{op} needs values: {expr!r}")
        reqs.append(Requirement(str(key), op, frozenset(map(str, values))))
    if not reqs:
        raise InvalidSpec("InvalidSelector", "spec.selector selects every pod; give labels")
    return Selector(tuple(reqs))


def _port_ref(value: Any, where: str) -> PortRef:
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidSpec("InvalidPort", f"{where} must be a port number or name")
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int):
        if not 1 <= value <= 65535:
            raise InvalidSpec("InvalidPort", f"{where}={value} is not a TCP port")
        return value
    if isinstance(value, str) and value:
        return value
    raise InvalidSpec("InvalidPort", f"{where} must be a port number or name, not {value!r}")


def _number(section: Mapping[str, Any], key: str, default: float, where: str,
            minimum: float = 0.0) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidSpec("InvalidSpec", f"{where}.{key} must be a number, not {value!r}")
    if value < minimum:
        raise InvalidSpec("InvalidSpec", f"{where}.{key}={value} is below {minimum}")
    return float(value)


def _section(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = spec.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidSpec("InvalidSpec", f"spec.{key} must be an object")
    return value


def _kv_events(spec: Mapping[str, Any]) -> KVEventsConfig | None:
    kv = spec.get("kvEvents")
    if kv is None:
        return None
    if not isinstance(kv, Mapping):
        raise InvalidSpec("InvalidSpec", "spec.kvEvents must be an object")
    port = _port_ref(kv.get("port"), "spec.kvEvents.port")
    annotation = kv.get("portAnnotation")
    if annotation is not None and (not isinstance(annotation, str) or not annotation):
        raise InvalidSpec("InvalidSpec", "spec.kvEvents.portAnnotation must be an annotation "
                          f"key, not {annotation!r}")
    if (port is None) == (annotation is None):
        raise InvalidSpec("InvalidSpec", "spec.kvEvents needs exactly one of port and "
                          "portAnnotation")
    replay = kv.get("replay", True)
    if not isinstance(replay, bool):
        raise InvalidSpec("InvalidSpec", f"spec.kvEvents.replay must be true or false, "
                          f"not {replay!r}")
    topic = kv.get("topic", crd.DEFAULT_KV_TOPIC)
    if not isinstance(topic, str):
        raise InvalidSpec("InvalidSpec", f"spec.kvEvents.topic must be a string: {topic!r}")
    return KVEventsConfig(port=port, port_annotation=annotation,
                          replay_port=_port_ref(kv.get("replayPort"), "spec.kvEvents.replayPort"),
                          replay=replay, topic=topic)


def _tokenizer(routing: Mapping[str, Any]) -> TokenizerSource | None:
    tok = routing.get("tokenizer")
    if tok is None:
        return None
    where = "spec.routing.tokenizer"
    if not isinstance(tok, Mapping) or not isinstance(tok.get("path"), str) or not tok["path"]:
        raise InvalidSpec("InvalidSpec", f"{where}.path must name the mounted tokenizer")
    template = tok.get("chatTemplate")
    if template is not None and (not isinstance(template, str) or not template):
        raise InvalidSpec("InvalidSpec", f"{where}.chatTemplate must be a file path")
    fmt = tok.get("chatTemplateContentFormat", "auto")
    if fmt not in ("auto", "string", "openai"):
        raise InvalidSpec("InvalidSpec", f"{where}.chatTemplateContentFormat is auto, string "
                          f"or openai, not {fmt!r}")
    lists = {}
    for key in ("loraModules", "servedModelNames"):
        value = tok.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise InvalidSpec("InvalidSpec", f"{where}.{key} must be a list of strings")
        lists[key] = tuple(value)
    for module in lists["loraModules"]:
        name, sep, path = module.partition("=")
        if not (name and sep and path):
            raise InvalidSpec("InvalidSpec", f"{where}.loraModules entries are name=path, as "
                              f"vLLM's --lora-modules: {module!r}")
    return TokenizerSource(tok["path"], template, fmt, lists["loraModules"],
                           lists["servedModelNames"])


def _flow(spec: Mapping[str, Any]) -> FlowConfig | None:
    """spec.flowControl → this pool's FlowConfig (None: the gateway's settings apply)."""
    if "flowControl" not in spec:
        return None
    section = _section(spec, "flowControl")
    base = FlowConfig()
    changes: dict[str, Any] = {}
    for attr, key in crd.FLOW_FIELDS.items():
        if key not in section:
            continue
        default, value = getattr(base, attr), section[key]
        if isinstance(default, bool | str):
            if type(value) is not type(default):
                raise InvalidSpec("InvalidSpec", f"spec.flowControl.{key} must be a "
                                  f"{type(default).__name__}, not {value!r}")
            changes[attr] = value
        else:
            number = _number(section, key, default, "spec.flowControl")
            if isinstance(default, int):
                if not number.is_integer():
                    raise InvalidSpec("InvalidSpec", f"spec.flowControl.{key} must be a whole "
                                      f"number, not {value!r}")
                number = int(number)
            changes[attr] = number
    try:
        return FlowConfig(**changes)
    except ValueError as e:
        raise InvalidSpec("InvalidSpec", f"spec.flowControl: {e}") from None


def _inference_pool_ref(spec: Mapping[str, Any]) -> str | None:
    ref = spec.get("inferencePoolRef")
    if ref is None:
        return None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    if not isinstance(name, str) or not name:
        raise InvalidSpec("InvalidSpec", "spec.inferencePoolRef.name must name an "
                          "InferencePool")
    if "selector" in spec or "port" in spec:
        raise InvalidSpec("InvalidSpec", "spec.inferencePoolRef takes the workers' selector "
                          "and ports from the InferencePool: drop spec.selector and spec.port")
    return name


def parse_pool(name: str, body: Mapping[str, Any],
               source: WorkerSource | None = None) -> PoolConfig:
    """Validate a CachePilotPool body. Raises :class:`InvalidSpec` with a condition reason.

    A pool with ``spec.inferencePoolRef`` takes its workers from that InferencePool:
    ``source`` is the InferencePool's (:mod:`cachepilot.operator.inferencepool`), or
    ``None`` while it is unknown. Everything else (models, scrape, routing) is the pool's own.
    """
    spec = body.get("spec")
    if not isinstance(spec, Mapping):
        raise InvalidSpec("InvalidSpec", "spec is missing")
    ref = _inference_pool_ref(spec)
    if ref is None:
        source = WorkerSource(parse_selector(spec.get("selector")),
                              (_port_ref(spec.get("port"), "spec.port"),),
                              spec.get("selector") or {})

    models = spec.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise InvalidSpec("InvalidSpec", "spec.models must be a list of model names")

    scrape = _section(spec, "scrape")
    engine = scrape.get("engine", crd.DEFAULT_ENGINE)
    if engine not in ENGINES:
        raise InvalidSpec("UnknownEngine",
                          f"spec.scrape.engine {engine!r} is not one of {', '.join(ENGINES)}")
    path = scrape.get("path", crd.DEFAULT_SCRAPE_PATH)
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidSpec("InvalidSpec", f"spec.scrape.path must start with '/': {path!r}")
    interval = _number(scrape, "intervalSeconds", crd.DEFAULT_SCRAPE_INTERVAL_S,
                       "spec.scrape", 0.05)
    timeout = _number(scrape, "timeoutSeconds", min(crd.DEFAULT_SCRAPE_TIMEOUT_S, interval),
                      "spec.scrape", 0.01)
    base_cost = CostModel()
    # A worker counts as stale only after missing several scrapes: with the cost model's
    # 5 s default and a 10 s interval every worker would look saturated between scrapes.
    stale = _number(scrape, "staleAfterSeconds", max(base_cost.stale_after_s, 3 * interval),
                    "spec.scrape", 0.1)

    routing = _section(spec, "routing")
    policy = routing.get("policy", PoolSpec().policy)
    if policy not in LIVE_POLICIES:
        raise InvalidSpec("UnknownPolicy", f"spec.routing.policy {policy!r} is not one of "
                          f"{', '.join(sorted(LIVE_POLICIES))}")
    w = _section(routing, "weights")
    d = Weights()
    weights = Weights(prefill=_number(w, "prefill", d.prefill, "spec.routing.weights"),
                      load=_number(w, "load", d.load, "spec.routing.weights"),
                      kv=_number(w, "kv", d.kv, "spec.routing.weights"))
    b = BlockConfig()
    block_size = routing.get("blockSize", b.block_size)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidSpec("InvalidSpec", f"spec.routing.blockSize must be a positive integer, "
                          f"not {block_size!r}")
    block = BlockConfig(block_size=block_size,
                        chars_per_token=_number(routing, "charsPerToken", b.chars_per_token,
                                                "spec.routing", 0.1))
    c = _section(routing, "cost")
    changes: dict[str, float] = {}
    for attr, key in crd.COST_FIELDS.items():
        if key in c:
            value = _number(c, key, getattr(base_cost, attr), "spec.routing.cost")
            changes[attr] = int(value) if isinstance(getattr(base_cost, attr), int) else value
    cost = base_cost.with_(stale_after_s=stale, **changes)

    seed = routing.get("vllmHashSeed")
    if seed is not None and (not isinstance(seed, str) or not seed):
        raise InvalidSpec("InvalidSpec", "spec.routing.vllmHashSeed must be the workers' "
                          f"PYTHONHASHSEED as a string, not {seed!r}")
    block = replace(block, vllm_seed=seed)

    capacity = spec.get("capacityBlocks", PoolSpec().capacity_blocks)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise InvalidSpec("InvalidSpec", "spec.capacityBlocks must be a positive integer")

    generation = body.get("metadata", {}).get("generation") or 0
    return PoolConfig(
        source=source,
        scrape=ScrapeConfig(port=_port_ref(scrape.get("port"), "spec.scrape.port"),
                            path=path, interval_s=interval, timeout_s=min(timeout, interval),
                            stale_after_s=stale, engine=engine),
        spec=PoolSpec(name=name, models=tuple(models), policy=policy, weights=weights,
                      cost=cost, block=block, capacity_blocks=capacity, flow=_flow(spec)),
        generation=int(generation),
        inference_pool=ref,
        kv_events=_kv_events(spec),
        tokenizer=_tokenizer(routing),
    )


# ---- pods (their views: cachepilot.operator.pods) -----------------------------------------


def kv_event_endpoints(cfg: KVEventsConfig, pod: PodView) -> Endpoints | None:
    """Where ``pod`` publishes KV events under ``cfg``, or ``None`` if it does not say (no
    annotation, an unknown port name, a bad annotation value, no IP yet): that worker's
    directory stays routing-learned rather than the pool failing."""
    ref: PortRef = cfg.port
    if cfg.port_annotation is not None:
        value = pod.annotations.get(cfg.port_annotation)
        if value is None:
            return None
        try:
            ref = _port_ref(value, f"annotation {cfg.port_annotation}")
        except InvalidSpec:
            return None
    port = resolve_port(ref, pod) if ref is not None else None
    if port is None or pod.ip is None:
        return None
    replay: int | None = None
    if cfg.replay:
        replay = port + 1 if cfg.replay_port is None else resolve_port(cfg.replay_port, pod)
        if replay is None or not 1 <= replay <= 65535:
            return None
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return Endpoints(f"tcp://{host}:{port}",
                     f"tcp://{host}:{replay}" if replay is not None else None, cfg.topic)
