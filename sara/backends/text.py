"""Text handling shared by the HF and vLLM backends: chat rendering, prompt encoding, stop strings, EOS ids.

Both backends tokenize prompts the same way (here), so a prompt gives identical ``prompt_token_ids`` whichever backend
generates it. Nothing heavy is imported at module level.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["encode_prompt", "render_chat", "find_stop", "eos_ids"]


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """Chat messages -> prompt text with the tokenizer's chat template and the generation prompt appended."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: send rendered text prompts instead of chat messages")
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of a prompt: chat messages go through the chat template; text is taken as rendered.

    Special tokens (a BOS) are added to text only when the text does not already start with the BOS token (chat
    templates write their own).
    """
    text = prompt if isinstance(prompt, str) else render_chat(tokenizer, prompt)
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add_special)["input_ids"])


def find_stop(text: str, stops: Sequence[str]) -> int:
    """End index (exclusive) of the earliest stop string in ``text`` (the stop string included), or -1."""
    best = -1
    for s in stops:
        if not s:
            continue
        at = text.find(s)
        if at >= 0 and (best < 0 or at + len(s) < best):
            best = at + len(s)
    return best


def eos_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """End-of-sequence token ids: the tokenizer's EOS plus the model's generation-config EOS ids."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(e) for e in eos)
    return ids

