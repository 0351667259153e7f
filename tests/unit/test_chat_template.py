"""Chat templates: the documented simple one, and a checkpoint's Jinja template in a sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.coordinator.service.chat_template import (
    ChatMessage,
    JinjaChatTemplate,
    SimpleChatTemplate,
    load_chat_template,
)

SYSTEM = ChatMessage("system", "You are terse.")


def test_simple_template_tags_roles_and_ends_with_the_assistant_tag() -> None:
    prompt = SimpleChatTemplate().render([SYSTEM, ChatMessage("user", "Hi!")])
    assert prompt.text == "<|system|>\nYou are terse.\n<|user|>\nHi!\n<|assistant|>\n"
    assert prompt.add_special_tokens


def test_a_shared_system_prompt_gives_a_shared_text_prefix() -> None:
    t = SimpleChatTemplate()
    a = t.render([SYSTEM, ChatMessage("user", "first question")]).text
    b = t.render([SYSTEM, ChatMessage("user", "another one")]).text
    shared = t.render([SYSTEM]).text.removesuffix("<|assistant|>\n")
    assert a.startswith(shared) and b.startswith(shared)


def test_appending_a_turn_keeps_the_earlier_turns_text() -> None:
    t = SimpleChatTemplate()
    turn1 = [SYSTEM, ChatMessage("user", "q1")]
    reply = ChatMessage("assistant", "a1")
    first = t.render(turn1).text
    second = t.render([*turn1, reply, ChatMessage("user", "q2")]).text
    assert second.startswith(first + "a1\n")


def test_unknown_role_and_empty_conversation_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown message role"):
        ChatMessage("wizard", "x")
    with pytest.raises(ValueError, match="at least one"):
        SimpleChatTemplate().render([])


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_checkpoint_template_renders_with_its_special_tokens_and_no_added_bos() -> None:
    t = JinjaChatTemplate(TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    prompt = t.render([SYSTEM, ChatMessage("user", "Hi")])
    assert prompt.text == "<s>[system]You are terse.</s>[user]Hi</s>[assistant]"
    assert not prompt.add_special_tokens


def test_a_template_that_raises_becomes_a_value_error() -> None:
    t = JinjaChatTemplate(TEMPLATE, {"bos_token": "", "eos_token": ""})
    with pytest.raises(ValueError, match="no tools"):
        t.render([ChatMessage("tool", "result")])


def test_the_sandbox_keeps_templates_away_from_python_internals() -> None:
    t = JinjaChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        t.render([SYSTEM])


def test_load_picks_the_checkpoints_template_or_falls_back_to_simple(tmp_path: Path) -> None:
    assert load_chat_template("tiny-random").name == "simple"
    config = {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = load_chat_template(str(tmp_path))
    assert t.name == "checkpoint"
    assert t.render([ChatMessage("user", "x")]).text == "<s>[user]x</s>[assistant]"
