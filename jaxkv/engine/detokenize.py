"""Incremental detokenization: a growing token list to text, decoding O(1) tokens per step.

vLLM's ``detokenize_incrementally``: each step decodes only a window of the tail tokens,
``ids[prefix_offset:]``, and subtracts the text of ``ids[prefix_offset:read_offset]`` (tokens whose
text was already emitted, kept as left context so decoders that strip a leading space or merge
across tokens see the same neighbours as a full decode). New text is committed only when it does
not end in U+FFFD, i.e. when the window's last token does not end inside a multi-byte UTF-8
character; until then the window grows (by at most the three tokens a character can span, for
valid UTF-8). ``text + pending`` always equals ``tokenizer.decode(ids)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one sequence's output tokens, updated as tokens are appended.

    Args:
      tokenizer: the model's tokenizer.
      skip_special_tokens: drop special tokens, as ``Tokenizer.decode`` does.

    Attributes:
      text: committed text: a prefix of ``tokenizer.decode(ids)`` for every later ``ids``; it
        only ever grows.
      pending: text of the tokens after the committed ones (may end in U+FFFD while a UTF-8
        character is incomplete); ``text + pending == tokenizer.decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._prefix_offset = 0   # first token of the decode window (left context)
        self._read_offset = 0     # first token whose text is not committed
        self._prefix_text = ""    # decode(ids[prefix_offset:read_offset])
        self.text = ""
        self.pending = ""

    def _decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` alone."""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def update(self, token_ids: Sequence[int]) -> str:
        """Takes the sequence's token list after appending new tokens; returns the newly committed text.

        Args:
          token_ids: every token so far (the list the previous calls saw, extended); only the
            tokens from ``prefix_offset`` on are read.

        Returns:
          The text appended to ``text`` ("" while the tail is an incomplete character).
        """
        new_text = self._decode(token_ids[self._prefix_offset:])
        if len(new_text) > len(self._prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(self._prefix_text):]
            self._prefix_text = self._decode(token_ids[self._read_offset:])
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
            self.text += delta
            self.pending = ""
            return delta
        self.pending = new_text[len(self._prefix_text):]
        return ""
