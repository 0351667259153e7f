"""Chat messages -> the one prompt text the engine sees, before tokenizing and hashing.

The router hashes the tokens of the *templated* prompt, so two conversations that share a system
prompt share leading blocks and the second is a cache hit.

    checkpoint with `chat_template` in tokenizer_config.json   its Jinja template, rendered in a
                                                               sandbox with add_generation_prompt
    random presets (byte tokenizer), or a checkpoint without   the simple template below

The simple template (documented in the README) puts each message on role-tagged lines and ends
with the assistant's tag, so the model continues as the assistant:

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

A Jinja template writes its own special tokens (BOS), so its text is tokenized without the
tokenizer adding them again; the simple template's text is tokenized like any prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    """One of ROLES."""
    content: str
    """The message's text (text parts joined)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown message role {self.role!r}; use one of {list(ROLES)}")


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str
    """The templated conversation, ending where the assistant's reply starts."""
    add_special_tokens: bool
    """Whether the tokenizer should add its own special tokens (BOS) to `text`."""


class ChatTemplate(Protocol):
    @property
    def name(self) -> str: ...

    def render(self, messages: Sequence[ChatMessage]) -> ChatPrompt: ...


class SimpleChatTemplate:
    """Role-tagged lines; see the module docstring. Deterministic and prefix-stable: appending a
    message never changes the text of the messages before it."""

    name = "simple"

    def render(self, messages: Sequence[ChatMessage]) -> ChatPrompt:
        if not messages:
            raise ValueError("messages must hold at least one message")
        parts = [f"<|{m.role}|>\n{m.content}\n" for m in messages]
        parts.append("<|assistant|>\n")
        return ChatPrompt("".join(parts), add_special_tokens=True)


class JinjaChatTemplate:
    """A checkpoint's own chat template, rendered in Jinja's immutable sandbox (a template is
    data from a model folder: it must not reach Python objects or mutate its inputs)."""

    name = "checkpoint"

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
        self._template: Any = env.from_string(source)
        self._special_tokens = dict(special_tokens or {})
        self._error = TemplateError

    def render(self, messages: Sequence[ChatMessage]) -> ChatPrompt:
        if not messages:
            raise ValueError("messages must hold at least one message")
        try:
            text = self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                **self._special_tokens,
            )
        except self._error as exc:  # the template refused the conversation (e.g. role order)
            raise ValueError(f"the model's chat template rejected the messages: {exc}") from None
        return ChatPrompt(str(text), add_special_tokens=False)


def load_chat_template(model: str) -> ChatTemplate:
    """The checkpoint's template if `model` is a folder whose tokenizer_config.json has one,
    else the simple template (random presets)."""
    path = os.path.join(model, "tokenizer_config.json")
    if not os.path.isfile(path):
        return SimpleChatTemplate()
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return SimpleChatTemplate()
    return JinjaChatTemplate(source, _special_tokens(config))


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """bos_token / eos_token as text (tokenizer configs store a string or an AddedToken dict)."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out
