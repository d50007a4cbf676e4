"""A chat request as the engine's prefill sees it: the model's chat template rendered the way
vLLM 0.32 renders it (through transformers' Jinja environment), over the messages as vLLM
normalises them. Pure: the template's text and the special tokens come from whoever loaded the
model's files (:mod:`cachepilot.datalayer.model_files`).

- :mod:`.template`: the Jinja environment, the variables, ``continue_final_message``.
- :mod:`.detect`: which content format (``string`` or ``openai``) vLLM picks for a template.
- :mod:`.messages`: OpenAI messages → the conversation vLLM hands the template.

Anything this cannot reproduce exactly raises :class:`NotExact` with a short reason: the
caller then routes that request on the approximate directory and counts why.
"""

from cachepilot.core.chat.template import ChatTemplate, NotExact

__all__ = ["ChatTemplate", "NotExact"]
