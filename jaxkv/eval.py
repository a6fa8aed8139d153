"""Perplexity of a model on a text with a chosen KV cache dtype, read through the engine path.

Every token goes through the same code as generation: the model forward writes its K/V into a
paged cache (quantized on write / on seal) and attends over the paged cache with
``paged_attention``; nothing uses a separate full-precision forward. The text is cut into windows
of ``context`` tokens that advance by ``stride`` (HF's strided perplexity); each window is fed in
chunks of ``chunk`` tokens (chunked prefill), so later chunks attend to earlier chunks through the
(quantized) cache, and only the last ``stride`` tokens of a window are scored (all of the first):

    tokens   |--------- window 0 ---------|
                          |--------- window 1 ---------|        stride = context / 2
    scored   |xxxxxxxxxxxxxxxxxxxxxxxxxxxx|xxxxxxxxxxxxxx|

With ``chunk`` a multiple of the block size every block seals in the step that writes it, so an
int4/int2 cache is read fully quantized, even by the tokens of the block itself: stricter than
KIVI (whose prefill attends to exact K/V). The KIVI residual window (the unsealed block kept in
full precision) therefore shows in decoding (greedy agreement), not in this perplexity.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import init_cache
from jaxkv.metadata import AttentionMetadata
from jaxkv.model.llama import forward


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """Attributes: perplexity, mean nll (nats), tokens scored, windows, seconds, and the setup."""

    perplexity: float
    nll: float
    num_scored: int
    num_windows: int
    seconds: float
    kv_cache_dtype: str
    context: int
    stride: int
    chunk: int


def _make_chunk_fn(config, attention_impl: str):
    @partial(jax.jit, donate_argnums=1)
    def run(params, cache, token_ids, targets, positions, slots, block_table, seq_len):
        t = token_ids.shape[0]
        md = AttentionMetadata(slot_mapping=slots,
                               query_start_loc=jnp.asarray([0, t], jnp.int32),
                               seq_lens=seq_len[None], block_tables=block_table[None])
        logits, cache = forward(params, token_ids, positions, cache, md, config=config,
                                attention_impl=attention_impl)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]     # [T]
        return cache, nll

    return run


def perplexity(llm, token_ids, *, kv_cache_dtype: str, context: int = 2048,
               stride: int | None = None, chunk: int = 256, max_windows: int | None = None,
               **cache_options) -> PerplexityResult:
    """Perplexity of ``llm``'s model on ``token_ids`` with a KV cache of ``kv_cache_dtype``.

    Args:
      llm: a ``jaxkv.LLM`` (its params, config, block size and attention impl are used).
      token_ids: the text's token ids.
      kv_cache_dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or a quantized format (jaxkv.cache).
      context: tokens per window (the attention context of the last scored token).
      stride: window advance (default ``context``: disjoint windows); each window scores its
        last ``stride`` tokens (the first window all of its tokens but the first).
      chunk: tokens per forward call (chunked prefill through the paged cache).
      max_windows: stop after this many windows.
      **cache_options: passed to ``jaxkv.cache.init_cache`` (``key_axis``, ``value_axis``,
        ``group_size``, ``residual_full_precision``, ``static_scale``: the ablations;
        ``residual_blocks``: KIVI's residual window).

    Returns:
      PerplexityResult.

    Raises:
      ValueError: naming the bad argument.
    """
    stride = stride or context
    if not 0 < stride <= context:
        raise ValueError(f"stride={stride} must be in (0, context={context}]")
    if context % chunk:
        raise ValueError(f"chunk={chunk} must divide context={context}")
    ids = np.asarray(token_ids, np.int32)
    if len(ids) < context + 1:
        raise ValueError(f"the text has {len(ids)} tokens; context={context} needs more than that")
    c, bs = llm.model_config, llm.cache_config.block_size
    nb = -(-context // bs)
    cache = init_cache(c.num_layers, nb + 1, bs, c.num_kv_heads, c.head_dim, llm.dtype,
                       kv_cache_dtype=kv_cache_dtype,
                       num_residual_slots=cache_options.get("residual_blocks", 1), **cache_options)
    run = _make_chunk_fn(c, llm.attention_impl)
    table = jnp.arange(1, nb + 1, dtype=jnp.int32)
    total, count, windows = 0.0, 0, 0
    t0 = time.perf_counter()
    starts = range(0, len(ids) - context, stride)
    for w, start in enumerate(starts):
        if max_windows is not None and w >= max_windows:
            break
        first_scored = 0 if w == 0 else context - stride
        for a in range(0, context, chunk):
            pos = np.arange(a, a + chunk, dtype=np.int32)
            cache, nll = run(llm.params, cache, jnp.asarray(ids[start + pos]),
                             jnp.asarray(ids[start + pos + 1]), jnp.asarray(pos),
                             jnp.asarray(table[pos // bs] * bs + pos % bs), table,
                             jnp.int32(a + chunk))
            keep = pos >= first_scored
            if keep.any():
                total += float(np.asarray(nll, np.float64)[keep].sum())
                count += int(keep.sum())
        windows += 1
    nll = total / count
    return PerplexityResult(perplexity=math.exp(nll), nll=nll, num_scored=count,
                            num_windows=windows, seconds=time.perf_counter() - t0,
                            kv_cache_dtype=kv_cache_dtype, context=context, stride=stride,
                            chunk=chunk)
