import orjson
import pytest

from cachepilot.core.request import RequestError, flatten_messages, parse_openai_body


def body(**kw: object) -> bytes:
    return orjson.dumps(kw)


def test_completion_string_and_token_prompts() -> None:
    r = parse_openai_body("/v1/completions", body(model="m", prompt="hello", max_tokens=5))
    assert (r.model, r.prompt, r.token_ids, r.max_tokens, r.stream) == ("m", "hello", None, 5,
                                                                         False)
    r = parse_openai_body("/v1/completions?x=1", body(model="m", prompt=[1, 2, 3], stream=True))
    assert r.token_ids == (1, 2, 3) and r.stream
    r = parse_openai_body("/v1/completions", body(model="m", prompt=[[4, 5], [6]]))
    assert r.token_ids == (4, 5)
    r = parse_openai_body("/v1/completions", body(model="m", prompt=["first", "second"]))
    assert r.prompt == "first"


def test_chat_flattening_keeps_roles_and_shares_history_prefix() -> None:
    sys_msg = {"role": "system", "content": "You are terse."}
    a = parse_openai_body("/v1/chat/completions", body(model="m", messages=[
        sys_msg, {"role": "user", "content": "hi"}]))
    b = parse_openai_body("/v1/chat/completions", body(model="m", messages=[
        sys_msg, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "more"}]))
    assert b.prompt.startswith(a.prompt)
    assert "<|system|>" in a.prompt and a.kind == "chat"
    parts = flatten_messages([{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]}])
    assert "look" in parts and '"image_url"' in parts


@pytest.mark.parametrize(("path", "raw", "status", "words"), [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1,2]", 400, "JSON object"),
    ("/v1/completions", body(prompt="x"), 400, "'model'"),
    ("/v1/completions", body(model=3, prompt="x"), 400, "'model'"),
    ("/v1/completions", body(model="m"), 400, "'prompt' is required"),
    ("/v1/completions", body(model="m", prompt={"a": 1}), 400, "'prompt' must be"),
    ("/v1/completions", body(model="m", prompt=[1, "a"]), 400, "'prompt' must be"),
    ("/v1/completions", body(model="m", prompt="x", stream="yes"), 400, "'stream'"),
    ("/v1/completions", body(model="m", prompt="x", max_tokens=-1), 400, "'max_tokens'"),
    ("/v1/completions", body(model="m", prompt="x", max_tokens=True), 400, "'max_tokens'"),
    ("/v1/chat/completions", body(model="m"), 400, "'messages'"),
    ("/v1/chat/completions", body(model="m", messages=[]), 400, "'messages'"),
    ("/v1/chat/completions", body(model="m", messages=["x"]), 400, "messages[0]"),
    ("/v1/chat/completions", body(model="m", messages=[{"content": "x"}]), 400, "role"),
    ("/v1/chat/completions", body(model="m", messages=[{"role": "u", "content": 5}]), 400,
     "content"),
    ("/v1/embeddings", body(model="m"), 404, "not an inference endpoint"),
])
def test_bad_input_is_a_clear_error(path: str, raw: bytes, status: int, words: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_openai_body(path, raw)
    assert exc.value.status == status
    assert words in exc.value.message
    err = orjson.loads(exc.value.to_json())["error"]
    assert err["code"] == status and words in err["message"]
