"""Prompts for the server, tokenized off the event loop and length-checked as early as possible.

The server tokenizes in a worker thread (``Tokenizer.encode`` releases the GIL while it works, so
the event loop keeps answering). Before that, a text that cannot fit ``max_model_len`` is refused
from its bytes alone where the tokenizer allows it: a byte-level BPE (no normalizer, no truncation,
no added token that swallows the spaces beside it, pre-tokenizers that keep every byte: GGUF,
SmolLM2, Llama-3 tokenizers) spells each byte of a text in exactly one token, or in none where its
vocabulary lacks the byte, so ``b`` spellable bytes take at least ``b / max_bytes`` tokens,
``max_bytes`` being its longest token's.
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

# Pre-tokenizer steps that keep every byte of the text (a Split unless its behavior is Removed).
_KEEPING = {"ByteLevel", "Digits", "Split"}


class ByteBound(NamedTuple):
    """What bounds a byte-level BPE's token count from below (module docstring)."""

    max_bytes: int            # the most text bytes one token spells
    unspelled: bytes          # the bytes no token spells (the tokenizer drops them)

    def min_tokens(self, text: str) -> int:
        spelled = text.encode("utf-8").translate(None, self.unspelled)
        return math.ceil(len(spelled) / self.max_bytes)


def byte_bound(tokenizer) -> ByteBound | None:
    """The ``ByteBound`` of a tokenizer that spells each byte of a text in one token or none;
    None for any other (no bound).

    Args:
      tokenizer: a ``jaxkv.model.tokenizer.Tokenizer``.
    """
    spec = json.loads(tokenizer.backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    exact = not (spec.get("normalizer") or spec.get("truncation") or any(
        t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", [])))
    keeps = all(s.get("type") in _KEEPING and s.get("behavior") != "Removed" for s in steps)
    if not (exact and keeps and spec["model"].get("type") == "BPE"
            and any(s.get("type") == "ByteLevel" for s in steps)):
        return None
    spellings = [tokenizer.token_bytes(i)
                 for i in tokenizer.backend.get_vocab(with_added_tokens=True).values()]
    spelled = {t[0] for t in spellings if len(t) == 1}
    return ByteBound(max(map(len, spellings)), bytes(b for b in range(256) if b not in spelled))


class PromptTokenizer:
    """The server's prompt tokenization: call its methods in a worker thread.

    Args:
      tokenizer: the engine's ``jaxkv.model.tokenizer.Tokenizer``.
      max_model_len: the engine's longest prompt + completion.
    """

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.bound = byte_bound(tokenizer)

    def check_length(self, num_tokens: int, size: str | None = None) -> None:
        """Refuses a prompt of (at least) ``num_tokens`` that leaves no room to generate.

        Args:
          num_tokens: the prompt's tokens, or a lower bound of them.
          size: how the prompt was measured (default: ``"{num_tokens} tokens"``).

        Raises:
          ValueError: naming max_model_len.
        """
        if num_tokens >= self.max_model_len:
            raise ValueError(f"the prompt's {size or f'{num_tokens} tokens'} leave no room to "
                             f"generate within max_model_len={self.max_model_len}")

    def prompt(self, text: str, add_special_tokens: bool = True) -> dict:
        """The engine's ``{"prompt": text, "prompt_token_ids": ids}`` of a text, refused by its
        byte count where possible, else once tokenized.

        Raises:
          ValueError: the prompt leaves no room to generate within max_model_len.
        """
        if self.bound is not None:
            at_least = self.bound.min_tokens(text)
            self.check_length(at_least, f"{len(text)} characters (at least {at_least} tokens)")
        ids = self.tokenizer.encode(text, add_special_tokens)
        self.check_length(len(ids))
        return {"prompt": text, "prompt_token_ids": ids}

    def chat(self, messages: list[dict], add_generation_prompt: bool = True,
             **variables) -> dict:
        """``prompt`` of a conversation rendered with the chat template (which writes the
        special tokens itself); ``variables``: the template's others (``tools``).

        Raises:
          ValueError: a template error, or a prompt too long for max_model_len.
        """
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, **variables)
        return self.prompt(text, add_special_tokens=False)
