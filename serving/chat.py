"""Chat conversations to prompt token ids through the tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def chat_prompt_ids(tokenizer: Any, conversation: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of `conversation` (and the `tools` it may call, for templates that show them) rendered by
    the tokenizer's chat template. Raises ValueError for an empty conversation, a malformed message, or a
    tokenizer without a template."""
    if not conversation:
        raise ValueError("messages must not be empty")
    for m in conversation:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt, tokenize=True,
                                        tools=tools or None)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
