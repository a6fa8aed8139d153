"""Quest sparse attention (jaxkv.attention.quest, jaxkv.attention.pallas.sparse).

Key bounds kept on write == from scratch (exact, through block reuse and a copy-on-write fork);
KIVI bounds from the stored statistics bound (tightly) the dequantized keys; page scores bound the
true logits; selection against a brute-force oracle and a hand-built case (exact ids); the sparse
reference == the dense reference at full budget and == a numpy softmax over the selected
positions; the Pallas kernel (interpret mode) == the sparse reference on float32, bf16, int8,
fp8, int4 and int2 pools (GQA 1 and 4, several budgets, splits and tiles, permuted block ids);
the kernel reads nothing outside the selection (NaN elsewhere changes nothing) and lowers to
CUDA (Triton); Quest finds a needle page that sinks + recent window miss.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.pallas import SparseConfig, sparse_paged_decode_attention
from jaxkv.attention.quest import (KeyBounds, copy_key_bounds, init_key_bounds, key_bounds,
                                   min_budget, page_bounds, page_scores, quest_decode_reference,
                                   quest_select, select_pages, sparse_decode_reference,
                                   update_key_bounds, written_keys)
from jaxkv.attention.reference import paged_attention_reference
from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pools import read_pages
from jaxkv.kvcache.spec import KVCacheSpec
from bench.lib.ragged_batches import table_batch

# jax >= 0.11 deprecates the Triton backend (still present in 0.12); the kernel uses it on purpose
pytestmark = [pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated"),
              pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")]

HKV, BS = 2, 8
F32 = dict(atol=2e-5, rtol=2e-5)
TOL = {"float32": F32, "bfloat16": dict(atol=3e-2, rtol=3e-2)}
KIVI = ("int4", "int2")
# one shape for every built cache (padding sequences of length 0, spare blocks), so each format
# compiles its writes, reads and references once
PAD_TOKENS = 64       # tokens per write step
SEQS, MAX_BLOCKS, NUM_BLOCKS = 4, 14, 64


@jax.jit
def write_step(c, new_k, new_v, md, bounds):
    """``cache.write`` of one step, and the bounds kept on write (None for KIVI pools)."""
    c = kvcache.write(c, 0, new_k, new_v, md.slot_mapping, md)
    if bounds is not None:
        bounds = update_key_bounds(bounds, written_keys(c.k[0], md.slot_mapping),
                                   md.slot_mapping, c.block_size)
    return c, bounds


def padded_slots(slots):
    """int32 [PAD_TOKENS]: ``slots`` then padding tokens in the null block."""
    assert len(slots) < PAD_TOKENS
    return jnp.asarray(np.pad(np.asarray(slots, np.int32), (0, PAD_TOKENS - len(slots))))


def build(kv, lens, *, d=64, hq=4, residual_blocks=1, steps=3, seed=0, dtype="float32",
          key_axis="channel"):
    """One layer of a cache of format ``kv`` holding random K/V of sequences of ``lens`` tokens,
    then padding sequences up to ``SEQS`` (block tables [SEQS, MAX_BLOCKS] from a random
    permutation of page ids 1..NUM_BLOCKS-1), written the serving way: ``steps``
    chunks per sequence through ``cache.write`` (KIVI: with its residual window), a padding
    token in the null block each step, and the key bounds kept on write.

    Returns:
      dict(q [SEQS, hq, d] in ``dtype``, k_pages, v_pages, block_tables, seq_lens), KeyBounds
      (None for KIVI).
    """
    rng = np.random.default_rng(seed)
    lens = list(lens) + [0] * (SEQS - len(lens))
    S, num_blocks = SEQS, NUM_BLOCKS
    tables, seq_lens, _ = table_batch(rng, [1] * S, lens, T=S, S=S, max_blocks=MAX_BLOCKS,
                                      num_blocks=num_blocks, bs=BS)
    spec = KVCacheSpec(num_layers=1, num_blocks=num_blocks, block_size=BS, num_kv_heads=HKV,
                       head_dim=d, dtype=dtype, kv_cache_dtype=kv, group_size=16,
                       residual_blocks=residual_blocks, key_axis=key_axis,
                       num_residual_slots=residual_blocks * S + 1)
    c = kvcache.init_cache(spec)
    kivi = spec.format.kivi
    bounds = None if kivi else init_key_bounds(num_blocks, HKV, d)
    tab = np.asarray(tables)
    cuts = [np.linspace(0, n, steps + 1).astype(int) for n in lens]
    for i in range(steps):
        pos = [np.arange(cut[i], cut[i + 1]) for cut in cuts]
        slots = padded_slots(np.concatenate([tab[s, p // BS] * BS + p % BS
                                             for s, p in enumerate(pos)]))
        qsl = np.concatenate([[0], np.cumsum([len(p) for p in pos])]).astype(np.int32)
        md = AttentionMetadata(slot_mapping=slots, query_start_loc=jnp.asarray(qsl),
                               seq_lens=jnp.asarray([cut[i + 1] for cut in cuts], jnp.int32),
                               block_tables=tables)
        new = jnp.asarray(rng.standard_normal((2, PAD_TOKENS, HKV, d)) + np.linspace(-1, 1, d),
                          jnp.float32)
        c, bounds = write_step(c, new[0], new[1], md, bounds)
    q = jnp.asarray(rng.standard_normal((S, hq, d)), dtype)
    return dict(q=q, k_pages=c.k[0], v_pages=c.v[0], block_tables=tables,
                seq_lens=seq_lens), bounds


def decode_qsl(S):
    return jnp.arange(S + 1, dtype=jnp.int32)


# ---------------------------------------------------------------------------------------------
# key bounds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8", "fp8_e4m3"])
def test_bounds_on_write_equal_bounds_from_scratch(kv):
    """Chunked writes, a freed block reused by another sequence (rewritten from offset 0) and a
    copy-on-write fork of a partial block: the kept bounds equal ``key_bounds`` bit for bit on
    every block a sequence holds."""
    rng = np.random.default_rng(1)
    n, d = 12, 16
    c = kvcache.init_cache(KVCacheSpec(num_layers=1, num_blocks=n, block_size=BS,
                                       num_kv_heads=HKV, head_dim=d, kv_cache_dtype=kv))
    bounds = init_key_bounds(n, HKV, d)

    def write(c, bounds, table, positions):
        slots = padded_slots([table[p // BS] * BS + p % BS for p in positions])
        new = jnp.asarray(rng.standard_normal((2, PAD_TOKENS, HKV, d)) * 3, jnp.float32)
        md = AttentionMetadata(slot_mapping=slots, query_start_loc=jnp.zeros(2, jnp.int32),
                               seq_lens=jnp.zeros(1, jnp.int32),
                               block_tables=jnp.zeros((1, 1), jnp.int32))
        return write_step(c, new[0], new[1], md, bounds)

    a, b = [5, 2, 9], [7, 3]
    c, bounds = write(c, bounds, a, range(0, 14))              # A: 14 tokens, then B's prompt
    c, bounds = write(c, bounds, b, range(0, 11))
    c, bounds = write(c, bounds, a, range(14, 20))             # A and B decode / chunk
    c, bounds = write(c, bounds, b, range(11, 12))
    # A finishes; its block 2 goes to C, rewritten from offset 0 (bounds restart)
    cc = [2, 4]
    c, bounds = write(c, bounds, cc, range(0, 13))
    # fork B into D: D shares B's full block 7 and gets a copy (block 10) of B's partial block 3
    src, dst = jnp.asarray([3], jnp.int32), jnp.asarray([10], jnp.int32)
    c = kvcache.copy_blocks(c, src, dst)
    bounds = copy_key_bounds(bounds, src, dst)
    dd = [7, 10]
    c, bounds = write(c, bounds, b, range(12, 14))
    c, bounds = write(c, bounds, dd, range(12, 15))
    tables = jnp.asarray([b, cc, dd], jnp.int32)
    lens = jnp.asarray([14, 13, 15], jnp.int32)
    want = key_bounds(c.k[0], tables, lens)
    held = np.asarray([7, 3, 2, 4, 10])
    for got, exp in ((bounds.kmin, want.kmin), (bounds.kmax, want.kmax)):
        np.testing.assert_array_equal(np.asarray(got)[held], np.asarray(exp)[held])
    unheld = np.setdiff1d(np.arange(n), held)
    assert np.all(np.asarray(want.kmin)[unheld] == 0) and np.all(np.asarray(want.kmax)[unheld] == 0)
    # the bounds of C's block 2 no longer see A's keys: they are C's own
    k2 = np.asarray(read_pages(c.k[0], jnp.asarray([2])))[0]          # [bs, Hkv, D]
    np.testing.assert_array_equal(np.asarray(bounds.kmin)[2], k2.min(0))


@pytest.mark.parametrize("kv", KIVI)
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_kivi_bounds_bound_the_dequantized_keys(kv, axis):
    """Sealed KIVI blocks: every dequantized key lies in [lo, hi] derived from the stored
    scale/zero; with KIVI's per-channel keys the bounds are attained (codes 0 and qmax occur in
    every channel of a block)."""
    batch, _ = build(kv, [37, 16, 8], residual_blocks=2, key_axis=axis)
    k = batch["k_pages"]
    lo, hi = (np.asarray(a) for a in page_bounds(k, batch["block_tables"]))  # [S, P, Hkv, D]
    tables = np.asarray(batch["block_tables"])
    checked = 0
    for s, n in enumerate(np.asarray(batch["seq_lens"])):
        for j in range(n // BS):                              # sealed blocks, read as codes
            keys = np.asarray(read_pages(k, jnp.asarray([tables[s, j]]),
                                                 jnp.asarray([False])))[0]  # [bs, Hkv, D]
            assert np.all(keys >= lo[s, j]) and np.all(keys <= hi[s, j] + 1e-6 * np.abs(hi[s, j]))
            if axis == "channel":
                np.testing.assert_array_equal(keys.min(0), lo[s, j])
                np.testing.assert_allclose(keys.max(0), hi[s, j], rtol=1e-6, atol=1e-6)
            checked += 1
    assert checked == 4 + 2 + 1


# ---------------------------------------------------------------------------------------------
# page scores
# ---------------------------------------------------------------------------------------------


def true_page_max(batch, window_ok=None):
    """float64 [S, Hkv, P]: max over the G heads of a kv head and the live positions of a page
    of q . k (the dequantized keys attention reads), -inf for pages without a live position;
    ``window_ok(s, j)`` False leaves page j of sequence s out (-inf)."""
    q = np.asarray(batch["q"], np.float64)
    S, Hq, D = q.shape
    keys = np.asarray(read_pages(batch["k_pages"], batch["block_tables"]), np.float64)
    P = keys.shape[1]
    logits = np.einsum("shgd,spbhd->shpbg", q.reshape(S, HKV, Hq // HKV, D), keys)
    pos = np.arange(P * BS).reshape(P, BS)
    live = pos[None] < np.asarray(batch["seq_lens"])[:, None, None]               # [S, P, bs]
    if window_ok is not None:
        live &= np.array([[window_ok(s, j) for j in range(P)] for s in range(S)])[..., None]
    return np.where(live[:, None, :, :, None], logits, -np.inf).max(axis=(3, 4))


def direct_scores(q, lo, hi):
    """float64 [S, Hkv, P]: max_g Σ_c max(q_gc lo_c, q_gc hi_c), written as in the paper."""
    q = np.asarray(q, np.float64)
    S, Hq, D = q.shape
    qg = q.reshape(S, HKV, 1, Hq // HKV, D)
    lo, hi = (np.asarray(a, np.float64).transpose(0, 2, 1, 3)[:, :, :, None] for a in (lo, hi))
    return np.maximum(qg * lo, qg * hi).sum(-1).max(-1)


@pytest.mark.parametrize("kv,hq", [("fp32", 2), ("int8", 8), ("int4", 8), ("int2", 2)])
def test_scores_are_upper_bounds_of_the_page_logits(kv, hq):
    batch, bounds = build(kv, [45, 9, 24], hq=hq, residual_blocks=2, seed=3)
    k = batch["k_pages"]
    got = np.asarray(page_scores(batch["q"], bounds if bounds is not None else k,
                                 batch["block_tables"]))
    lo, hi = page_bounds(bounds if bounds is not None else k, batch["block_tables"])
    np.testing.assert_allclose(got, direct_scores(batch["q"], lo, hi), rtol=1e-5, atol=1e-4)
    lens = np.asarray(batch["seq_lens"])
    # KIVI: only sealed pages outside the residual window are read as codes (the others are
    # always attended, whatever they score)
    ok = None if bounds is not None else (lambda s, j: j < lens[s] // BS - 1)
    true = true_page_max(batch, ok)
    scored = np.isfinite(true)
    assert scored.sum() >= 2 * HKV * 3
    assert np.all(got[scored] >= true[scored] - 1e-4 * (1 + np.abs(true[scored])))


# ---------------------------------------------------------------------------------------------
# selection
# ---------------------------------------------------------------------------------------------


def select_oracle(scores, lens, *, bs, budget, num_sinks, recent, residual_blocks=1):
    """Brute-force selection: forced pages, then the best scores (stable: lower page first)."""
    S, H, P = scores.shape
    pages = np.zeros((S, H, budget), np.int32)
    count = np.zeros((S, H), np.int32)
    for s in range(S):
        n = -(-lens[s] // bs)
        forced = {j for j in range(n)
                  if j * bs < num_sinks or (j + 1) * bs > lens[s] - recent
                  or j >= lens[s] // bs - (residual_blocks - 1)}
        for h in range(H):
            rest = sorted((j for j in range(n) if j not in forced), key=lambda j: -scores[s, h, j])
            chosen = sorted(forced | set(rest[:max(0, budget - len(forced))]))
            count[s, h] = len(chosen)
            pages[s, h, :len(chosen)] = chosen
    return pages, count


def test_select_pages_hand_built():
    """bs 4, sinks 4 tokens (page 0), recent 5 tokens, budget 4 pages."""
    scores = np.zeros((3, 2, 7), np.float32)
    scores[0, 0] = [9, 1, 7, 3, 0, 0, 5]        # live pages 0..5: forced 0, 4, 5; best of 1-3: 2
    scores[0, 1] = [0, 2, 2, 2, 0, 0, 9]        # a tie among 1, 2, 3: the lowest page wins
    scores[1] = [0, 5, 5, 0, 0, 0, 0]           # 9 tokens: pages 0 (sink), 1, 2 (recent) forced
    lens = np.array([23, 9, 0], np.int32)       # sequence 2 is padding
    pages, count = select_pages(jnp.asarray(scores), jnp.asarray(lens), block_size=4, budget=4,
                                num_sinks=4, recent=5)
    np.testing.assert_array_equal(count, [[4, 4], [3, 3], [0, 0]])
    np.testing.assert_array_equal(pages, [[[0, 2, 4, 5], [0, 1, 4, 5]],
                                          [[0, 1, 2, 0], [0, 1, 2, 0]],
                                          [[0, 0, 0, 0], [0, 0, 0, 0]]])
    # a KIVI residual window of 3 blocks forces pages 3, 4, 5 of the 23-token sequence
    pages, count = select_pages(jnp.asarray(scores), jnp.asarray(lens), block_size=4, budget=5,
                                num_sinks=4, recent=1, residual_blocks=3)
    np.testing.assert_array_equal(pages[0], [[0, 2, 3, 4, 5], [0, 1, 3, 4, 5]])
    # 5 recent tokens span at most 2 pages of 4: with the sink page, 3 pages may be forced
    assert min_budget(4, num_sinks=4, recent=5) == 3
    assert min_budget(4, num_sinks=4, recent=1, residual_blocks=3) == 4
    with pytest.raises(ValueError, match="budget=2 pages"):
        select_pages(jnp.asarray(scores), jnp.asarray(lens), block_size=4, budget=2,
                     num_sinks=4, recent=5)
    with pytest.raises(ValueError, match="recent=0"):
        select_pages(jnp.asarray(scores), jnp.asarray(lens), block_size=4, budget=4, recent=0)


@pytest.mark.parametrize("budget,num_sinks,recent,residual_blocks",
                         [(3, 0, 1, 1), (4, 5, 9, 1), (6, 1, 17, 2), (12, 8, 8, 3), (40, 3, 3, 1)])
def test_select_pages_matches_brute_force(budget, num_sinks, recent, residual_blocks):
    rng = np.random.default_rng(budget)
    lens = np.array([0, 1, 8, 9, 40, 95, 96, 17], np.int32)
    scores = rng.integers(0, 6, (8, 3, 12)).astype(np.float32)         # many ties
    pages, count = select_pages(jnp.asarray(scores), jnp.asarray(lens), block_size=BS,
                                budget=budget, num_sinks=num_sinks, recent=recent,
                                residual_blocks=residual_blocks)
    want_pages, want_count = select_oracle(scores, lens, bs=BS, budget=budget,
                                           num_sinks=num_sinks, recent=recent,
                                           residual_blocks=residual_blocks)
    np.testing.assert_array_equal(count, want_count)
    np.testing.assert_array_equal(pages, want_pages)
    assert pages.shape == (8, 3, budget) and pages.dtype == jnp.int32


# ---------------------------------------------------------------------------------------------
# the sparse reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv,hq,opts", [("fp32", 2, {}), ("bf16", 8, dict(soft_cap=5.0)),
                                        ("int8", 8, dict(sm_scale=0.3)), ("int4", 2, {})])
def test_full_budget_equals_dense_reference(kv, hq, opts):
    dtype = "bfloat16" if kv == "bf16" else "float32"
    batch, bounds = build(kv, [45, 9, 24], hq=hq, residual_blocks=2, seed=4, dtype=dtype)
    out, lse = quest_decode_reference(**batch, budget=MAX_BLOCKS, bounds=bounds, num_sinks=3,
                                      recent=4, return_lse=True, **opts)
    want, want_lse = paged_attention_reference(**batch, query_start_loc=decode_qsl(SEQS),
                                               return_lse=True, **opts)
    assert out.dtype == want.dtype
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), **tol)
    np.testing.assert_allclose(lse[:3], want_lse[:3], **F32)
    assert np.all(np.asarray(out[3]) == 0) and np.all(np.isneginf(np.asarray(lse[3])))


def test_sparse_reference_is_softmax_over_the_selected_positions():
    batch, bounds = build("fp32", [45, 9, 24], hq=4, seed=5)
    pages, count = quest_select(batch["q"], batch["k_pages"], batch["block_tables"],
                                batch["seq_lens"], budget=3, bounds=bounds, num_sinks=1)
    assert np.asarray(count).tolist() == [[3, 3], [2, 2], [3, 3], [0, 0]]
    out = np.asarray(sparse_decode_reference(**batch, pages=pages, count=count, soft_cap=4.0))
    q = np.asarray(batch["q"], np.float64)
    k, v = (np.asarray(batch[n], np.float64) for n in ("k_pages", "v_pages"))
    tables, lens = np.asarray(batch["block_tables"]), np.asarray(batch["seq_lens"])
    for s in range(3):
        for h in range(HKV):
            pos = [p for j in np.asarray(pages)[s, h, :int(count[s, h])]
                   for p in range(j * BS, min((j + 1) * BS, lens[s]))]
            assert (lens[s] - 1) in pos and 0 in pos
            ks = np.stack([k[tables[s, p // BS], p % BS, h] for p in pos])
            vs = np.stack([v[tables[s, p // BS], p % BS, h] for p in pos])
            for g in range(2):
                logits = 4.0 * np.tanh(ks @ q[s, h * 2 + g] / np.sqrt(64) / 4.0)
                w = np.exp(logits - logits.max())
                np.testing.assert_allclose(out[s, h * 2 + g], w @ vs / w.sum(), **F32)


def test_quest_select_needs_bounds_for_non_kivi_pools():
    batch, bounds = build("int8", [9], hq=2, steps=1)
    with pytest.raises(ValueError, match="KeyBounds"):
        quest_select(batch["q"], batch["k_pages"], batch["block_tables"], batch["seq_lens"],
                     budget=2)
    with pytest.raises(ValueError, match="need no KeyBounds"):
        written_keys(build("int4", [9], hq=2, steps=1)[0]["k_pages"], jnp.zeros(1, jnp.int32))
    assert isinstance(bounds, KeyBounds)


# ---------------------------------------------------------------------------------------------
# the Pallas kernel (interpret mode)
# ---------------------------------------------------------------------------------------------

KERNEL_CASES = {
    "fp32-g1-budget3": dict(kv="fp32", hq=2, budget=3, splits=None, config=None),
    "fp32-g4-budget5-2splits-bkv16": dict(kv="fp32", hq=8, budget=5, splits=2,
                                          config=SparseConfig(block_kv=16)),
    "fp32-g4-full-3splits-bkv32": dict(kv="fp32", hq=8, budget=8, splits=3,
                                       config=SparseConfig(block_kv=32, num_stages=2)),
    "bf16-g4-budget4": dict(kv="bf16", hq=8, budget=4, splits=2, config=None),
    "bf16-g1-budget6": dict(kv="bf16", hq=2, budget=6, splits=None, config=None),
    "int8-g4-budget4": dict(kv="int8", hq=8, budget=4, splits=2, config=None),
    "int8-g1-budget6": dict(kv="int8", hq=2, budget=6, splits=1, config=None),
    "fp8-g4-budget5": dict(kv="fp8_e4m3", hq=8, budget=5, splits=None, config=None),
    "fp8-g1-budget3": dict(kv="fp8_e4m3", hq=2, budget=3, splits=2, config=None),
    "int4-g4-budget4": dict(kv="int4", hq=8, budget=4, splits=2, config=None),
    "int4-g1-budget6-bkv16": dict(kv="int4", hq=2, budget=6, splits=None,
                                  config=SparseConfig(block_kv=16)),
    "int2-g4-budget5": dict(kv="int2", hq=8, budget=5, splits=2, config=None),
    "int2-g1-budget4": dict(kv="int2", hq=2, budget=4, splits=1, config=None),
}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_sparse_reference(name):
    case = KERNEL_CASES[name]
    dtype = "bfloat16" if case["kv"] == "bf16" else "float32"
    # 59 tokens: 7 full pages and a tail; 9: a sealed page and a tail; then a padding sequence
    batch, bounds = build(case["kv"], [59, 9, 24], hq=case["hq"], residual_blocks=2,
                          seed=sorted(KERNEL_CASES).index(name), dtype=dtype)
    pages, count = quest_select(batch["q"], batch["k_pages"], batch["block_tables"],
                                batch["seq_lens"], budget=case["budget"], bounds=bounds,
                                num_sinks=3, recent=2)
    opts = dict(soft_cap=6.0) if "g4" in name else dict(sm_scale=0.2)
    out, lse = sparse_paged_decode_attention(**batch, pages=pages, count=count,
                                             num_splits=case["splits"], config=case["config"],
                                             return_lse=True, interpret=True, **opts)
    want, want_lse = sparse_decode_reference(**batch, pages=pages, count=count,
                                             return_lse=True, **opts)
    assert out.dtype == want.dtype and out.shape == want.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               **TOL[dtype])
    np.testing.assert_allclose(lse[:3], want_lse[:3], **TOL[dtype])
    assert np.all(np.asarray(out[3]) == 0) and np.all(np.isneginf(np.asarray(lse[3])))


def test_kernel_reads_only_the_selected_pages():
    """Pages a kv head did not select (the null block included) and the entries of ``pages``
    past ``count`` may hold anything: NaNs there change nothing."""
    batch, bounds = build("fp32", [97, 20], hq=4, seed=9)     # 20 tokens: 3 pages < budget
    pages, count = quest_select(batch["q"], batch["k_pages"], batch["block_tables"],
                                batch["seq_lens"], budget=4, bounds=bounds)
    assert np.asarray(count).tolist() == [[4, 4], [3, 3], [0, 0], [0, 0]]
    want = sparse_paged_decode_attention(**batch, pages=pages, count=count, interpret=True)
    tables = np.asarray(batch["block_tables"])
    selected = np.zeros((batch["k_pages"].shape[0], HKV), bool)           # [block, kv head]
    for s in range(2):
        for h in range(HKV):
            selected[tables[s, np.asarray(pages)[s, h, :int(count[s, h])]], h] = True
    assert not selected[0].any() and (~selected[1:]).sum() >= 4
    poison = jnp.asarray(~selected)[:, None, :, None]                    # [N, 1, Hkv, 1]
    k, v = (jnp.where(poison, jnp.nan, batch[n]) for n in ("k_pages", "v_pages"))
    past = jnp.where(jnp.arange(4) < count[..., None], pages, 12)    # page 12 of sequence 1: null
    got = sparse_paged_decode_attention(**{**batch, "k_pages": k, "v_pages": v}, pages=past,
                                        count=count, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_rejects_bad_selections():
    batch, bounds = build("fp32", [20, 9], hq=2, steps=1)
    pages, count = quest_select(batch["q"], batch["k_pages"], batch["block_tables"],
                                batch["seq_lens"], budget=2, bounds=bounds)
    for change, match in [(dict(pages=pages[:, :1]), "pages must be"),
                          (dict(count=count[:1]), "count must be"),
                          (dict(pages=pages.astype(jnp.int16)), "pages must be int32"),
                          (dict(count=count + 1), "count must lie"),
                          (dict(pages=pages.at[0, 1, 0].set(99)), r"pages\[0, 1, 0\] = 99")]:
        with pytest.raises(ValueError, match=match):
            sparse_paged_decode_attention(**batch, **{"pages": pages, "count": count, **change},
                                          interpret=True)
    with pytest.raises(ValueError, match="num_splits=0"):
        sparse_paged_decode_attention(**batch, pages=pages, count=count, num_splits=0,
                                      interpret=True)
    with pytest.raises(ValueError, match="block_kv=8"):
        SparseConfig(block_kv=8)


# ---------------------------------------------------------------------------------------------
# CUDA lowering on CPU (Triton)
# ---------------------------------------------------------------------------------------------

# Lowering for an abstract H200 (jax >= 0.11 asks which GPU when no GPU is attached).
H200 = jax.sharding.AbstractMesh(
    (1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))


def _lower_for_cuda(f, *avals):
    with jax.sharding.use_abstract_mesh(H200):
        text = jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("kv", ["bf16", "fp32", "int4"])
def test_kernel_lowers_to_cuda(kv):
    S, Hkv, D, K = 8, 8, 128, 32
    pools = kvcache.abstract_cache(KVCacheSpec(num_layers=1, num_blocks=300, block_size=16,
                                               num_kv_heads=Hkv, head_dim=D, kv_cache_dtype=kv,
                                               dtype="float32" if kv == "fp32" else "bfloat16",
                                               num_residual_slots=17))
    dtype = jnp.float32 if kv == "fp32" else jnp.bfloat16
    meta = [jax.ShapeDtypeStruct((S, 64), jnp.int32), jax.ShapeDtypeStruct((S,), jnp.int32),
            jax.ShapeDtypeStruct((S, Hkv, K), jnp.int32), jax.ShapeDtypeStruct((S, Hkv), jnp.int32)]
    for G, splits, opts in [(1, 1, {}), (4, 4, dict(soft_cap=30.0)), (4, None, {})]:
        q = jax.ShapeDtypeStruct((S, G * Hkv, D), dtype)
        _lower_for_cuda(functools.partial(sparse_paged_decode_attention, num_splits=splits,
                                          **opts), q, pools.k[0], pools.v[0], *meta)


def test_quest_finds_the_needle_page():
    """One page far from the sinks and the recent window holds keys aligned with a head's query:
    Quest selects it with a small budget, and the sparse output stays close to the dense one,
    while the same budget without that page (sinks + recent only) is far off."""
    rng = np.random.default_rng(11)
    S, Hq, D, n = 1, 4, 64, 200                               # 25 pages of 8
    k = rng.standard_normal((NUM_BLOCKS, BS, HKV, D)) * 0.3
    v = rng.standard_normal((NUM_BLOCKS, BS, HKV, D))
    q = rng.standard_normal((S, Hq, D))
    tables, lens, _ = table_batch(rng, [1], [n], T=1, S=S, max_blocks=32,
                                  num_blocks=NUM_BLOCKS, bs=BS)
    needle = int(tables[0, 11])
    k[needle, :, 1] = q[0, 3] + rng.standard_normal((BS, D)) * 0.05        # kv head 1, q head 3
    batch = dict(q=jnp.asarray(q, jnp.float32), k_pages=jnp.asarray(k, jnp.float32),
                 v_pages=jnp.asarray(v, jnp.float32), block_tables=tables, seq_lens=lens)
    bounds = key_bounds(batch["k_pages"], tables, lens)
    pages, count = quest_select(batch["q"], batch["k_pages"], tables, lens, budget=4,
                                bounds=bounds, num_sinks=8, recent=8)
    assert 11 in np.asarray(pages)[0, 1, :int(count[0, 1])]
    dense = np.asarray(paged_attention_reference(**batch, query_start_loc=decode_qsl(S)))
    out = np.asarray(sparse_decode_reference(**batch, pages=pages, count=count))
    blind = np.asarray(sparse_decode_reference(
        **batch, pages=jnp.asarray([[[0, 23, 24, 0]] * HKV], jnp.int32),
        count=jnp.full((1, HKV), 3, jnp.int32)))
    assert np.abs(out[0, 3] - dense[0, 3]).max() < 0.05 < np.abs(blind[0, 3] - dense[0, 3]).max()
