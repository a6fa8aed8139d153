"""Pallas GPU kernels (jaxkv.attention.pallas) against the reference, in interpret mode on CPU.

Plus: the kept-blocks walk over tables with dropped blocks (float and quantized pools, the tiles
it visits, and that it never reads a dropped block), input checks, merge_attention_states, the
tile schedule, CUDA lowering of every kernel variant (no GPU needed), and a dry run of
bench/gpu_check.py.
"""

import functools
import importlib.util
import json
import os
import sys

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.kv_chunks import kept_blocks
from jaxkv.attention.pallas import (DecodeConfig, RaggedConfig, check_page_ids, default_num_splits,
                                    decode_step_attention,
                                    default_ragged_config, paged_decode_attention,
                                    ragged_paged_attention)
from jaxkv.attention.pallas.kv_walk import kept_run
from jaxkv.attention.pallas.ragged import _tile_schedule
from jaxkv.attention.reference import (kv_tile_range, merge_attention_states,
                                       paged_attention_reference)
from bench.lib.ragged_batches import table_batch
from test_attention_grouped import drop_blocks, quantized_step

# jax >= 0.11 deprecates the Triton backend (still present in 0.12); the kernels use it on purpose
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# max |kernel - reference| allowed, by the dtype of q and the pools
TOL = {
    jnp.float32: dict(atol=2e-5, rtol=2e-5),
    jnp.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def make_batch(rng, q_lens, kv_lens, *, Hq, Hkv, D, bs, dtype=jnp.float32, pad_tokens=3,
               pad_seqs=1):
    """A ragged batch whose block tables come from a random permutation of page ids 1.."""
    max_blocks = max(-(-n // bs) for n in kv_lens) + 1
    num_blocks = 1 + sum(-(-n // bs) for n in kv_lens) + 3
    S = len(q_lens) + pad_seqs
    T = sum(q_lens) + pad_tokens
    tables, seq_lens, qsl = table_batch(rng, q_lens, kv_lens, T=T, S=S, max_blocks=max_blocks,
                                        num_blocks=num_blocks, bs=bs)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return dict(q=normal(T, Hq, D), k_pages=normal(num_blocks, bs, Hkv, D),
                v_pages=normal(num_blocks, bs, Hkv, D), block_tables=tables,
                seq_lens=seq_lens, query_start_loc=qsl)


def assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=TOL[dtype]["atol"], rtol=TOL[dtype]["rtol"])


# ---------------------------------------------------------------------------------------------
# ragged kernel
# ---------------------------------------------------------------------------------------------

# Every GQA ratio (1/3/4/8), head_dim 64/128, block sizes 8/16/32; kv lengths 1, block boundary
# +-1 and long; decode tokens, partial prefill chunks (with context) and whole prompts in one batch.
RAGGED_CASES = {
    "g1-d64-bs8-plain": dict(
        Hq=2, Hkv=2, D=64, bs=8, q_lens=[1, 7, 1, 9, 40], kv_lens=[1, 7, 8, 9, 100],
        opts={}, config=None),
    "g3-d64-bs16-window-sinks": dict(
        Hq=6, Hkv=2, D=64, bs=16, q_lens=[15, 1, 17, 3], kv_lens=[15, 16, 17, 130],
        opts=dict(sliding_window=20, num_sinks=3),
        config=RaggedConfig(block_q=4, block_kv=16)),
    "g4-d128-bs32-window-softcap-scale": dict(
        Hq=8, Hkv=2, D=128, bs=32, q_lens=[1, 33, 2], kv_lens=[31, 33, 200],
        opts=dict(sliding_window=40, soft_cap=5.0, sm_scale=0.2),
        config=RaggedConfig(block_q=4, block_kv=32, num_warps=8, num_stages=3)),
    "g8-d64-bs16-all-options": dict(
        Hq=16, Hkv=2, D=64, bs=16, q_lens=[1, 1, 5, 20], kv_lens=[1, 65, 64, 150],
        opts=dict(sliding_window=33, num_sinks=17, soft_cap=10.0),
        config=RaggedConfig(block_q=2, block_kv=32)),
}


@pytest.mark.parametrize("name", list(RAGGED_CASES))
def test_ragged_matches_reference(name):
    case = RAGGED_CASES[name]
    rng = np.random.default_rng(sorted(RAGGED_CASES).index(name))
    batch = make_batch(rng, case["q_lens"], case["kv_lens"], Hq=case["Hq"], Hkv=case["Hkv"],
                       D=case["D"], bs=case["bs"])
    out, lse = ragged_paged_attention(**batch, **case["opts"], return_lse=True,
                                      config=case["config"], interpret=True)
    want, want_lse = paged_attention_reference(**batch, **case["opts"], return_lse=True)
    n = sum(case["q_lens"])
    assert out.shape == want.shape and out.dtype == want.dtype
    assert_close(out[:n], want[:n], jnp.float32)
    assert_close(lse[:n], want_lse[:n], jnp.float32)
    assert np.all(np.asarray(out[n:]) == 0), "padding tokens must produce zeros"
    assert np.all(np.isneginf(np.asarray(lse[n:])))


def test_ragged_bf16():
    rng = np.random.default_rng(7)
    batch = make_batch(rng, [1, 12, 1], [40, 12, 17], Hq=8, Hkv=2, D=64, bs=16,
                       dtype=jnp.bfloat16)
    out = ragged_paged_attention(**batch, sliding_window=24, num_sinks=2, interpret=True)
    want = paged_attention_reference(**batch, sliding_window=24, num_sinks=2)
    assert out.dtype == jnp.bfloat16
    assert_close(out[:14], want[:14], jnp.bfloat16)


def test_dispatch_impl_pallas_under_jit():
    """paged_attention(impl="pallas") runs the kernel; traced metadata skip the host checks."""
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [4, 1], [9, 30], Hq=4, Hkv=2, D=16, bs=8)
    f = jax.jit(functools.partial(paged_attention, impl="pallas", interpret=True, soft_cap=20.0))
    assert_close(f(**batch)[:5], paged_attention_reference(**batch, soft_cap=20.0)[:5],
                 jnp.float32)


@settings(max_examples=25, deadline=None)
@given(q_lens=st.lists(st.integers(0, 9), min_size=1, max_size=5),
       block_q=st.sampled_from([1, 2, 4]))
def test_tile_schedule_covers_every_token_once(q_lens, block_q):
    S, T = 6, 50
    qsl = np.zeros(S + 1, np.int32)
    qsl[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1:] = qsl[len(q_lens)]
    seq_lens = np.diff(qsl) + 3
    num_tiles = max(1, min(T, -(-T // block_q) + S))
    tiles = np.asarray(_tile_schedule(jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32),
                                      num_tiles, block_q))
    covered = np.zeros(T, int)
    for seq, tok0, n_valid, q_first in tiles:
        assert 0 <= n_valid <= block_q
        if n_valid:
            covered[tok0:tok0 + n_valid] += 1
            assert qsl[seq] <= tok0 and tok0 + n_valid <= qsl[seq + 1]
            assert q_first == seq_lens[seq] - (qsl[seq + 1] - qsl[seq]) + (tok0 - qsl[seq])
    assert np.array_equal(covered, (np.arange(T) < qsl[-1]).astype(int))


# ---------------------------------------------------------------------------------------------
# split-K decode kernel
# ---------------------------------------------------------------------------------------------

DECODE_CASES = {
    "g1-d64-bs8-one-split": dict(
        Hq=4, Hkv=4, D=64, bs=8, kv_lens=[1, 7, 8, 9, 200], num_splits=1, opts={},
        config=None),
    "g3-d64-bs16-3-splits-window-sinks": dict(
        Hq=9, Hkv=3, D=64, bs=16, kv_lens=[15, 16, 17, 300], num_splits=3,
        opts=dict(sliding_window=50, num_sinks=20), config=DecodeConfig(block_kv=16)),
    "g4-d128-bs32-default-splits-softcap": dict(
        Hq=8, Hkv=2, D=128, bs=32, kv_lens=[33, 31, 500], num_splits=None,
        opts=dict(soft_cap=5.0, sm_scale=0.2), config=DecodeConfig(block_kv=32, num_warps=8)),
    "g8-d64-bs16-8-splits-all-options": dict(
        Hq=16, Hkv=2, D=64, bs=16, kv_lens=[1, 64, 65, 257], num_splits=8,
        opts=dict(sliding_window=100, num_sinks=4, soft_cap=10.0),
        config=DecodeConfig(block_kv=16, num_stages=2)),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_reference(name):
    case = DECODE_CASES[name]
    rng = np.random.default_rng(10 + sorted(DECODE_CASES).index(name))
    n = len(case["kv_lens"])
    batch = make_batch(rng, [1] * n, case["kv_lens"], Hq=case["Hq"], Hkv=case["Hkv"],
                       D=case["D"], bs=case["bs"], pad_tokens=0, pad_seqs=1)
    batch.pop("query_start_loc")
    batch["q"] = jnp.asarray(rng.standard_normal((n + 1, case["Hq"], case["D"])), jnp.float32)
    out, lse = paged_decode_attention(**batch, **case["opts"], num_splits=case["num_splits"],
                                      return_lse=True, config=case["config"], interpret=True)
    want, want_lse = paged_attention_reference(
        **batch, query_start_loc=jnp.arange(n + 2, dtype=jnp.int32), **case["opts"],
        return_lse=True)
    assert_close(out, want, jnp.float32)
    assert_close(lse[:n], want_lse[:n], jnp.float32)
    assert np.all(np.asarray(out[n:]) == 0) and np.all(np.isneginf(np.asarray(lse[n:]))), \
        "padding sequences (seq_len 0) must produce zeros and lse -inf"


def test_decode_bf16_splits_agree():
    rng = np.random.default_rng(5)
    batch = make_batch(rng, [1, 1, 1], [3, 100, 48], Hq=8, Hkv=2, D=64, bs=16,
                       dtype=jnp.bfloat16, pad_tokens=0, pad_seqs=0)
    qsl = batch.pop("query_start_loc")
    want = paged_attention_reference(**batch, query_start_loc=qsl, soft_cap=30.0)
    for num_splits in (1, 4):
        out = paged_decode_attention(**batch, num_splits=num_splits, soft_cap=30.0,
                                     interpret=True)
        assert out.dtype == jnp.bfloat16
        assert_close(out, want, jnp.bfloat16)


def test_default_num_splits_fills_the_gpu_and_keeps_two_tiles_per_split():
    assert default_num_splits(1, 8, 32768, 64) == 64            # 8 programs, ~264 wanted
    assert default_num_splits(128, 8, 32768, 64) == 1           # 1024 programs already
    assert default_num_splits(1, 8, 256, 64) == 2               # only 4 tiles
    assert default_num_splits(1, 1, 1 << 20, 64) == 64          # capped
    assert default_num_splits(16, 8, 32768, 64) == 4            # 128 programs, 264 wanted
    assert default_num_splits(16, 8, 32768, 64, num_sms=264) == 8   # a larger GPU: 528
    assert default_num_splits(16, 8, 32768, 64, num_sms=32) == 1
    assert default_ragged_config(8, 8, 4, 128).block_q * 4 == 16
    assert default_ragged_config(8192, 1, 4, 128).block_q * 4 == 64


@pytest.mark.parametrize("T,S,options", [
    (6, 6, {}),                                                # the engine's decode shape
    (8, 5, dict(soft_cap=20.0)),                               # more token rows than sequences
    (4, 6, dict(sliding_window=20, num_sinks=3, q_sinks=True)),   # fewer
])
def test_decode_step_attention_is_the_ragged_step(T, S, options):
    """A decode-only ragged step (token s is sequence s's, padding sequences after) through the
    split-K kernel equals the reference: out and lse of every token, zeros and -inf for the
    padding ones; through ``dispatch.paged_attention(decode_only=True)`` under jit too."""
    rng = np.random.default_rng(T * S)
    n = min(T, S) - 1                                           # real sequences
    kv_lens = [1, 17, 40, 64, 9][:n]
    batch = make_batch(rng, [1] * n, kv_lens, Hq=8, Hkv=2, D=32, bs=8, pad_tokens=T - n,
                       pad_seqs=S - n)
    if options.get("q_sinks"):
        options = {**options, "q_sinks": jnp.asarray(rng.standard_normal(batch["q"].shape),
                                                      jnp.float32)}
    want, want_lse = paged_attention_reference(**batch, **options, return_lse=True)
    out, lse = decode_step_attention(**batch, **options, return_lse=True, interpret=True)
    assert out.shape == (T, 8, 32) and lse.shape == (T, 8)
    assert_close(out[:n], want[:n], jnp.float32)
    assert_close(lse[:n], want_lse[:n], jnp.float32)
    assert np.all(np.asarray(out[n:]) == 0) and np.all(np.isneginf(np.asarray(lse[n:])))
    f = jax.jit(functools.partial(paged_attention, impl="pallas", interpret=True,
                                  decode_only=True, **options))
    assert_close(f(**batch)[:n], want[:n], jnp.float32)
    text = str(jax.make_jaxpr(f)(**batch))
    assert "jaxkv_paged_decode_attention" in text and "jaxkv_ragged" not in text


# ---------------------------------------------------------------------------------------------
# the kept-blocks walk (tables with dropped blocks: H2O, SnapKV, random retention)
# ---------------------------------------------------------------------------------------------

DROP_OPTIONS = {
    "plain": {},
    "softcap-scale": dict(soft_cap=5.0, sm_scale=0.3),
    # with a window the walk stays the logical one (the window's tiles), null blocks masked
    "window-sinks-softcap": dict(sliding_window=40, num_sinks=5, soft_cap=10.0),
}


def decode_args(args):
    """A ragged batch (q, k, v, tables, lens, qsl) as a decode batch: one query per sequence (at
    its last position), q [S, Hq, D] and query_start_loc ``arange(S + 1)``."""
    q, k, v, tables, lens, _ = args
    S = tables.shape[0]
    q = jnp.asarray(np.random.default_rng(S).standard_normal((S, *q.shape[1:])), q.dtype)
    return q, k, v, tables, lens, jnp.arange(S + 1, dtype=jnp.int32)


def assert_kernels_match_reference(args, *, num_splits=(1, 3), ragged=None, decode=None,
                                   tol=TOL[jnp.float32], **opts):
    """Ragged kernel on ``args`` and split-K decode kernel on ``decode_args(args)`` == reference
    (out and lse of every valid token)."""
    q, k, v, tables, lens, qsl = args
    n = int(qsl[-1])
    out, lse = ragged_paged_attention(*args, **opts, return_lse=True, config=ragged,
                                      interpret=True)
    want, want_lse = paged_attention_reference(*args, **opts, return_lse=True)
    np.testing.assert_allclose(out[:n], want[:n], **tol)
    np.testing.assert_allclose(lse[:n], want_lse[:n], **tol)
    qd, k, v, tables, lens, qsl_d = decode_args(args)
    want, want_lse = paged_attention_reference(qd, k, v, tables, lens, qsl_d, **opts,
                                               return_lse=True)
    live = np.asarray(lens) > 0
    for splits in num_splits:
        out, lse = paged_decode_attention(qd, k, v, tables, lens, num_splits=splits, **opts,
                                          return_lse=True, config=decode, interpret=True)
        np.testing.assert_allclose(out, want, **tol)
        np.testing.assert_allclose(lse[live], want_lse[live], **tol)


@pytest.mark.parametrize("options", [pytest.param(o, marks=pytest.mark.slow)
                                     if o == "softcap-scale" else o for o in DROP_OPTIONS])
@pytest.mark.parametrize("bs,block_kv", [(8, 32), (32, 16)])   # tiles of 4 blocks / half a block
def test_kernels_match_reference_with_scattered_dropped_blocks(bs, block_kv, options):
    """30% and 90% of the blocks before each sequence's first query token null: decode rows and
    prefill chunks after drops, split-K with 1, 3 and 8 splits."""
    rng = np.random.default_rng(bs + list(DROP_OPTIONS).index(options))
    batch = make_batch(rng, [1, 9, 1, 20, 1], [200, 130, 97, 260, 33], Hq=8, Hkv=2, D=32, bs=bs)
    args = tuple(batch[n] for n in ("q", "k_pages", "v_pages", "block_tables", "seq_lens",
                                    "query_start_loc"))
    for frac in (0.3, 0.9):
        dropped = drop_blocks(rng, args, frac)
        assert int((np.asarray(dropped[3]) != np.asarray(args[3])).sum()) >= 3
        assert_kernels_match_reference(
            dropped, num_splits=(1, 3, 8), ragged=RaggedConfig(block_q=4, block_kv=block_kv),
            decode=DecodeConfig(block_kv=block_kv), **DROP_OPTIONS[options])


def test_window_walk_with_sink_queries_and_dropped_blocks():
    """With a window, sinks and StreamingLLM's sink queries, dropped blocks in the window are
    masked as before."""
    rng = np.random.default_rng(4)
    batch = make_batch(rng, [1, 12, 1], [90, 60, 41], Hq=4, Hkv=2, D=32, bs=8)
    args = drop_blocks(rng, tuple(batch[n] for n in (
        "q", "k_pages", "v_pages", "block_tables", "seq_lens", "query_start_loc")), 0.5)
    q_sinks = jnp.asarray(rng.standard_normal(args[0].shape), jnp.float32)
    opts = dict(sliding_window=30, num_sinks=3, q_sinks=q_sinks)
    out = ragged_paged_attention(*args, **opts, interpret=True)
    want = paged_attention_reference(*args, **opts)
    np.testing.assert_allclose(out[:14], want[:14], **TOL[jnp.float32])


@pytest.mark.parametrize("kv,residual_blocks,D", [
    pytest.param("fp8_e4m3", 1, 32, marks=pytest.mark.slow), ("int8", 1, 32), ("int4", 3, 32),
    pytest.param("int2", 3, 64, marks=pytest.mark.slow)])
def test_kernels_match_reference_on_quantized_pools_with_dropped_blocks(kv, residual_blocks, D):
    """fp8/int8 codes and packed KIVI int4/int2 (residual window of 3 blocks) with half the
    blocks before the queries dropped: the residual window is placed by each run entry's logical
    block, as the reference places it."""
    rng = np.random.default_rng(8)
    args = drop_blocks(rng, quantized_step(kv, rng, residual_blocks=residual_blocks, D=D), 0.5)
    assert int((np.asarray(args[3]) == 0).sum()) > 20
    if residual_blocks > 1:
        assert bool(((args[1].res_slot > 0) & args[1].sealed).any())
    assert_kernels_match_reference(args, num_splits=(1, 4))
    assert_kernels_match_reference(args, num_splits=(2,), soft_cap=8.0)


def test_kept_walk_visits_only_the_kept_tiles():
    """The kv tiles a program walks (``kept_run``, what both kernels loop over without a window):
    a row keeping 6 of its 24 blocks visits 2 tiles of 64 positions, not the 6 of the logical
    walk; a row without drops visits exactly the logical walk's tiles; a decode row's causal end
    inside a kept block counts only the positions before it."""
    bs, block_kv, max_blocks = 16, 64, 24
    tables = np.zeros((3, max_blocks), np.int32)
    tables[0, [2, 5, 11, 17, 20, 23]] = np.arange(1, 7)           # 25% kept, scattered
    tables[1] = np.arange(1, max_blocks + 1)                      # nothing dropped
    tables[2, [0, 1, 2, 3, 23]] = np.arange(7, 12)                # sinks + the last block
    _, kept_before = kept_blocks(jnp.asarray(tables))

    def tiles(row, kv_end):
        return int(kept_run(lambda j: kept_before[row, j], jnp.int32(kv_end), block_size=bs,
                            block_kv=block_kv)[1])

    full = max_blocks * bs                                        # 384 positions
    assert [tiles(r, full) for r in range(3)] == [2, 6, 2]
    assert tiles(1, full) == int(kv_tile_range(full - 1, full, block_kv=block_kv,
                                               sliding_window=None, num_sinks=0)[2])
    for kv_end in (1, 15, 16, 17, 100, 383):                      # dense: as the logical walk
        assert tiles(1, kv_end) == -(-kv_end // block_kv)
    assert tiles(0, 5 * 16 + 1) == 1        # blocks 2 and 5 (1 position of it): 17 positions
    assert tiles(2, 4 * 16 + 1) == 1        # blocks 0-3 kept, block 4 dropped: 64 positions
    assert tiles(2, full - 3) == 2          # 4 blocks + 13 positions of the last one


@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_kept_walk_never_reads_a_dropped_block(kernel):
    """Every page outside the kept blocks (the null block included) holds NaN: the kept walk
    never loads one, so the output is unchanged (the logical walk loaded the null block and
    masked it, and 0 * NaN = NaN would reach the output)."""
    rng = np.random.default_rng(12)
    batch = make_batch(rng, [1, 9, 1], [150, 80, 64], Hq=4, Hkv=2, D=32, bs=8)
    args = drop_blocks(rng, tuple(batch[n] for n in (
        "q", "k_pages", "v_pages", "block_tables", "seq_lens", "query_start_loc")), 0.6)
    if kernel == "decode":
        args = decode_args(args)
    q, k, v, tables, lens, qsl = args
    kept = np.zeros(k.shape[0], bool)
    for s, n in enumerate(np.asarray(lens)):
        kept[np.asarray(tables)[s, :-(-n // 8)]] = True
    kept[0] = False
    assert (~kept[1:]).sum() >= 8, "dropped blocks must hold pages the poison covers"
    poison = jnp.asarray(~kept)[:, None, None, None]
    k_nan, v_nan = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    if kernel == "ragged":
        def run(k, v):
            return ragged_paged_attention(q, k, v, tables, lens, qsl, soft_cap=20.0,
                                          config=RaggedConfig(block_q=8, block_kv=16),
                                          interpret=True)
    else:
        def run(k, v):
            return paged_decode_attention(q, k, v, tables, lens, num_splits=3, soft_cap=20.0,
                                          config=DecodeConfig(block_kv=32), interpret=True)
    np.testing.assert_array_equal(np.asarray(run(k_nan, v_nan)), np.asarray(run(k, v)))
    want = paged_attention_reference(*args, soft_cap=20.0)
    n = int(qsl[-1])
    np.testing.assert_allclose(run(k, v)[:n], want[:n], **TOL[jnp.float32])


# ---------------------------------------------------------------------------------------------
# merge_attention_states
# ---------------------------------------------------------------------------------------------


def test_merge_attention_states_equals_softmax_over_the_union():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 4, 10)) * 3       # [rows, heads, keys]
    values = rng.standard_normal((10, 8))
    parts = [slice(0, 3), slice(3, 3), slice(3, 10)]   # the middle part is empty

    def attend(s, v):
        if s.shape[-1] == 0:
            return np.zeros(s.shape[:-1] + (8,)), np.full(s.shape[:-1], -np.inf)
        lse = np.log(np.exp(s).sum(-1))
        return np.exp(s - lse[..., None]) @ v, lse

    outs, lses = zip(*(attend(logits[..., p], values[p]) for p in parts))
    out, lse = merge_attention_states(jnp.asarray(np.stack(outs), jnp.float32),
                                      jnp.asarray(np.stack(lses), jnp.float32))
    want, want_lse = attend(logits, values)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=1e-5)

    empty_out, empty_lse = merge_attention_states(jnp.zeros((2, 3, 8)), jnp.full((2, 3), -jnp.inf))
    assert np.all(np.asarray(empty_out) == 0) and np.all(np.isneginf(np.asarray(empty_lse)))
    with pytest.raises(ValueError, match="disagree"):
        merge_attention_states(jnp.zeros((2, 3, 8)), jnp.zeros((2, 4)))


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------


def _small_batch():
    return make_batch(np.random.default_rng(1), [2, 1], [4, 9], Hq=4, Hkv=2, D=16, bs=4)


def _with(batch, **changes):
    return {**batch, **changes}


@pytest.mark.parametrize("change,match", [
    (lambda b: dict(q=b["q"][0]), "q must be"),
    (lambda b: dict(q=b["q"][..., :8]), "head_dim mismatch"),
    (lambda b: dict(q=b["q"][:, :3]), "num_heads=3"),
    (lambda b: dict(q=b["q"].astype(jnp.bfloat16)), "share one dtype"),
    (lambda b: dict(v_pages=b["v_pages"][:-1]), "k_pages/v_pages"),
    (lambda b: dict(seq_lens=b["seq_lens"].astype(jnp.int16)), "seq_lens must be int32"),
    (lambda b: dict(block_tables=b["block_tables"].astype(jnp.float32)),
     "block_tables must be int32"),
    (lambda b: dict(query_start_loc=b["query_start_loc"].astype(jnp.uint32)),
     "query_start_loc must be int32"),
    (lambda b: dict(query_start_loc=b["query_start_loc"][:-1]), "query_start_loc must be"),
    (lambda b: dict(block_tables=b["block_tables"].at[1, 0].set(b["k_pages"].shape[0])),
     r"block_tables\[1, 0\]"),
    (lambda b: dict(block_tables=b["block_tables"].at[0, 1].set(-1)), "not a page id"),
    (lambda b: dict(seq_lens=b["seq_lens"].at[0].set(1000)), "seq_lens must lie"),
    (lambda b: dict(query_start_loc=jnp.asarray([0, 3, 2, 2], jnp.int32)), "must rise"),
    (lambda b: dict(seq_lens=b["seq_lens"].at[0].set(1)), "q_len 2 > seq_len 1"),
])
def test_ragged_rejects_bad_inputs(change, match):
    batch = _small_batch()
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(**_with(batch, **change(batch)), interpret=True)


def test_rejects_bad_options_and_configs():
    batch = _small_batch()
    for opts, match in [(dict(sliding_window=0), "sliding_window=0"),
                        (dict(num_sinks=-1), "num_sinks=-1"),
                        (dict(soft_cap=0.0), "soft_cap=0.0"),
                        (dict(sm_scale=-1.0), "sm_scale=-1.0"),
                        (dict(config=RaggedConfig(block_q=1, block_kv=16)), "16 rows")]:
        with pytest.raises(ValueError, match=match):
            ragged_paged_attention(**batch, interpret=True, **opts)
    odd = make_batch(np.random.default_rng(2), [1], [4], Hq=2, Hkv=1, D=24, bs=4)
    with pytest.raises(ValueError, match="power of two"):
        ragged_paged_attention(**odd, interpret=True)
    for bad in (dict(block_q=3, block_kv=16), dict(block_q=4, block_kv=8),
                dict(block_q=4, block_kv=16, num_stages=0)):
        with pytest.raises(ValueError):
            RaggedConfig(**bad)
    with pytest.raises(ValueError, match="block_kv=8"):
        DecodeConfig(block_kv=8)

    decode = {k: v for k, v in batch.items() if k != "query_start_loc"}
    decode["q"] = decode["q"][:3]
    with pytest.raises(ValueError, match="num_splits=0"):
        paged_decode_attention(**decode, num_splits=0, interpret=True)
    with pytest.raises(ValueError, match="S = 3"):
        paged_decode_attention(**_with(decode, q=decode["q"][:2]), interpret=True)
    with pytest.raises(ValueError, match="not a page id"):
        paged_decode_attention(**_with(decode, block_tables=decode["block_tables"] + 100),
                               interpret=True)
    with pytest.raises(ValueError, match="not a page id"):
        check_page_ids(np.array([[0, 5]], np.int32), num_blocks=5)


# ---------------------------------------------------------------------------------------------
# CUDA lowering on CPU (Triton): catches Pallas lowering errors without a GPU
# ---------------------------------------------------------------------------------------------

# Lowering for an abstract H200 (jax >= 0.11 asks which GPU when no GPU is attached).
H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))

OPTION_SETS = {
    "plain": {},
    "window": dict(sliding_window=128),
    "window-sinks": dict(sliding_window=128, num_sinks=4),
    "softcap": dict(soft_cap=30.0),
    "all": dict(sliding_window=256, num_sinks=4, soft_cap=50.0),
}


def _lower_for_cuda(f, *avals):
    with jax.sharding.use_abstract_mesh(H200):
        text = jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def _avals(num_tokens, Hq, Hkv, D, dtype, *, num_seqs=4, num_blocks=300, bs=16, max_blocks=64,
           ragged=True):
    avals = [jax.ShapeDtypeStruct((num_tokens, Hq, D), dtype),
             jax.ShapeDtypeStruct((num_blocks, bs, Hkv, D), dtype),
             jax.ShapeDtypeStruct((num_blocks, bs, Hkv, D), dtype),
             jax.ShapeDtypeStruct((num_seqs, max_blocks), jnp.int32),
             jax.ShapeDtypeStruct((num_seqs,), jnp.int32)]
    return avals + [jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32)] if ragged else avals


@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_ragged_lowers_to_cuda(options, dtype):
    opts = OPTION_SETS[options]
    for T, Hq, Hkv, D in [(256, 32, 8, 128), (8, 9, 3, 64), (64, 8, 8, 64), (32, 64, 8, 128)]:
        _lower_for_cuda(functools.partial(ragged_paged_attention, **opts, return_lse=True),
                        *_avals(T, Hq, Hkv, D, dtype, num_seqs=8))


@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_decode_lowers_to_cuda(options, dtype):
    opts = OPTION_SETS[options]
    for S, Hq, Hkv, D, splits in [(8, 32, 8, 128, 1), (2, 9, 3, 64, 4), (4, 64, 8, 128, None)]:
        _lower_for_cuda(functools.partial(paged_decode_attention, **opts, num_splits=splits),
                        *_avals(S, Hq, Hkv, D, dtype, num_seqs=S, ragged=False))


def test_kept_walk_lowers_to_cuda():
    """Without a window both kernels walk the kept blocks (the compaction passed as two more
    whole-array refs); tiles of several blocks and tiles inside one block both lower."""
    for bs, block_kv in ((16, 128), (64, 32)):
        avals = _avals(64, 32, 8, 128, jnp.bfloat16, num_seqs=8, bs=bs, max_blocks=32)
        _lower_for_cuda(functools.partial(ragged_paged_attention, soft_cap=30.0,
                                          config=RaggedConfig(block_q=4, block_kv=block_kv)),
                        *avals)
        _lower_for_cuda(functools.partial(paged_decode_attention, num_splits=4,
                                          config=DecodeConfig(block_kv=block_kv)),
                        *_avals(8, 32, 8, 128, jnp.bfloat16, num_seqs=8, bs=bs, max_blocks=32,
                                ragged=False))


def test_configs_lower_to_cuda():
    for config in (RaggedConfig(block_q=8, block_kv=128, num_warps=8, num_stages=3),
                   RaggedConfig(block_q=32, block_kv=32, num_warps=4, num_stages=1)):
        _lower_for_cuda(functools.partial(ragged_paged_attention, config=config),
                        *_avals(512, 32, 8, 128, jnp.bfloat16))
    for config in (DecodeConfig(block_kv=128, num_warps=8, num_stages=2),
                   DecodeConfig(block_kv=16, num_warps=2, num_stages=4)):
        _lower_for_cuda(functools.partial(paged_decode_attention, config=config, num_splits=8),
                        *_avals(16, 32, 8, 128, jnp.bfloat16, num_seqs=16, ragged=False))


# ---------------------------------------------------------------------------------------------
# bench/gpu_check.py keeps working
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    """Every section of bench/gpu_check.py on tiny sizes (its --quick selection and archives:
    tests/test_gpu_check.py)."""
    path = os.path.join(ROOT, "bench", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["sections_s"]) == list(gpu_check.SECTIONS) and not report["skipped"]
    ours, peer = report["correctness"]["ours"], report["correctness"]["peer"]
    # bf16 and fp32: ragged, split-K at 1 and auto splits on 3 option sets, sparse on 2 (11
    # each); fp8, int8, KIVI int4/int2 sealed and written: ragged, split-K, sparse (18)
    assert len(ours) == 40 and all(r["ok"] for r in ours) and len(peer) == 1
    assert {r["pool"] for r in ours} == {"bfloat16", "float32", "fp8_e4m3", "int8", "int4",
                                         "int2", "int4 written", "int2 written"}
    assert {(r["kernel"], r["variant"]) for r in ours if r["pool"] == "float32"} == {
        (k, v) for k in ("ragged", "decode splits=1", "decode splits=auto")
        for v in ("plain", "window+sinks", "softcap")} | {("sparse", "plain"),
                                                          ("sparse", "softcap")}
    assert report["decode"] and all(r["ours_ms"] > 0 for r in report["decode"])
    quant = {r["kv_cache_dtype"] for r in report["decode"] if "kv_cache_dtype" in r}
    assert quant == {"fp8_e4m3", "int8", "int4", "int2"}
    assert len(report["sparse"]) == 2 and all(r["ok"] for r in report["sparse"])
    kept = report["kept"]
    assert kept and all(r["ok"] and r["kept_bytes"] < r["dense_bytes"] for r in kept)
    assert len(report["prefill"]) == 5 and all(r["tflops"] > 0 for r in report["prefill"])
    assert report["copy_gbps"] > 0 and report["sweep"]
    # (e): the engine's host pool with and without pinned_host staging (the CPU has that memory)
    pools = [r for r in report["offload"] if r["path"].startswith("HostKVPool")]
    assert {r["path"] for r in pools} == {"HostKVPool staging=none",
                                          "HostKVPool staging=pinned_host"}
    assert all(r["d2h_gbps"] > 0 and r["h2d_gbps"] > 0 for r in report["offload"])
    # (f): jaxkv.LLM end to end on two tiny random models (tied; untied GQA 4), bf16 and fp8 KV,
    # Pallas attention in interpret mode
    e2e = report["e2e"]
    assert [(r["model"].split(" (")[0], r["kv_cache_dtype"], r["batch"]) for r in e2e] == [
        ("tiny", "bf16", 1), ("tiny", "bf16", 4), ("tiny", "fp8_e4m3", 4),
        ("tiny untied", "bf16", 4), ("tiny untied", "fp8_e4m3", 4)]
    assert all(r["ok"] and r["tokens_per_s"] > 0 and r["recompiles"] == 0
               and 0 <= r["host_share"] <= 1 and 0 <= r["host_share_all"] <= 1
               and r["decode_steps"] > 0 and r["attention_impl"] == "pallas" for r in e2e)
    # every executable compiled, archived, and the archived copy loaded back and used
    assert report["executables"]
    assert all(r["how"] == "compile+load" for r in report["executables"])
    assert report["artifacts"]["saved"] == str(tmp_path / "artifacts" / "cpu.zip")
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| batch |" in md and "## (b4) kept-blocks decode" in md
    assert "## (f) end to end" in md and "compile+load:" in md
