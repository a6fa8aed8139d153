"""jaxkv.attention.mass.block_attention_mass against a numpy softmax per observed token (causal,
window + sinks + sink queries, dropped blocks, soft-cap, GQA), its sum rule, and quantized pools
read like the attention reads them; tables with scattered dropped blocks visited by their kept
blocks only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import mass
from jaxkv.attention.mass import block_attention_mass
from jaxkv.attention.reference import paged_attention_reference, token_layout
from jaxkv.kvcache.pools import quantize_pages, read_pages
from bench.lib.ragged_batches import table_batch

BS, HKV, G, D, NB = 4, 2, 2, 16, 48


def _batch(seed, drop=0.0):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = [5, 1, 9, 1, 3], [30, 17, 9, 41, 3]
    tables, lens, qsl = table_batch(rng, q_lens, kv_lens, T=24, S=6, max_blocks=12,
                                    num_blocks=NB, bs=BS)
    tables = np.asarray(tables).copy()
    for s, (ql, n) in enumerate(zip(q_lens, kv_lens)):
        for j in range((n - ql) // BS):
            if rng.random() < drop:
                tables[s, j] = 0
    q, qs = (jnp.asarray(rng.normal(size=(24, HKV * G, D)), jnp.float32) for _ in range(2))
    k = jnp.asarray(rng.normal(size=(NB, BS, HKV, D)), jnp.float32).at[0].set(300.0)
    return q, qs, k, jnp.asarray(tables), lens, qsl


def _numpy_mass(q, qs, k, tables, lens, qsl, *, observe, window, sinks, soft_cap):
    seq_idx, q_pos, valid = (np.asarray(a) for a in token_layout(qsl, lens, q.shape[0]))
    qsl, tables, kk = np.asarray(qsl), np.asarray(tables), np.asarray(k)
    out = np.zeros(tables.shape)
    for t in np.flatnonzero(valid):
        s, p = seq_idx[t], q_pos[t]
        if t < qsl[s + 1] - observe:
            continue
        keys = [j for j in range(p + 1) if tables[s, j // BS] != 0
                and (window is None or p - j < window or j < sinks)]
        kj = kk[tables[s, [j // BS for j in keys]], [j % BS for j in keys]]   # [n, Hkv, D]
        for h in range(HKV * G):
            query = np.where(np.array(keys)[:, None] < (sinks if window else 0),
                             np.asarray(qs)[t, h], np.asarray(q)[t, h])
            sc = np.sum(query * kj[:, h // G], -1) / np.sqrt(D)
            if soft_cap:
                sc = soft_cap * np.tanh(sc / soft_cap)
            w = np.exp(sc - sc.max())
            np.add.at(out[s], [j // BS for j in keys], w / w.sum())
    return out


@pytest.mark.parametrize("observe, window, sinks, soft_cap, drop", [
    (1, None, 0, None, 0.0), (4, None, 0, None, 0.4), (16, 6, 3, None, 0.0),
    (2, 10, 2, 5.0, 0.3)])
def test_mass_equals_a_numpy_softmax(observe, window, sinks, soft_cap, drop):
    q, qs, k, tables, lens, qsl = _batch(observe, drop)
    opts = dict(sliding_window=window, num_sinks=sinks, soft_cap=soft_cap,
                q_sinks=qs if window else None)
    _, lse = paged_attention_reference(q, k, k, tables, lens, qsl, return_lse=True, **opts)
    got = block_attention_mass(q, k, tables, lens, qsl, lse, observe=observe, **opts,
                               kv_chunk_blocks=2)
    want = _numpy_mass(q, qs, k, tables, lens, qsl, observe=observe, window=window,
                       sinks=sinks, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # each observed token spreads exactly one unit of probability per head
    q_lens = np.diff(np.asarray(qsl))
    np.testing.assert_allclose(np.asarray(got).sum(1), np.minimum(q_lens, observe) * HKV * G,
                               rtol=1e-5)


def test_quantized_pool_mass_is_the_mass_of_its_dequantized_keys():
    q, _, k, tables, lens, qsl = _batch(5)
    pool = quantize_pages(k, "int8")
    deq = read_pages(pool, jnp.arange(NB, dtype=jnp.int32)).reshape(k.shape)
    _, lse = paged_attention_reference(q, pool, pool, tables, lens, qsl, return_lse=True)
    got = block_attention_mass(q, pool, tables, lens, qsl, lse, observe=3)
    want = block_attention_mass(q, deq, tables, lens, qsl, lse, observe=3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_bad_observe():
    q, _, k, tables, lens, qsl = _batch(0)
    with pytest.raises(ValueError, match="observe=0"):
        block_attention_mass(q, k, tables, lens, qsl, jnp.zeros((24, 4)), observe=0)


@pytest.mark.parametrize("kv", [None, "int8", "int4"])
def test_mass_with_scattered_dropped_blocks_equals_the_logical_walk(kv):
    """The kept-blocks walk (no window) against the logical walk (a window longer than every
    sequence: the same masks, every logical chunk visited), float and quantized keys."""
    q, _, k, tables, lens, qsl = _batch(11, drop=0.6)
    assert int((np.asarray(tables)[:, :7] == 0).sum()) > 5
    pool = k if kv is None else quantize_pages(k, kv)
    _, lse = paged_attention_reference(q, pool, pool, tables, lens, qsl, return_lse=True)
    got = block_attention_mass(q, pool, tables, lens, qsl, lse, observe=4, kv_chunk_blocks=2)
    want = block_attention_mass(q, pool, tables, lens, qsl, lse, observe=4, kv_chunk_blocks=2,
                                sliding_window=12 * BS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


def test_mass_visits_the_kept_blocks_only(monkeypatch):
    """5 kept blocks of 24 in chunks of 2: 3 loop steps (the logical walk takes 12)."""
    from test_attention_grouped import counting_reads, thinned_batch

    reads = counting_reads(monkeypatch, mass)
    q, k, _, tables, lens, qsl = thinned_batch(np.random.default_rng(4), [1, 1])
    _, lse = paged_attention_reference(q, k, k, tables, lens, qsl, return_lse=True)
    got = block_attention_mass(q, k, tables, lens, qsl, lse, kv_chunk_blocks=2)
    jax.effects_barrier()
    assert len(reads) == 3, reads
    np.testing.assert_allclose(np.asarray(got).sum(1), [4.0, 4.0], atol=1e-5, rtol=1e-5)
