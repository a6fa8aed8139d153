"""The grouped attention (jaxkv.attention.grouped) against the reference
(jaxkv.attention.reference): random ragged batches (decode rows, prefill chunks with and without a
cached prefix, padding tokens and sequences, permuted block ids) under every mask option and GQA
ratio, every quantized pool format (KIVI with its residual window, and a stale residual slot), bf16,
and one compilation per shape; tables with scattered dropped blocks (H2O, SnapKV) under float and
quantized pools, and the kv chunks visited bounded by the kept blocks."""

import dataclasses
import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import grouped
from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.grouped import native_tiles, paged_attention_grouped
from jaxkv.attention.kv_chunks import kept_blocks
from jaxkv.attention.reference import paged_attention_reference, softmax_init, softmax_result
from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pools import HNDPages, read_sequence_blocks
from jaxkv.kvcache.spec import KVCacheSpec
from bench.lib.ragged_batches import table_batch

F32 = dict(atol=2e-5, rtol=2e-5)
OPTIONS = {
    "plain": {},
    "window": dict(sliding_window=5),
    "window-sinks-cap": dict(sliding_window=7, num_sinks=2, soft_cap=30.0),
    "long-sinks": dict(sliding_window=20, num_sinks=9, sm_scale=0.2),
}


def ragged_layout(rng, T, S, max_blocks, bs):
    """Random (q_lens, kv_lens) of at most S sequences and T tokens, each a decode row, a
    prefill chunk after a cached prefix or a whole prompt, kv lengths within the table."""
    max_kv = max_blocks * bs
    q_lens, kv_lens = [], []
    for _ in range(int(rng.integers(1, S + 1))):
        kind = rng.integers(3)
        if kind == 0:                                                  # decode row
            q, kv = 1, int(rng.integers(1, max_kv + 1))
        elif kind == 1:                                                # chunk after a prefix
            q = int(rng.integers(2, 31))
            kv = q + int(rng.integers(1, max(2, max_kv - q + 1)))
        else:                                                          # whole prompt
            q = kv = int(rng.integers(2, 41))
        q, kv = min(q, kv, max_kv), min(kv, max_kv)
        if sum(q_lens) + q > T:
            break
        q_lens.append(q)
        kv_lens.append(kv)
    return q_lens, kv_lens


def random_batch(rng, *, Hq, Hkv, D=16, bs=4, T=48, S=6, max_blocks=24, dtype=jnp.float32):
    """A random ragged batch of fixed shapes over a float pool with every block in use."""
    q_lens, kv_lens = ragged_layout(rng, T, S, max_blocks, bs)
    num_blocks = S * max_blocks + 1
    tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=T, S=S, max_blocks=max_blocks,
                                    num_blocks=num_blocks, bs=bs)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return (normal(T, Hq, D), normal(num_blocks, bs, Hkv, D), normal(num_blocks, bs, Hkv, D),
            tables, lens, qsl)


@functools.cache
def _jitted(fn, options):
    return jax.jit(partial(fn, return_lse=True, **dict(options)))


def jitted(fn, **options):
    """``fn`` (returning out and lse) jitted with static ``options``, compiled once per shape."""
    return _jitted(fn, tuple(sorted(options.items())))


def hnd(pool: jax.Array) -> HNDPages:
    """The HND copy of an NHD float pool [N, bs, Hkv, D]."""
    return HNDPages(jnp.asarray(pool.transpose(0, 2, 1, 3)))


def assert_matches_reference(args, tol=F32, **opts):
    """out and lse of the grouped path (jitted, with ``opts``) == the reference's; padding
    tokens give zeros and -inf. Float pools are also read as their HND copies (``hnd``)
    against the same reference over the NHD pools."""
    grouped = {k: v for k, v in opts.items()
               if k in ("block_q", "kv_chunk_blocks", "row_queries")}
    spec = {k: v for k, v in opts.items() if k not in grouped}
    want, want_lse = jitted(paged_attention_reference, **spec)(*args)
    n = int(args[5][-1])
    layouts = [args]
    if isinstance(args[1], jax.Array):
        layouts.append((args[0], hnd(args[1]), hnd(args[2]), *args[3:]))
    for pools in layouts:
        got, lse = jitted(paged_attention_grouped, **opts)(*pools)
        assert got.dtype == args[0].dtype and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **tol)
        np.testing.assert_allclose(np.asarray(lse[:n]), np.asarray(want_lse[:n]), **tol)
        assert np.all(np.asarray(got[n:], np.float32) == 0), "padding tokens must produce zeros"
        assert np.all(np.isneginf(np.asarray(lse[n:])))


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("Hq,Hkv,bs", [(4, 4, 4), (9, 3, 4), (8, 2, 16)])
def test_grouped_matches_reference_on_random_ragged_batches(Hq, Hkv, bs, options):
    """Several kv chunks (3 blocks: not a divisor of the table), tiles of 5 tokens (several per
    chunk, some straddling the next sequence), and the defaults (a tile and a chunk cover a
    sequence)."""
    rng = np.random.default_rng(100 * Hq + 10 * bs + list(OPTIONS).index(options))
    for chunking in (dict(kv_chunk_blocks=3, block_q=5), {}):
        for _ in range(2):
            args = random_batch(rng, Hq=Hq, Hkv=Hkv, bs=bs)
            assert_matches_reference(args, **OPTIONS[options], **chunking)


@pytest.mark.parametrize("options", list(OPTIONS))
def test_rows_of_several_trailing_tokens_match_reference(options, row_queries=3):
    """``row_queries`` > 1 (a speculative step's token and drafts computed as rows): sequences
    with fewer query tokens than R (decode rows), as many, and more (chunks, whose earlier
    tokens stay tiles), under every mask, with and without several kv chunks per row."""
    rng = np.random.default_rng(10 * row_queries + list(OPTIONS).index(options))
    for chunking in (dict(kv_chunk_blocks=3, block_q=5), {}):
        for _ in range(2):
            args = random_batch(rng, Hq=9, Hkv=3, bs=4)
            assert_matches_reference(args, row_queries=row_queries, **OPTIONS[options],
                                     **chunking)


def test_rows_of_several_tokens_with_sink_queries_and_dropped_blocks():
    """StreamingLLM's sink queries and a table with dropped blocks, rows of 3 tokens."""
    rng = np.random.default_rng(12)
    args = random_batch(rng, Hq=4, Hkv=2, bs=4)
    qs = jnp.asarray(rng.standard_normal(args[0].shape), jnp.float32)
    opts = dict(sliding_window=9, num_sinks=3, q_sinks=qs, return_lse=True)
    for want, got in zip(paged_attention_reference(*args, **opts),
                         paged_attention_grouped(*args, row_queries=3, kv_chunk_blocks=2, **opts)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32)
    assert_matches_reference(drop_blocks(rng, random_batch(rng, Hq=9, Hkv=3, bs=4), 0.5),
                             row_queries=4, kv_chunk_blocks=2, block_q=3)


@pytest.mark.parametrize("options", [{}, dict(soft_cap=30.0, sm_scale=0.2),
                                     dict(sliding_window=40), dict(sliding_window=37, num_sinks=5)])
@pytest.mark.parametrize("row_queries", [1, 3])
def test_native_kernels_at_the_engines_shapes(options, row_queries):
    """Blocks of 16 and head dim 64, GQA 3: the shapes the C++ tiles and rows take over HND
    pools (``native_tiles``); prompts of several 32-token tiles, chunks after a prefix, decode
    rows, some blocks dropped, padding, with and without a window (and sinks); against the
    reference over the NHD pools."""
    rng = np.random.default_rng(row_queries + 10 * len(options) + options.get("num_sinks", 0))
    q_lens, kv_lens = [100, 1, 37, 1, 70], [100, 150, 90, 33, 200]
    T, S, mb, bs, D = 224, 6, 14, 16, 64
    tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=T, S=S, max_blocks=mb,
                                    num_blocks=S * mb + 1, bs=bs)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((T, 9, D), (S * mb + 1, bs, 3, D), (S * mb + 1, bs, 3, D)))
    assert native_tiles(hnd(k), hnd(v))
    args = (q, k, v, tables, lens, qsl)
    assert_matches_reference(args, row_queries=row_queries, **options)
    assert_matches_reference(drop_blocks(rng, args, 0.4), row_queries=row_queries, **options)


@pytest.mark.parametrize("row_queries", [1, 3])
def test_native_kernels_with_sink_queries(row_queries):
    """StreamingLLM at the kernels' shapes: a window, sinks scored by the sink queries (tiles and
    rows), dropped blocks outside the window as a rolling cache frees them; the C++ kernels over
    the HND pools against the reference over the NHD pools."""
    rng = np.random.default_rng(40 + row_queries)
    q_lens, kv_lens = [100, 1, 37, 1, 70], [100, 150, 90, 33, 200]
    T, S, mb, bs, D = 224, 6, 14, 16, 64
    tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=T, S=S, max_blocks=mb,
                                    num_blocks=S * mb + 1, bs=bs)
    q, qs, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                   for shape in ((T, 9, D), (T, 9, D), (S * mb + 1, bs, 3, D),
                                 (S * mb + 1, bs, 3, D)))
    tables = np.asarray(tables).copy()
    tables[1, 2:6] = 0                          # outside seq 1's window, freed (not the sinks)
    opts = dict(sliding_window=48, num_sinks=4, q_sinks=qs, return_lse=True)
    args = (q, k, v, jnp.asarray(tables), lens, qsl)
    assert native_tiles(hnd(k), hnd(v))
    want, want_lse = paged_attention_reference(*args, **opts)
    got, lse = jax.jit(partial(paged_attention_grouped, row_queries=row_queries, **opts))(
        q, hnd(k), hnd(v), *args[3:])
    n = int(qsl[-1])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32)
    np.testing.assert_allclose(np.asarray(lse[:n]), np.asarray(want_lse[:n]), **F32)


def test_decode_only_prefill_only_and_empty_steps():
    rng = np.random.default_rng(7)
    T, S, mb, bs = 16, 8, 24, 4
    kv = rng.standard_normal((S * mb + 1, bs, 2, 16)).astype(np.float32)
    pools = (jnp.asarray(kv), jnp.asarray(kv * 0.5))
    for q_lens, kv_lens in (([1] * 8, [1, 5, 96, 33, 4, 17, 64, 2]),   # decode only, S full
                            ([16], [16]),                              # one fresh prompt
                            ([9, 7], [40, 7]),                         # chunk after a prefix
                            ([], [])):                                 # nothing: all padding
        tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=T, S=S, max_blocks=mb,
                                        num_blocks=S * mb + 1, bs=bs)
        q = jnp.asarray(rng.standard_normal((T, 6, 16)), jnp.float32)
        assert_matches_reference((q, *pools, tables, lens, qsl), block_q=4)


def test_dispatch_and_bf16():
    rng = np.random.default_rng(3)
    args = random_batch(rng, Hq=9, Hkv=3, dtype=jnp.bfloat16)
    got = paged_attention(*args, impl="grouped", sliding_window=9)
    want = paged_attention(*args, impl="reference", sliding_window=9)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)


def test_one_compilation_per_shape():
    """Different ragged contents of one (T, S, pool) shape reuse one executable."""
    rng = np.random.default_rng(11)
    f = jax.jit(partial(paged_attention_grouped, sliding_window=12, num_sinks=1))
    for _ in range(4):
        f(*random_batch(rng, Hq=4, Hkv=2))
    assert f._cache_size() == 1


def quantized_step(kv_cache_dtype, rng, *, residual_blocks=1, bs=4, Hkv=2, D=32, T=28, S=5,
                   max_blocks=12, static_scale=None):
    """A one-layer quantized pool written by prefilling random K/V of each sequence in one step
    (KIVI: its residual window placed by that step's metadata), and a ragged batch reading it:
    decode rows, a chunk after a prefix, a whole prompt, and padding."""
    kv_lens = [19, 5, 16, 33, 12]
    q_lens = [1, 1, 16, 7, 0]
    num_blocks = S * max_blocks + 1
    spec = KVCacheSpec(num_layers=1, num_blocks=num_blocks, block_size=bs, num_kv_heads=Hkv,
                       head_dim=D, kv_cache_dtype=kv_cache_dtype, group_size=16,
                       residual_blocks=residual_blocks,
                       num_residual_slots=residual_blocks * S + 1, static_scale=static_scale)
    tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=T, S=S, max_blocks=max_blocks,
                                    num_blocks=num_blocks, bs=bs)
    tab = np.asarray(tables)
    slots = np.concatenate([tab[s, np.arange(n) // bs] * bs + np.arange(n) % bs
                            for s, n in enumerate(kv_lens)]).astype(np.int32)
    write_qsl = jnp.asarray(np.concatenate([[0], np.cumsum(kv_lens)]), jnp.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(slots), query_start_loc=write_qsl,
                           seq_lens=lens, block_tables=tables)
    k = jnp.asarray(rng.standard_normal((len(slots), Hkv, D)), jnp.float32)
    cache = kvcache.write(kvcache.init_cache(spec), 0, k, k * 0.5 + 0.1, jnp.asarray(slots), md)
    q = jnp.asarray(rng.standard_normal((T, 3 * Hkv, D)), jnp.float32)
    return (q, cache.k[0], cache.v[0], tables, lens, qsl)


@pytest.mark.parametrize("kv,residual_blocks", [
    ("fp8_e4m3", 1), pytest.param("fp8_e5m2", 1, marks=pytest.mark.slow), ("int8", 1), ("int4", 1),
    pytest.param("int4", 3, marks=pytest.mark.slow), ("int2", 3)])
def test_grouped_matches_reference_on_quantized_pools(kv, residual_blocks):
    rng = np.random.default_rng(5)
    args = quantized_step(kv, rng, residual_blocks=residual_blocks)
    if residual_blocks > 1:      # sealed blocks inside the window are read from the residual
        assert bool(((args[1].res_slot > 0) & args[1].sealed).any())
    assert_matches_reference(args)
    assert_matches_reference(args, kv_chunk_blocks=2, block_q=3, sliding_window=6, num_sinks=1)
    assert_matches_reference(args, kv_chunk_blocks=2, block_q=3, row_queries=3)


@pytest.mark.parametrize("kv, static_scale", [
    ("int8", None), ("fp8_e4m3", None), pytest.param("fp8_e5m2", None, marks=pytest.mark.slow),
    ("fp8_e4m3", 0.05), ("bf16", None), pytest.param("fp16", None, marks=pytest.mark.slow)])
def test_native_kernels_on_coded_pools(kv, static_scale):
    """The C++ rows and tiles over the pools they decode as they read (``kernel_pools``): int8
    and fp8 codes with their per-token scales or a fixed one, bf16 and fp16 HND pools; blocks
    of 16, head dim 64 (prompt chunks long enough for tiles, decode rows); against the
    reference, which dequantizes the same codes, with and without dropped blocks."""
    rng = np.random.default_rng(len(kv) + (static_scale is not None))
    args = quantized_step(kv, rng, bs=16, D=64, T=40, S=5, max_blocks=4,
                          static_scale=static_scale)
    pools = args[1:3] if kv in ("int8", "fp8_e4m3", "fp8_e5m2") else map(hnd, args[1:3])
    assert native_tiles(*pools)
    for rq in (1, 3):
        assert_matches_reference(args, row_queries=rq)
        assert_matches_reference(drop_blocks(rng, args, 0.5), row_queries=rq)


def test_kivi_stale_residual_slot_is_read_as_codes():
    """A sealed block outside its reader's window that still holds a residual slot (a finished
    sequence's window, or another sequence's) is read as codes by both paths."""
    rng = np.random.default_rng(9)
    q, k, v, tables, lens, qsl = quantized_step("int4", rng, residual_blocks=2)
    block = int(tables[3, 0])                          # sealed, far outside seq 3's window
    slot = int(np.flatnonzero(np.asarray(k.res_owner) == 0)[1])   # a free slot (0 is null)
    stale = dataclasses.replace(k, res_slot=k.res_slot.at[block].set(slot),
                                res_owner=k.res_owner.at[slot].set(block),
                                residual=k.residual.at[slot].set(100.0))
    args = (q, stale, v, tables, lens, qsl)
    assert_matches_reference(args, kv_chunk_blocks=2, block_q=4)
    np.testing.assert_allclose(paged_attention_grouped(*args),
                               paged_attention_grouped(q, k, v, tables, lens, qsl), **F32)


def drop_blocks(rng, args, frac):
    """``args`` with a random ``frac`` of each sequence's blocks before its first query token
    set to the null block (a retention policy's scattered drops; the blocks the step's queries
    sit in stay)."""
    tables, lens, qsl = (np.asarray(a) for a in args[3:6])
    first_block = (lens - np.diff(qsl)) // args[1].shape[1]             # [S]
    logical = np.arange(tables.shape[1])
    dropped = (logical[None, :] < first_block[:, None]) & (rng.random(tables.shape) < frac)
    return (*args[:3], jnp.asarray(np.where(dropped, 0, tables)), *args[4:])


@pytest.mark.parametrize("options", ["plain", "window-sinks-cap"])
@pytest.mark.parametrize("Hq,Hkv,bs", [(4, 4, 4), (9, 3, 4)])
def test_grouped_matches_reference_with_scattered_dropped_blocks(Hq, Hkv, bs, options):
    """Null entries in the middle of the tables (decode rows and prefill chunks after dropped
    blocks): the kept-blocks walk without a window, the window's chunks with one."""
    rng = np.random.default_rng(31 * Hq + bs + list(OPTIONS).index(options))
    for chunking in (dict(kv_chunk_blocks=3, block_q=5), dict(kv_chunk_blocks=1, block_q=8), {}):
        for frac in (0.3, 0.9):
            args = drop_blocks(rng, random_batch(rng, Hq=Hq, Hkv=Hkv, bs=bs), frac)
            assert_matches_reference(args, tol=dict(atol=2e-5, rtol=2e-5), **OPTIONS[options],
                                     **chunking)


@pytest.mark.parametrize("kv,residual_blocks", [("fp8_e4m3", 1), ("int8", 1), ("int4", 3),
                                                ("int2", 3)])
def test_grouped_matches_reference_on_quantized_pools_with_dropped_blocks(kv, residual_blocks):
    """Dropped blocks of a quantized pool: KIVI's residual window is placed by the logical
    index of each compacted slot, as the reference places it."""
    rng = np.random.default_rng(6)
    args = drop_blocks(rng, quantized_step(kv, rng, residual_blocks=residual_blocks), 0.5)
    assert int((np.asarray(args[3]) == 0).sum()) > 20
    tol = dict(atol=2e-5, rtol=2e-5)
    assert_matches_reference(args, tol=tol)
    assert_matches_reference(args, tol=tol, kv_chunk_blocks=2, block_q=3)


def test_kept_blocks_compacts_each_row_stably():
    tables = jnp.asarray([[5, 0, 7, 0, 0, 9], [0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0]], jnp.int32)
    order, kept_before = kept_blocks(tables)
    np.testing.assert_array_equal(order, [[0, 2, 5, 1, 3, 4], [0, 1, 2, 3, 4, 5],
                                          [0, 1, 2, 3, 4, 5]])
    np.testing.assert_array_equal(kept_before, [[0, 1, 1, 2, 2, 2, 3], [0] * 7,
                                                [0, 1, 2, 3, 4, 4, 4]])


def counting_reads(monkeypatch, module):
    """Patches ``module.read_sequence_blocks`` to record, at run time, the rank of the ``ids``
    of every read (2: the row path's [S, chunk], 1: a tile's [chunk]); returns the record."""
    reads = []

    def counting(pages, ids, logical, seq_lens, **kw):
        jax.debug.callback(lambda x: reads.append(x.ndim), ids)
        return read_sequence_blocks(pages, ids, logical, seq_lens, **kw)

    monkeypatch.setattr(module, "read_sequence_blocks", counting)
    return reads


def thinned_batch(rng, q_lens, *, bs=4, max_blocks=24, Hq=4, Hkv=2, D=16):
    """Sequences of ``max_blocks * bs`` positions, each with queries ``q_lens``, keeping only
    logical blocks 3, 10 and the last three (5 of 24): float (q, k, v, tables, lens, qsl)."""
    S, T = len(q_lens), sum(q_lens)
    nb = S * max_blocks + 1
    tables, lens, qsl = table_batch(rng, q_lens, [max_blocks * bs] * S, T=T, S=S,
                                    max_blocks=max_blocks, num_blocks=nb, bs=bs)
    keep = np.isin(np.arange(max_blocks), [3, 10, max_blocks - 3, max_blocks - 2,
                                           max_blocks - 1])
    q = jnp.asarray(rng.standard_normal((T, Hq, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((nb, bs, Hkv, D)), jnp.float32) for _ in range(2))
    return q, k, v, jnp.where(jnp.asarray(keep)[None], tables, 0), lens, qsl


def test_visited_chunks_are_bounded_by_the_kept_blocks(monkeypatch):
    """A decode row and a prefill chunk at 96 logical positions with 5 of their 24 blocks kept
    visit 3 chunks of 2 blocks (the logical walk visits 12), counted at run time."""
    reads = counting_reads(monkeypatch, grouped)
    args = thinned_batch(np.random.default_rng(2), [1, 9])
    got = paged_attention_grouped(*args, kv_chunk_blocks=2, block_q=8)
    jax.effects_barrier()
    # K and V of 3 row steps (6 units, 2 a step) and of the one tile's (8 tokens) 3 chunks
    assert sorted(reads) == [1] * 6 + [2] * 6, reads
    np.testing.assert_allclose(got, paged_attention_reference(*args), atol=2e-5, rtol=2e-5)


def test_row_path_steps_cover_each_rows_own_chunks(monkeypatch):
    """Decode rows of 5, 1 and 2 chunks (and a padding row) are 8 (row, chunk) units, laid end
    to end and taken 4 at a time: 2 loop steps, not the 5 of running every row to the longest
    one's chunk count. Counted at run time; the output is the reference's."""
    reads = counting_reads(monkeypatch, grouped)
    rng = np.random.default_rng(5)
    bs, chunk, S = 4, 2, 4
    kv_lens = [5 * chunk * bs - 3, chunk * bs, 2 * chunk * bs]                 # 5, 1, 2 chunks
    tables, lens, qsl = table_batch(rng, [1, 1, 1], kv_lens, T=4, S=S, max_blocks=12,
                                    num_blocks=40, bs=bs)
    q = jnp.asarray(rng.standard_normal((4, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((40, bs, 2, 16)), jnp.float32) for _ in range(2))
    args = (q, k, v, tables, lens, qsl)
    got = paged_attention_grouped(*args, kv_chunk_blocks=chunk)
    jax.effects_barrier()
    assert reads == [2] * 4, reads                                   # K and V of 2 steps
    np.testing.assert_allclose(got[:3], paged_attention_reference(*args)[:3], **F32)


def test_merge_units_adds_several_units_of_a_row_in_one_step():
    """``merge_units`` with units of one row split across and within steps (and a dropped
    unit) equals a softmax over the row's positions at once."""
    rng = np.random.default_rng(6)
    s = rng.standard_normal((6, 5, 2)).astype(np.float32)          # [units, positions, heads]
    vals = rng.standard_normal((6, 5, 2, 3)).astype(np.float32)    # [units, positions, heads, D]
    s[2, 3:] = -np.inf                                             # masked positions
    rows = np.array([0, 1, 0, 1, 0, 2])                            # unit 5: dropped (R = 2)
    carry = softmax_init((2, 2), 3)
    for step in (slice(0, 3), slice(3, 6)):
        carry = grouped.merge_units(
            carry, jnp.asarray(rows[step]), jnp.asarray(s[step]),
            lambda p, step=step: jnp.einsum("nrh,nrhd->nhd", p, vals[step]))
    out, lse = softmax_result(carry)
    for row in (0, 1):
        logits = np.concatenate(s[rows == row], axis=0)            # [positions, heads]
        w = np.exp(logits - logits.max(0))
        want = np.einsum("rh,rhd->hd", w / w.sum(0), np.concatenate(vals[rows == row], axis=0))
        np.testing.assert_allclose(out[row], want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(lse[row], np.log(np.exp(logits).sum(0)), atol=1e-5, rtol=1e-5)
