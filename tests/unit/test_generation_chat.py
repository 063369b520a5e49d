"""``quiesce.generation``'s helpers shared by the engine adapters: the served model
names and the chat prompt (against stand-in tokenizers; the engine tiers use real ones)."""

from __future__ import annotations

from typing import Any

import pytest

from quiesce.errors import RequestRejected
from quiesce.generation import chat_prompt, model_names

MESSAGES = [{"role": "user", "content": "hi"}]


class Tokenizer:
    def __init__(self, template: str | None, fails: bool = False) -> None:
        self.chat_template = template
        self.fails = fails
        self.seen: list[Any] = []

    def apply_chat_template(self, messages: list[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool) -> str:
        if self.fails:
            raise ValueError("no 'system' role here")
        self.seen.append((messages, tokenize, add_generation_prompt))
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_the_chat_template_renders_with_the_generation_prompt() -> None:
    tokenizer = Tokenizer("{{ messages }}")
    assert chat_prompt(tokenizer, MESSAGES) == "<user>hi<assistant>"
    assert tokenizer.seen == [(MESSAGES, False, True)]


@pytest.mark.parametrize("tokenizer", [None, Tokenizer(None), Tokenizer("")])
def test_no_tokenizer_or_no_template_is_rejected(tokenizer: Any) -> None:
    with pytest.raises(RequestRejected, match="no chat template"):
        chat_prompt(tokenizer, MESSAGES)


def test_a_failing_template_is_rejected_with_its_reason() -> None:
    with pytest.raises(RequestRejected, match="no 'system' role here"):
        chat_prompt(Tokenizer("t", fails=True), MESSAGES)


def test_model_names_default_to_the_directory_name() -> None:
    assert model_names("/models/llama-3-8b", None) == ("llama-3-8b", "/models/llama-3-8b")
    assert model_names("/models/llama-3-8b/", "llm") == ("llm", "/models/llama-3-8b/")
    assert model_names("/", None) == ("/", "/")  # no last component: the path itself
