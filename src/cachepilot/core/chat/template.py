"""A model's chat template, compiled and rendered exactly as vLLM 0.32 renders it.

vLLM does not render templates itself: ``safe_apply_chat_template`` (vllm/renderers/hf.py)
calls transformers' ``apply_chat_template(..., tokenize=False)``, whose
``_cached_compile_jinja_template`` (transformers/utils/chat_template_utils.py) builds the
environment reproduced in :func:`environment`: an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``, the ``{% generation %}`` tag and loop controls,
``tojson`` as ``json.dumps(ensure_ascii=False)`` (no HTML escaping) and the globals
``raise_exception`` and ``strftime_now``. The template is rendered with
``messages, tools, documents, add_generation_prompt`` and the tokenizer's named special
tokens, overridden by the request's ``chat_template_kwargs`` after vLLM's filter
(:meth:`ChatTemplate.template_kwargs`).

Why Jinja itself (the ``jinja2`` library, a dependency) rather than a hand-written renderer:
a chat template is an arbitrary Jinja program (loops, macros, filters, whitespace control,
a sandbox); any re-implementation would be exact only for the templates it was tested on.
The same library, in the same version line and configuration, renders the same bytes.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cachepilot.core.chat.detect import ContentFormat, detect_content_format

# transformers' apply_chat_template named parameters (TokenizersBackend and the Python
# backend: vLLM accepts a request kwarg only if it is one of these or a template variable).
# They are consumed by apply_chat_template, never seen by the template itself.
APPLY_PARAMS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class NotExact(Exception):
    """This request's prefill cannot be reproduced exactly here. ``reason`` is a short,
    bounded label (a metric label and a decision-record field); ``detail`` says more."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: transformers marks assistant tokens with it;
    when rendering a prompt it outputs its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # The gateway's clock, as the engine uses its own: equal except across a date boundary
    # between the two renderings (docs/vllm.md).
    return datetime.now().strftime(fmt)


def environment() -> ImmutableSandboxedEnvironment:
    """transformers' chat-template environment (``_cached_compile_jinja_template``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """One template text with the tokenizer's named special tokens (``bos_token``,
    ``eos_token``, … from ``tokenizer_config.json``). ``content_format`` is ``auto`` (vLLM's
    detection), ``string`` or ``openai`` (vLLM's ``--chat-template-content-format``)."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    content_format_option: str = "auto"

    def __post_init__(self) -> None:
        if self.content_format_option not in ("auto", "string", "openai"):
            raise ValueError("content format is auto, string or openai, not "
                             f"{self.content_format_option!r}")
        self.compiled  # noqa: B018 - a syntax error shows when the template is loaded

    @cached_property
    def compiled(self) -> jinja2.Template:
        return environment().from_string(self.source)

    @cached_property
    def variables(self) -> frozenset[str]:
        """The template's undeclared variables: the names a request's kwargs may set. Found
        as vLLM finds them (``_resolve_chat_template_kwargs``): in an environment without
        transformers' globals, so ``raise_exception`` counts as one."""
        ast = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[_Generation, jinja2.ext.loopcontrols]).parse(self.source)
        return frozenset(jinja2.meta.find_undeclared_variables(ast))

    @cached_property
    def content_format(self) -> ContentFormat:
        if self.content_format_option != "auto":
            return self.content_format_option  # type: ignore[return-value]
        return detect_content_format(environment().parse(self.source))

    @cached_property
    def supports_developer(self) -> bool:
        """vLLM's test (``_detect_developer_role_support``): otherwise developer messages
        become system messages."""
        return '"developer"' in self.source or "'developer'" in self.source

    def uses(self, name: str) -> bool:
        return name in self.variables

    def template_kwargs(self, request_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's ``resolve_chat_template_kwargs``: a key survives if transformers'
        ``apply_chat_template`` names it or the template reads it; the survivors that are not
        ``apply_chat_template`` parameters reach the template (over the special tokens)."""
        out: dict[str, Any] = {}
        for key, value in request_kwargs.items():
            if key in APPLY_PARAMS:
                continue
            if key in self.variables:
                out[key] = value
        return out

    def render(self, conversation: Sequence[dict[str, Any]], *,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               tools: list[Any] | None = None, documents: list[Any] | None = None,
               kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text (transformers' ``render_jinja_template``). A template error (its
        ``raise_exception``, a bad variable) raises :class:`NotExact`: vLLM answers 400."""
        if not conversation:
            raise NotExact("invalid_request", "empty conversation")
        if continue_final_message and add_generation_prompt:
            raise NotExact("invalid_request", "continue_final_message with "
                           "add_generation_prompt")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise NotExact("invalid_request", "documents must be objects")
        chat: Sequence[dict[str, Any]] = conversation
        final = ""
        if continue_final_message:
            chat, final = self._tag_final(conversation)
        try:
            text = self.compiled.render(messages=chat, tools=tools, documents=documents,
                                        add_generation_prompt=add_generation_prompt,
                                        **{**self.special_tokens, **(kwargs or {})})
        except Exception as exc:  # the template's own checks, or a bug it has
            raise NotExact("template_error", str(exc)[:200]) from None
        if continue_final_message:
            text = self._cut_at_tag(text, final)
        return text

    def _tag_final(self, conversation: Sequence[dict[str, Any]]
                   ) -> tuple[list[dict[str, Any]], str]:
        """transformers appends a tag to the last message's (last text part's) content,
        renders, and cuts the prompt where the tag is."""
        if "content" not in self.source:
            raise NotExact("template_error", "the template has no 'content' to continue")
        chat = copy.deepcopy(list(conversation))
        last = chat[-1]
        content = last.get("content")
        if content is None:
            raise NotExact("invalid_request", "no final message content to continue")
        if isinstance(content, list | tuple):
            for part in reversed(content):
                if "text" in part:
                    final = part["text"]
                    part["text"] = part["text"] + CONTINUE_TAG
                    return chat, final
            raise NotExact("invalid_request", "no text to continue in the final message")
        last["content"] = content + CONTINUE_TAG
        return chat, content

    @staticmethod
    def _cut_at_tag(text: str, final: str) -> str:
        tag = CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise NotExact("template_error", "the final message is not in the rendered chat")
        loc = text.rindex(tag)
        if text[loc:loc + len(CONTINUE_TAG)] == CONTINUE_TAG:
            return text[:loc]
        return text[:loc].rstrip()
