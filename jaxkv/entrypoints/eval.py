"""Perplexity of a model on a text with a chosen KV cache dtype, read through the engine path.

Design notes: docs/runtime.md."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pages import init_cache
from jaxkv.kvcache.spec import KVCacheSpec
from jaxkv.model.llama import forward

logger = logging.getLogger("jaxkv")


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


def _sequence_cache(runner, num_blocks: int, kv_cache_dtype: str, cache_options: dict):
    """A cache for one sequence of ``num_blocks`` blocks (+ the null block) in the model's
    geometry; KIVI pools get one residual window's worth of slots (the ``KVCacheSpec`` default)."""
    c = runner.model_config
    return init_cache(KVCacheSpec(num_layers=c.num_layers, num_blocks=num_blocks + 1,
                                  block_size=runner.cache_config.block_size,
                                  num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                  dtype=jnp.dtype(runner.dtype).name, kv_cache_dtype=kv_cache_dtype,
                                  v_head_dim=c.kv_cache_v_dim, **cache_options))


@lru_cache(maxsize=16)   # one compiled function per (model, impl, options)
def _make_chunk_fn(config, attention_impl: str, attention_options=None):
    @partial(jax.jit, donate_argnums=1)
    def run(params, cache, token_ids, targets, positions, slots, block_table, seq_len):
        t = token_ids.shape[0]
        md = AttentionMetadata(slot_mapping=slots,
                               query_start_loc=jnp.asarray([0, t], jnp.int32),
                               seq_lens=seq_len[None], block_tables=block_table[None])
        logits, cache, *mass = forward(params, token_ids, positions, cache, md, config=config,
                                       attention_impl=attention_impl,
                                       attention_options=attention_options)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]     # [T]
        # a retention policy's scores: [max_blocks] attention mass per block (else None)
        return cache, nll, jnp.argmax(logits, axis=-1), mass[0][0] if mass else None

    return run


def perplexity(runner, token_ids, *, kv_cache_dtype: str, context: int = 2048,
               stride: int | None = None, chunk: int = 256, max_windows: int | None = None,
               progress: bool = False, **cache_options) -> PerplexityResult:
    """Perplexity of ``runner``'s model on ``token_ids`` with a KV cache of ``kv_cache_dtype``.

    Args:
      runner: the engine's ``ModelRunner`` (``LLM(...).engine.runner``): its params,
        model config, block size, dtype and attention impl are used.
      token_ids: the text's token ids.
      kv_cache_dtype: a ``jaxkv.kvcache.spec.KV_FORMATS`` name or alias.
      context: tokens per window (the attention context of the last scored token).
      stride: window advance (default ``context``: disjoint windows); each window scores its
        last ``stride`` tokens (the first window all of its tokens but the first).
      chunk: tokens per forward call (chunked prefill through the paged cache).
      max_windows: stop after this many windows.
      progress: show a tqdm bar of the windows done (on stderr).
      **cache_options: ``jaxkv.kvcache.spec.KVCacheSpec`` fields (``key_axis``, ``value_axis``,
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
    c, bs = runner.model_config, runner.cache_config.block_size
    nb = -(-context // bs)
    cache = _sequence_cache(runner, nb, kv_cache_dtype, cache_options)
    run = _make_chunk_fn(c, runner.attention_impl)
    table = jnp.arange(1, nb + 1, dtype=jnp.int32)
    total, count = 0.0, 0
    t0 = time.perf_counter()
    starts = range(0, len(ids) - context, stride)[:max_windows]
    logger.info("perplexity: %d windows of %d tokens in chunks of %d (the first compiles the "
                "forward)", len(starts), context, chunk)
    for w, start in enumerate(tqdm(starts, desc="Perplexity", unit="window",
                                   disable=not progress)):
        first_scored = 0 if w == 0 else context - stride
        for a in range(0, context, chunk):
            pos = np.arange(a, a + chunk, dtype=np.int32)
            cache, nll, _, _ = run(runner.params, cache, jnp.asarray(ids[start + pos]),
                                   jnp.asarray(ids[start + pos + 1]), jnp.asarray(pos),
                                   jnp.asarray(table[pos // bs] * bs + pos % bs), table,
                                   jnp.int32(a + chunk))
            keep = pos >= first_scored
            if keep.any():
                total += float(np.asarray(nll, np.float64)[keep].sum())
                count += int(keep.sum())
    nll = total / count
    return PerplexityResult(perplexity=math.exp(nll), nll=nll, num_scored=count,
                            num_windows=len(starts), seconds=time.perf_counter() - t0,
                            kv_cache_dtype=kv_cache_dtype, context=context, stride=stride,
                            chunk=chunk)


@dataclasses.dataclass(frozen=True)
class RetainedNLL:
    """Per-token negative log-likelihoods of one long text under a KV retention policy.

    Attributes:
      nll: f64 [N - 1]: ``nll[i]`` = -log p(token i + 1 | the KV the policy kept at token i).
      argmax: int32 [N - 1]: the most likely token after token i under the same KV.
      peak_blocks: most pool blocks the sequence held at once (the null block not counted).
      pool_blocks: blocks the pool was allocated with (the policy's bound; null block excluded).
      seconds: wall time.
    """

    nll: np.ndarray
    argmax: np.ndarray
    peak_blocks: int
    pool_blocks: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))


def retained_nll(runner, token_ids, *, retention, kv_cache_dtype: str, chunk: int = 256,
                 prompt_tokens: int = 0, **cache_options) -> RetainedNLL:
    """Teacher-forced NLL of every token of one long text fed in ``chunk``-token steps through a
    pool that holds only what ``retention`` keeps, managed as the scheduler manages it: before
    each chunk the blocks the policy drops go back (``BlockManager.release_blocks``), so the
    pool is the policy's bound (``Retention.max_blocks``), not the text's length, and the text
    may run past the model's context. StreamingLLM's perplexity protocol: chunked prefill
    equals token-by-token decoding here because every query sees its own sinks + window. A
    policy that scores blocks (H2O, ``Retention.observe``) gets the attention mass of each
    chunk's last ``observe`` tokens, accumulated as ``scheduler.update`` does; with ``chunk``
    at most ``observe`` that is every query, as in the paper. Without ``prompt_tokens`` there is
    no prompt phase: a policy drops from the first chunk on. With it, the first
    ``prompt_tokens`` tokens are one forward with nothing dropped and its last ``observe``
    queries scored (the engine's unchunked prompt; SnapKV's observation window), and drops
    start after it.

    Args:
      runner: the engine's ``ModelRunner`` (params, config, block size, attention impl).
      token_ids: int [N] the text.
      retention: a ``jaxkv.retention`` policy (``FullRetention()``: the dense cache).
      kv_cache_dtype: the KV format.
      chunk: tokens per forward (after the prompt).
      prompt_tokens: the prompt phase's length (0: none); passed to ``Retention.drops``.
      **cache_options: ``KVCacheSpec`` fields, as for ``perplexity``.

    Returns:
      RetainedNLL.
    """
    from jaxkv.blocks.block_manager import BlockManager   # the scheduler's block bookkeeping

    ids = np.asarray(token_ids, np.int32)
    n = len(ids) - 1
    if n < 1:
        raise ValueError(f"token_ids has {len(ids)} tokens; at least 2 are needed")
    c, bs = runner.model_config, runner.cache_config.block_size
    if not 0 <= prompt_tokens < n:
        raise ValueError(f"prompt_tokens={prompt_tokens} must be in [0, {n})")
    held = retention.max_blocks(n, max(chunk, prompt_tokens), bs, prompt_tokens)
    bm = BlockManager(held + 1, bs)
    cache = _sequence_cache(runner, held, kv_cache_dtype, cache_options)
    run = _make_chunk_fn(c, runner.attention_impl, retention.attention)
    width = -(-n // bs)
    nll, argmax, peak = np.empty(n), np.empty(n, np.int32), 0
    scores = np.zeros(width)
    t0 = time.perf_counter()
    starts = ([0] if prompt_tokens else []) + list(range(prompt_tokens, n, chunk))
    for i, a in enumerate(starts):
        b = starts[i + 1] if i + 1 < len(starts) else n
        if a == 0:
            bm.allocate("text", b)
        else:
            bm.release_blocks("text", retention.drops(a, bm.block_table("text"), scores, bs,
                                                      prompt_tokens=prompt_tokens or None))
            bm.append_slots("text", b)
        peak = max(peak, held - bm.num_free_blocks)
        table = np.zeros(width, np.int32)
        kept = bm.block_table("text")
        table[:len(kept)] = kept
        pos = np.arange(a, b, dtype=np.int32)
        cache, out, top, mass = run(runner.params, cache, jnp.asarray(ids[pos]),
                                    jnp.asarray(ids[pos + 1]), jnp.asarray(pos),
                                    jnp.asarray(table[pos // bs] * bs + pos % bs),
                                    jnp.asarray(table), jnp.int32(b))
        nll[a:b] = np.asarray(out, np.float64)
        argmax[a:b] = np.asarray(top)
        if retention.observe:
            scores += np.asarray(mass, np.float64)
    return RetainedNLL(nll=nll, argmax=argmax, peak_blocks=peak, pool_blocks=held,
                       seconds=time.perf_counter() - t0)


@dataclasses.dataclass(frozen=True)
class AgreementResult:
    """Teacher-forced top-1 agreement with a reference continuation.

    Attributes:
      agreement: fraction of continuation positions whose argmax equals the reference token.
      first_difference: first position whose argmax differs (``len`` if none).
      argmax: the cache's argmax token at each continuation position.
      kv_cache_dtype: the cache's dtype.
    """

    agreement: float
    first_difference: int
    argmax: tuple[int, ...]
    kv_cache_dtype: str


def token_agreement(runner, prompt_ids, reference_ids, *, kv_cache_dtype: str,
                    prefill_chunk: int = 256, **cache_options) -> AgreementResult:
    """Greedy agreement along a fixed path: decode ``reference_ids`` after ``prompt_ids`` one
    token per step (as generation does) and compare each step's argmax with the next reference
    token. Unlike free-running greedy agreement, one near-tie flip does not change every later
    position's context, so the number measures the cache rather than the text's near-ties.

    Args:
      runner: the engine's ``ModelRunner`` (params, config, block size, attention impl).
      prompt_ids: int token ids, prefilled in chunks of ``prefill_chunk``.
      reference_ids: int [N] the reference continuation (e.g. the fp32 cache's greedy tokens).
      kv_cache_dtype: the cache to evaluate.
      prefill_chunk: tokens per prefill forward.
      **cache_options: as for ``perplexity``.

    Returns:
      AgreementResult over the N continuation positions.
    """
    prompt = np.asarray(prompt_ids, np.int32)
    ref = np.asarray(reference_ids, np.int32)
    if len(prompt) < 1 or len(ref) < 1:
        raise ValueError(f"prompt_ids ({len(prompt)}) and reference_ids ({len(ref)}) must be "
                         f"non-empty")
    ids = np.concatenate([prompt, ref])
    c, bs = runner.model_config, runner.cache_config.block_size
    nb = -(-len(ids) // bs)
    cache = _sequence_cache(runner, nb, kv_cache_dtype, cache_options)
    run = _make_chunk_fn(c, runner.attention_impl)
    table = jnp.arange(1, nb + 1, dtype=jnp.int32)
    steps = [(a, min(a + prefill_chunk, len(prompt))) for a in range(0, len(prompt), prefill_chunk)]
    steps += [(p, p + 1) for p in range(len(prompt), len(ids) - 1)]
    argmax = []
    for a, b in steps:
        pos = np.arange(a, b, dtype=np.int32)
        cache, _, top, _ = run(runner.params, cache, jnp.asarray(ids[pos]),
                               jnp.asarray(ids[np.minimum(pos + 1, len(ids) - 1)]),
                               jnp.asarray(pos), jnp.asarray(table[pos // bs] * bs + pos % bs),
                               table, jnp.int32(b))
        if b >= len(prompt):
            argmax.append(int(np.asarray(top)[-1]))
    same = np.asarray(argmax) == ref
    return AgreementResult(agreement=float(same.mean()),
                           first_difference=int(np.argmin(same)) if not same.all() else len(ref),
                           argmax=tuple(argmax), kv_cache_dtype=kv_cache_dtype)
