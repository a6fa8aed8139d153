"""The native CPU kernel (jaxkv/cpu_kernels): built on this machine, equal to a float64 numpy
attention over the same paged KV, and used by the grouped CPU path where it applies."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxkv import cpu_kernels
from jaxkv import cache as kvcache
from jaxkv.attention_grouped import native_rows


def numpy_rows(q, k, v, tables, row_pos, soft_cap=None):
    """float64 softmax(q k^T) v of every row over its kept positions <= its row position."""
    S, Hkv, RG, D = q.shape
    bs = k.shape[2]
    R = row_pos.shape[1]
    G = RG // R
    out = np.zeros((S, Hkv, RG, D))
    lse = np.full((S, Hkv, RG), -np.inf)
    for s in range(S):
        for rg in range(RG):
            pos = np.arange(row_pos[s, rg // G] + 1)
            pos = pos[tables[s, pos // bs] != 0]
            if not len(pos):
                continue
            phys = tables[s, pos // bs]
            for h in range(Hkv):
                keys = k[phys, h, pos % bs].astype(np.float64)             # [n, D]
                vals = v[phys, h, pos % bs].astype(np.float64)
                logits = keys @ q[s, h, rg].astype(np.float64)
                if soft_cap:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                m = logits.max()
                p = np.exp(logits - m)
                out[s, h, rg] = p @ vals / p.sum()
                lse[s, h, rg] = m + np.log(p.sum())
    return out, lse


def test_the_kernel_builds_here():
    # CI machines have g++: a build failure must fail here, not fall back silently
    assert cpu_kernels.available()


@pytest.mark.parametrize("R, G, soft_cap", [(1, 3, None), (3, 3, None), (2, 4, 30.0),
                                            (1, 1, None)])
def test_paged_rows_equal_a_numpy_attention(R, G, soft_cap):
    rng = np.random.default_rng(R * 10 + G)
    S, Hkv, D, bs, N, W = 5, 2, 64, 16, 64, 9
    q = rng.standard_normal((S, Hkv, R * G, D), dtype=np.float32) * 0.5
    k = rng.standard_normal((N, Hkv, bs, D), dtype=np.float32)
    v = rng.standard_normal((N, Hkv, bs, D), dtype=np.float32)
    tables = rng.permutation(np.arange(1, N))[:S * W].reshape(S, W).astype(np.int32)
    tables[1, [0, 3]] = 0                                  # dropped blocks (H2O, SnapKV)
    tables[2, :] = 0                                       # nothing kept: zeros and -inf
    seq_lens = np.array([W * bs, 70, 33, 1, 17], np.int32)
    row_pos = seq_lens[:, None] - R + np.arange(R, dtype=np.int32)[None, :]
    row_pos[4, 0] = -1                                     # a row with no query token
    row_pos = np.maximum(row_pos, -1).astype(np.int32)
    out, lse = jax.jit(lambda *a: cpu_kernels.paged_rows(*a, soft_cap=soft_cap))(
        q, k, v, tables, row_pos)
    ref_out, ref_lse = numpy_rows(q, k, v, tables, row_pos, soft_cap)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-5, rtol=1e-5)
    assert np.all(np.asarray(out)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))


def test_grouped_path_takes_the_kernel_for_float_hnd_pools_only():
    f32 = kvcache.HNDPages(jnp.zeros((4, 2, 16, 64), jnp.float32))
    bf16 = kvcache.HNDPages(jnp.zeros((4, 2, 16, 64), jnp.bfloat16))
    nhd = jnp.zeros((4, 16, 2, 64), jnp.float32)
    assert native_rows(f32, f32, None)
    assert not native_rows(f32, f32, 256)                   # windows (and sinks): the XLA loop
    assert not native_rows(bf16, bf16, None)
    assert not native_rows(nhd, nhd, None)
