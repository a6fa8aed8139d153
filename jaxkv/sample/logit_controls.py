"""Logit controls: ``logit_bias``, ``allowed_token_ids`` and ``bad_words`` as a per-row bias and
a packed token bitmask (host arrays built each step; applied to the raw logits on the device).

The bitmask is xgrammar's layout, int32 ``[S, ceil(V / 32)]`` with token ``t`` allowed by bit
``t & 31`` of word ``t >> 5``; a step where no row has a control sends both arrays at width 0,
which traces them away. Design notes: docs/runtime.md."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def host_arrays(params: Sequence, output_token_ids: Sequence[Sequence[int]], vocab_size: int,
                size: int, grammar_bitmasks: Sequence[np.ndarray | None] | None = None
                ) -> dict[str, np.ndarray]:
    """``bias_ids`` int32 / ``bias_values`` f32 ``[size, B]`` (-1 / 0 padded; B a power of two
    >= 4, 0 when no row has a bias) and ``token_bitmask`` ``[size, ceil(V / 32)]`` (0 wide when
    no row restricts): a row allows its ``allowed_token_ids`` (else every token) less the bad
    words' tokens its ``output_token_ids`` would complete, and within its grammar's bitmask
    (``grammar_bitmasks``: per row one, or None).

    Args:
      params: one ``SamplingParams`` per real row; rows past them are unconstrained padding.

    Raises:
      ValueError: an id of ``logit_bias``, ``allowed_token_ids`` or ``bad_words_token_ids``
        >= ``vocab_size``.
    """
    for p in params:
        ids = [i for i, _ in p.logit_bias or ()] + list(p.allowed_token_ids or ())
        ids += [i for q in p.bad_words_token_ids for i in q]
        if any(i >= vocab_size for i in ids):
            raise ValueError(f"logit_bias / allowed_token_ids / bad_words_token_ids: id "
                             f"{max(ids)} is outside [0, vocab_size={vocab_size})")
    most = max((len(p.logit_bias or ()) for p in params), default=0)
    width = 1 << max(2, (most - 1).bit_length()) if most else 0
    bias_ids = np.full((size, width), -1, np.int32)
    bias_values = np.zeros((size, width), np.float32)
    grammar = grammar_bitmasks or [None] * len(params)
    restricted = any(p.allowed_token_ids or p.bad_words_token_ids for p in params) or any(
        g is not None for g in grammar)
    bitmask = np.full((size, -(-vocab_size // 32) if restricted else 0), -1, np.int32)
    for r, p in enumerate(params):
        for k, (i, b) in enumerate(p.logit_bias or ()):
            bias_ids[r, k], bias_values[r, k] = i, b
        if p.allowed_token_ids:
            bitmask[r] = pack_bitmask(p.allowed_token_ids, vocab_size)
        if grammar[r] is not None:
            bitmask[r] &= grammar[r]
        for t in banned_tokens(p.bad_words_token_ids, output_token_ids[r]):
            bitmask.view(np.uint32)[r, t >> 5] &= ~np.uint32(1 << (t & 31))
    return dict(bias_ids=bias_ids, bias_values=bias_values, token_bitmask=bitmask)


def pack_bitmask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """int32 [ceil(V / 32)]: bit ``t & 31`` of word ``t >> 5`` set for each of ``token_ids``."""
    bits = np.zeros(-(-vocab_size // 32) * 32, np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view("<i4")[:, 0]


def banned_tokens(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> set[int]:
    """The last id of each of ``sequences`` whose other ids end ``output`` (vLLM's bad-words
    rule; a one-token sequence is always banned)."""
    out = set()
    for q in sequences:
        k = len(q) - 1
        if k <= len(output) and tuple(output[len(output) - k:]) == tuple(q[:-1]):
            out.add(q[-1])
    return out


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word (leading spaces stripped) alone, and
    after a space where that spells it with other tokens of the same count (a word at the start
    of the text and one in the middle of it)."""
    out = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(tuple(alone))
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(tuple(spaced))
    return tuple(out)


def present(bias_ids: jax.Array, token_bitmask: jax.Array) -> bool:
    """Whether a step's arrays carry a bias or a bitmask (static: their widths)."""
    return bool(bias_ids.shape[1] or token_bitmask.shape[1])


def apply(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array,
          token_bitmask: jax.Array) -> jax.Array:
    """f32 [S, V] ``logits`` plus each row's bias, tokens outside its bitmask at ``-inf``
    (each a no-op, traced away, when its arrays have width 0)."""
    s, v = logits.shape
    if bias_ids.shape[1]:
        cols = jnp.where(bias_ids >= 0, bias_ids, v)                 # padding: a spare column
        bias = jnp.zeros((s, v + 1), jnp.float32).at[jnp.arange(s)[:, None], cols].add(
            bias_values)
        logits = logits + bias[:, :v]
    if token_bitmask.shape[1]:
        idx = jnp.arange(v)
        allowed = (token_bitmask[:, idx >> 5] >> (idx & 31)) & 1     # [S, V]
        logits = jnp.where(allowed.astype(bool), logits, -jnp.inf)
    return logits
