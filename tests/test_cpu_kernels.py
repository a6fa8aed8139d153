"""The native CPU kernels (jaxkv/cpu_kernels): built on this machine, the attention equal to a
float64 numpy attention over the same paged KV and used by the grouped CPU path where it applies
(every pool it reads: f32, bf16/f16, int8/fp8 codes, each code decoded exactly), the sampler's
row statistics equal to numpy's and to the XLA path's."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxkv import cpu_kernels
from jaxkv.attention.grouped import native_rows
from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache.pools import HNDPages


def numpy_attend(q, k, v, table, pos, soft_cap=None):
    """float64 softmax(q k^T) v of one query [D] of one kv head's pools [N, bs, D] over the
    kept positions <= ``pos`` of a table [W]; (0, -inf) if it sees none."""
    bs = k.shape[1]
    kv_pos = np.arange(pos + 1)
    kv_pos = kv_pos[table[kv_pos // bs] != 0]
    if not len(kv_pos):
        return np.zeros(q.shape[-1]), -np.inf
    phys = table[kv_pos // bs]
    logits = k[phys, kv_pos % bs].astype(np.float64) @ q.astype(np.float64)
    if soft_cap:
        logits = soft_cap * np.tanh(logits / soft_cap)
    m = logits.max()
    p = np.exp(logits - m)
    return p @ v[phys, kv_pos % bs].astype(np.float64) / p.sum(), m + np.log(p.sum())


def numpy_rows(q, k, v, tables, row_pos, soft_cap=None):
    """``numpy_attend`` of every row [S, Hkv, R * G] at its row position."""
    S, Hkv, RG, D = q.shape
    G = RG // row_pos.shape[1]
    out = np.zeros((S, Hkv, RG, D))
    lse = np.full((S, Hkv, RG), -np.inf)
    for s, h, rg in np.ndindex(S, Hkv, RG):
        out[s, h, rg], lse[s, h, rg] = numpy_attend(q[s, h, rg], k[:, h], v[:, h], tables[s],
                                                    row_pos[s, rg // G], soft_cap)
    return out, lse


def numpy_tiles(q, k, v, tables, qsl, seq_lens, body, soft_cap=None):
    """``numpy_attend`` of the first ``body[s]`` tokens [T, Hkv, G] of every sequence, each at
    its position in the sequence; zeros and -inf for the other tokens."""
    T, Hkv, G, D = q.shape
    out = np.zeros((T, Hkv, G, D))
    lse = np.full((T, Hkv, G), -np.inf)
    for s in range(len(seq_lens)):
        q_len = qsl[s + 1] - qsl[s]
        for i, h, g in np.ndindex(min(body[s], q_len), Hkv, G):
            t = qsl[s] + i
            out[t, h, g], lse[t, h, g] = numpy_attend(q[t, h, g], k[:, h], v[:, h], tables[s],
                                                      seq_lens[s] - q_len + i, soft_cap)
    return out, lse


def test_the_kernel_builds_here():
    # CI machines have g++: a build failure must fail here, not fall back silently
    assert cpu_kernels.available()


# 5 sequences: a work item per (sequence, kv head); 64: per sequence, all its heads (on up
# to 16 threads), each block's heads read as one run
# D: 64 and 128 take the kernel's register rows (query and accumulator held in vectors), 40
# (not a whole number of vectors) its plain loops; blocks of 5 and 24 positions end in a part
# of the kernel's vector of keys (and 5 is less than one)
@pytest.mark.parametrize("S", [5, 64])
@pytest.mark.parametrize("R, G, soft_cap, D, bs", [(1, 3, None, 64, 16), (3, 3, None, 64, 16),
                                                   (2, 4, 30.0, 64, 16), (1, 1, None, 64, 16),
                                                   (2, 3, None, 128, 16), (1, 2, 30.0, 40, 16),
                                                   (1, 3, None, 64, 5), (2, 3, 30.0, 64, 24)])
def test_paged_rows_equal_a_numpy_attention(R, G, soft_cap, D, bs, S):
    rng = np.random.default_rng(R * 10 + G)
    Hkv, W = 3, max(9, -(-144 // bs))
    N = S * W + 1
    q = rng.standard_normal((S, Hkv, R * G, D), dtype=np.float32) * 0.5
    k = rng.standard_normal((N, Hkv, bs, D), dtype=np.float32)
    v = rng.standard_normal((N, Hkv, bs, D), dtype=np.float32)
    tables = rng.permutation(np.arange(1, N))[:S * W].reshape(S, W).astype(np.int32)
    tables[1, [0, 3]] = 0                                  # dropped blocks (H2O, SnapKV)
    tables[2, :] = 0                                       # nothing kept: zeros and -inf
    seq_lens = np.concatenate([[W * bs, 70, 33, 1, 17], rng.integers(1, W * bs, S - 5)]
                              ).astype(np.int32)
    row_pos = seq_lens[:, None] - R + np.arange(R, dtype=np.int32)[None, :]
    row_pos[4, 0] = -1                                     # a row with no query token
    row_pos = np.maximum(row_pos, -1).astype(np.int32)
    out, lse = jax.jit(lambda *a: cpu_kernels.paged_rows(*a, soft_cap=soft_cap))(
        q, k, v, tables, row_pos)
    ref_out, ref_lse = numpy_rows(q, k, v, tables, row_pos, soft_cap)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))


@pytest.mark.parametrize("G, D, soft_cap", [(3, 64, None), (4, 128, 30.0), (1, 64, None)])
def test_paged_tiles_equal_a_numpy_attention(G, D, soft_cap):
    rng = np.random.default_rng(G * 100 + D)
    Hkv, bs, N, W = 2, 16, 96, 12
    # a prompt's first chunk (70 tokens, 3 tiles), a chunk after a 100-token prefix whose
    # blocks 1 and 4 were dropped, a decode token (all rows: no tile), a 3-token chunk, padding
    q_lens = np.array([70, 45, 1, 3], np.int32)
    seq_lens = np.array([70, 145, 60, 20], np.int32)
    body = np.maximum(q_lens - 1, 0)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(qsl[-1]) + 5
    S = len(q_lens)
    q = rng.standard_normal((T, Hkv, G, D), dtype=np.float32) * 0.3
    k = rng.standard_normal((N, Hkv, bs, D), dtype=np.float32)
    v = rng.standard_normal((N, Hkv, bs, D), dtype=np.float32)
    tables = rng.permutation(np.arange(1, N))[:S * W].reshape(S, W).astype(np.int32)
    tables[1, [1, 4]] = 0
    out, lse = jax.jit(lambda *a: cpu_kernels.paged_tiles(*a, soft_cap=soft_cap))(
        q, k, v, tables, qsl, seq_lens, body)
    ref_out, ref_lse = numpy_tiles(q, k, v, tables, qsl, seq_lens, body, soft_cap)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-5, rtol=1e-5)
    rows = qsl[1:] - 1                                     # each sequence's last token: not here
    assert np.all(np.asarray(out)[rows] == 0) and np.all(np.isneginf(np.asarray(lse)[rows]))


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float8_e5m2", "bfloat16",
                                   "float16"])
def test_coded_pools_decode_every_code_exactly(dtype):
    """Every code of an 8-bit format (every bit pattern of a 16-bit one), NaN and inf codes
    included, read back by the rows kernel: one sequence per block, one position each, so each
    row's output is its block's V row (weight exactly 1), decoded and scaled; equal to numpy's
    (ml_dtypes') conversion times the bf16 scale, bit for bit (a float32 subnormal may be 0)."""
    dt = jnp.dtype(dtype)
    D, bs = 64, 4
    bits = np.arange(1 << (8 * dt.itemsize), dtype=np.uint8 if dt.itemsize == 1 else np.uint16)
    codes = bits.view(dt).reshape(-1, D)                                # [S, D] every code
    S = len(codes)
    token_major = dt.itemsize == 1
    shape = (S + 1, bs, 1, D) if token_major else (S + 1, 1, bs, D)
    v = np.zeros(shape, dt)
    v[1:, 0, 0] = codes                                                 # position 0, head 0
    k = np.zeros(shape, dt)
    tables = np.arange(1, S + 1, dtype=np.int32)[:, None]
    row_pos = np.zeros((S, 1), np.int32)
    q = np.ones((S, 1, 1, D), np.float32)
    scale = 0.375 if token_major else 1.0
    kw = {}
    if token_major:
        sc = jnp.full((S + 1, bs, 1, 1), scale, jnp.bfloat16)
        kw = dict(k_scale=sc, v_scale=sc)
    out, lse = jax.jit(lambda *a: cpu_kernels.paged_rows(*a, **kw))(q, k, v, tables, row_pos)
    got, want = np.asarray(out)[:, 0, 0], codes.astype(np.float32) * np.float32(scale)
    # bf16's subnormals are float32 subnormals, which XLA's threads may flush to zero
    flushed = (got == 0) & (np.abs(want) < np.finfo(np.float32).tiny)
    np.testing.assert_array_equal(np.where(flushed, want, got), want)
    np.testing.assert_array_equal(np.asarray(lse), 0.0)


def test_grouped_path_takes_the_kernel_for_the_pools_it_reads():
    from jaxkv.kvcache.spec import KVCacheSpec

    def pages(dtype, **kw):
        spec = KVCacheSpec(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=2,
                           head_dim=64, kv_cache_dtype=dtype, **kw)
        return kvcache.init_cache(spec).k[0]

    f32 = HNDPages(jnp.zeros((4, 2, 16, 64), jnp.float32))
    bf16 = HNDPages(jnp.zeros((4, 2, 16, 64), jnp.bfloat16))
    nhd = jnp.zeros((4, 16, 2, 64), jnp.float32)
    for p in (f32, bf16, pages("int8"), pages("fp8_e4m3"), pages("fp8_e5m2", static_scale=0.5)):
        assert native_rows(p, p)
    assert not native_rows(nhd, nhd)                        # the Pallas layout
    assert not native_rows(pages("int4"), pages("int4"))    # KIVI: packed, a residual


@pytest.mark.parametrize("M, K, N, transposed", [
    (2, 576, 1536, False), (8, 576, 1536, False), (5, 1536, 576, False), (16, 576, 192, False),
    (3, 70, 37, False), (32, 576, 1536, False), (8, 576, 4096, True), (7, 70, 33, True),
    (1, 64, 10, True), (32, 576, 4096, True)])
def test_matmul_equals_numpy(M, K, N, transposed):
    """x @ w and x @ w.T for a few rows: odd row counts (the last row alone), K not a multiple
    of 4 or of the vector, N past the last whole vector (the column tail), the tied head's
    layout; against float64 numpy."""
    rng = np.random.default_rng(M * K + N)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((N, K) if transposed else (K, N), dtype=np.float32)
    got = jax.jit(lambda a, b: cpu_kernels.matmul(a, b, transposed_w=transposed))(x, w)
    want = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("M, transposed", [(8, False), (3, False), (12, False), (5, True)])
def test_matmuls_of_several_weights_equal_numpy(M, transposed):
    """Several weights in one call (q/k/v, gate/up): each output is its own product, whatever
    the other weights' widths (a tail past the last vector in one of them, one a single
    vector wide), against float64 numpy; up to 8 rows the weights go in slices of rows summed
    afterwards, 12 rows take column blocks."""
    rng = np.random.default_rng(M)
    K, widths = 96, (576, 37, 8, 200)
    x = rng.standard_normal((M, K), dtype=np.float32)
    ws = [rng.standard_normal((n, K) if transposed else (K, n), dtype=np.float32)
          for n in widths]
    got = jax.jit(lambda a, *b: cpu_kernels.matmuls(a, b, transposed_w=transposed))(x, *ws)
    assert len(got) == len(ws)
    for g, w in zip(got, ws):
        want = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
        np.testing.assert_allclose(np.asarray(g), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="do not contract"):
        cpu_kernels.matmuls(x, [ws[0], np.zeros((K + 1, 4), np.float32)])


def test_model_takes_the_matmul_for_small_f32_steps(monkeypatch):
    from jaxkv.model import linear

    calls = []
    monkeypatch.setattr(cpu_kernels, "matmuls", lambda x, ws, **k: calls.append(
        (x.shape, len(ws))) or tuple(jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
                                     for w in ws))
    w = jnp.ones((8, 6, 2), jnp.float32)
    for rows in (1, 2, 32, 33):
        jax.eval_shape(linear.linear, jax.ShapeDtypeStruct((rows, 8), jnp.float32), w)
    jax.eval_shape(linear.linear, jax.ShapeDtypeStruct((4, 8), jnp.bfloat16),
                   w.astype(jnp.bfloat16))
    assert calls == [((2, 8), 1), ((32, 8), 1)]        # 1 row, 33 rows and bf16: XLA's dot
    calls.clear()
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    out = jax.eval_shape(linear.linears, x, (w, jnp.ones((8, 3), jnp.float32)))
    assert calls == [((4, 8), 2)] and [o.shape for o in out] == [(4, 6, 2), (4, 3)]
    jax.eval_shape(linear.linears, x, (w, jnp.ones((8, 3), jnp.bfloat16)))
    assert len(calls) == 1                             # one bf16 weight: all of them XLA's


@pytest.mark.parametrize("S, V", [(1, 49152), (7, 1000), (64, 49152), (3, 13)])
def test_row_stats_equal_numpy_and_the_xla_path(S, V, monkeypatch):
    from jaxkv.sample import sampler

    rng = np.random.default_rng(S + V)
    x = (rng.standard_normal((S, V)) * 4).astype(np.float32)
    x[0, [5, V - 2]] = x[0].max() + 1.0                   # a tie: the first index wins
    if S > 2:
        x[1, V // 2] = np.nan                               # a NaN row: V - 1, NaN, NaN
        x[2, :] = -np.inf                                   # all -inf: 0, -inf, NaN
        x[2, 0 if V < 20 else 17] = np.inf if V > 20 else -np.inf
    first, top, log_norm = map(np.asarray, jax.jit(cpu_kernels.row_stats)(x))
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        want_top = x64.max(axis=-1)
        want_norm = np.log(np.exp(x64 - want_top[:, None]).sum(axis=-1))
    want_first = np.array([np.flatnonzero(r == m)[0] if not np.isnan(m) else V - 1
                           for r, m in zip(x64, want_top)])
    np.testing.assert_array_equal(first, want_first)
    np.testing.assert_array_equal(top, want_top.astype(np.float32))
    # float32 sums of up to 49,152 terms against float64
    np.testing.assert_allclose(log_norm, want_norm, rtol=4e-6, atol=1e-6)
    assert first[0] == 5
    # the XLA path the sampler takes without the kernels: the same argmax and maximum (but for
    # the NaN row: XLA's CPU max skips a NaN)
    monkeypatch.setattr(cpu_kernels, "native", lambda: False)
    xla_first, xla_top, xla_norm = map(np.asarray, jax.jit(sampler.row_stats)(x))
    ok = np.arange(S) != 1
    np.testing.assert_array_equal(xla_first[ok], first[ok])
    np.testing.assert_array_equal(xla_top[ok], top[ok])
    np.testing.assert_allclose(xla_norm[ok], log_norm[ok], rtol=4e-6, atol=1e-6)


def test_a_build_is_logged_before_it_starts(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda *args, **kwargs: None)
    with caplog.at_level("INFO", logger="jaxkv"):
        cpu_kernels._build(tmp_path / "kernels.so")
    first, last = (r.getMessage() for r in caplog.records)
    assert first.startswith("building the native CPU kernels") and str(tmp_path) in first
    assert last.startswith("built the native CPU kernels in")
