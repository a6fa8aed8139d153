"""The reference paged attention against a naive per-sequence numpy loop, and cache write/gather/copy."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jaxkv.attention.dispatch import paged_attention
from jaxkv.attention.reference import paged_attention_reference
from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache.key_bounds import written_keys
from jaxkv.kvcache.pools import HNDPages, read_pages
from jaxkv.kvcache.spec import KVCacheSpec


def naive_attention(q, k_seqs, v_seqs, q_lens, *, scale, window=None, sinks=0, soft_cap=None,
                    learned=None):
    """Per-sequence dense attention in float64 numpy. k_seqs[s]: [kv_len, Hkv, D]; ``learned``:
    a sink logit per head [Hq] in every softmax (gpt-oss's eager attention)."""
    outs = []
    Hq = q.shape[1]
    t0 = 0
    for ks, vs, ql in zip(k_seqs, v_seqs, q_lens):
        kv_len, Hkv, _ = ks.shape
        G = Hq // Hkv
        for i in range(ql):
            qp = kv_len - ql + i
            out = np.zeros((Hq, q.shape[2]))
            for h in range(Hq):
                s = (ks[:, h // G] @ q[t0 + i, h]) * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.arange(kv_len)
                mask = p <= qp
                if window is not None:
                    mask &= (qp - p < window) | (p < sinks)
                s = np.where(mask, s, -np.inf)
                m = s.max() if learned is None else max(s.max(), learned[h])
                w = np.exp(s - m)
                total = w.sum() + (0 if learned is None else np.exp(learned[h] - m))
                out[h] = (w / total) @ vs[:, h // G]
            outs.append(out)
        t0 += ql
    return np.stack(outs)


def make_batch(rng, q_lens, kv_lens, *, Hq, Hkv, D, bs, num_blocks, pad_tokens=3, pad_seqs=1):
    """A ragged batch over a pool whose block tables come from a random permutation of page ids."""
    max_blocks = max(-(-n // bs) for n in kv_lens) + 1
    perm = rng.permutation(np.arange(1, num_blocks))
    k_pool = rng.standard_normal((num_blocks, bs, Hkv, D)).astype(np.float32)
    v_pool = rng.standard_normal((num_blocks, bs, Hkv, D)).astype(np.float32)
    S = len(q_lens) + pad_seqs
    tables = np.zeros((S, max_blocks), np.int32)
    k_seqs, v_seqs, used = [], [], 0
    for s, n in enumerate(kv_lens):
        nb = -(-n // bs)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
        pos = np.arange(n)
        k_seqs.append(k_pool[tables[s, pos // bs], pos % bs])
        v_seqs.append(v_pool[tables[s, pos // bs], pos % bs])
    T = sum(q_lens) + pad_tokens
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_seqs]).astype(np.int32)
    seq_lens = np.array(list(kv_lens) + [0] * pad_seqs, np.int32)
    return q, k_pool, v_pool, tables, seq_lens, qsl, k_seqs, v_seqs


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("window,sinks,soft_cap", [(None, 0, None), (5, 0, None), (7, 2, 30.0)])
def test_reference_matches_naive(Hq, Hkv, bs, window, sinks, soft_cap):
    rng = np.random.default_rng(Hq * 100 + bs)
    q_lens = [5, 1, 1, 3, 17]
    kv_lens = [5, 1, 33, 2 * bs + 1, 40]
    q, kp, vp, tables, seq_lens, qsl, ks, vs = make_batch(
        rng, q_lens, kv_lens, Hq=Hq, Hkv=Hkv, D=16, bs=bs, num_blocks=64)
    scale = 0.3
    out = paged_attention_reference(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp),
                                    jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(qsl),
                                    sm_scale=scale, sliding_window=window, num_sinks=sinks,
                                    soft_cap=soft_cap, kv_chunk_blocks=2)
    want = naive_attention(q, ks, vs, q_lens, scale=scale, window=window, sinks=sinks,
                           soft_cap=soft_cap)
    n = sum(q_lens)
    np.testing.assert_allclose(np.asarray(out[:n]), want, atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(out[n:]) == 0), "padding tokens must produce zeros"


@pytest.mark.parametrize("impl", ["reference", "grouped", "pallas"])
def test_learned_sinks_in_every_implementation(impl):
    """gpt-oss's learned sink logits (``layer.attend(sink_logits=)``, applied from each path's
    lse) with a window and a soft-cap, against the float64 softmax that holds the sink as one
    more column; padding tokens stay zero."""
    from jaxkv.attention.layer import attend
    from jaxkv.attention.options import AttentionOptions
    from jaxkv.kvcache.metadata import AttentionMetadata
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [5, 1, 1, 9], [5, 30, 12, 40]
    q, kp, vp, tables, seq_lens, qsl, ks, vs = make_batch(
        rng, q_lens, kv_lens, Hq=8, Hkv=2, D=32, bs=8, num_blocks=32)
    learned = rng.standard_normal(8).astype(np.float32) * 2
    md = AttentionMetadata(slot_mapping=jnp.zeros(q.shape[0], jnp.int32),
                           query_start_loc=jnp.asarray(qsl), seq_lens=jnp.asarray(seq_lens),
                           block_tables=jnp.asarray(tables))
    options = AttentionOptions(sliding_window=7, sm_scale=0.3, soft_cap=4.0)
    out, _ = attend(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), None, md, options=options,
                    impl=impl, interpret=True, sink_logits=jnp.asarray(learned))
    want = naive_attention(q, ks, vs, q_lens, scale=0.3, window=7, soft_cap=4.0,
                           learned=learned)
    n = sum(q_lens)
    np.testing.assert_allclose(np.asarray(out[:n]), want, atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(out[n:]) == 0)


def test_reference_lse_and_chunking_invariance():
    rng = np.random.default_rng(0)
    q, kp, vp, tables, seq_lens, qsl, *_ = make_batch(
        rng, [3, 1], [20, 9], Hq=4, Hkv=2, D=8, bs=4, num_blocks=16)
    args = [jnp.asarray(a) for a in (q, kp, vp, tables, seq_lens, qsl)]
    o1, lse1 = paged_attention_reference(*args, kv_chunk_blocks=1, return_lse=True)
    o2, lse2 = paged_attention_reference(*args, kv_chunk_blocks=5, return_lse=True)
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse1[:4]), np.asarray(lse2[:4]), atol=1e-6, rtol=1e-6)
    # lse of token 3 (seq 1, decode at position 8) by hand
    s = np.einsum("hd,nhd->hn", q[3], np.repeat(
        kp[tables[1, np.arange(9) // 4], np.arange(9) % 4], 2, axis=1)) / np.sqrt(8)
    np.testing.assert_allclose(np.asarray(lse1[3]), np.log(np.exp(s).sum(-1)), atol=1e-5, rtol=1e-5)
    assert np.all(np.isneginf(np.asarray(lse1[4:])))


def test_dispatch_rejects_unknown_impl_and_bad_shapes():
    rng = np.random.default_rng(1)
    q, kp, vp, tables, seq_lens, qsl, *_ = make_batch(
        rng, [2], [4], Hq=4, Hkv=2, D=8, bs=4, num_blocks=4)
    with pytest.raises(ValueError, match="impl='triton'"):
        paged_attention(q, kp, vp, tables, seq_lens, qsl, impl="triton")
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(q, kp, vp, tables, seq_lens, qsl[:-1])
    with pytest.raises(ValueError, match="num_heads=3"):
        paged_attention(q[:, :3], kp, vp, tables, seq_lens, qsl)


def test_cache_write_gather_bit_exact_and_copy_blocks():
    rng = np.random.default_rng(2)
    bs, Hkv, D = 4, 2, 8
    cache = kvcache.init_cache(KVCacheSpec(num_layers=2, num_blocks=12, block_size=bs,
                                           num_kv_heads=Hkv, head_dim=D))
    table = np.array(rng.permutation(np.arange(1, 12))[:3], np.int32)   # 3 blocks, 11 tokens
    n = 11
    pos = np.arange(n)
    slots = table[pos // bs] * bs + pos % bs
    k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    cache = kvcache.write(cache, 1, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    gk, gv = kvcache.gather(cache, 1, jnp.asarray(table), n)
    assert np.array_equal(np.asarray(gk), k) and np.array_equal(np.asarray(gv), v)
    assert not np.any(np.asarray(cache.k[0])), "another layer was written"
    free = sorted(set(range(1, 12)) - set(table.tolist()))[:2]
    before = np.asarray(cache.k[1][table[:2]])
    cache = kvcache.copy_blocks(cache, jnp.asarray(table[:2]), jnp.asarray(free, dtype=jnp.int32))
    assert np.array_equal(np.asarray(cache.k[1][np.array(free)]), before)
    assert np.array_equal(np.asarray(cache.v[1][np.array(free)]),
                          np.asarray(cache.v[1][table[:2]]))


def test_hnd_pools_hold_the_nhd_pools_transposed():
    """An HND cache (``KVCacheSpec.layout="hnd"``) and an NHD cache fed the same writes, block
    copies and Quest key bounds: every HND pool equals its NHD twin with heads and tokens
    swapped, and every read (gather, read_pages either way round, written_keys) is equal."""
    rng = np.random.default_rng(5)
    bs, Hkv, D, N = 4, 3, 8, 14
    spec = dict(num_layers=2, num_blocks=N, block_size=bs, num_kv_heads=Hkv, head_dim=D,
                key_bounds=True)
    nhd, hnd = (kvcache.init_cache(KVCacheSpec(**spec, layout=x)) for x in ("nhd", "hnd"))
    assert isinstance(hnd.k[0], HNDPages) and hnd.k[0].data.shape == (N, Hkv, bs, D)
    assert hnd.k[0].shape == nhd.k[0].shape and hnd.nbytes == nhd.nbytes
    table = np.array(rng.permutation(np.arange(1, N))[:4], np.int32)
    for lo, hi in ((0, 6), (6, 7), (7, 14)):               # a chunk, a decode token, a chunk
        pos = np.arange(lo, hi)
        slots = jnp.asarray(table[pos // bs] * bs + pos % bs)
        k, v = (jnp.asarray(rng.standard_normal((hi - lo, Hkv, D)), jnp.float32)
                for _ in range(2))
        nhd, hnd = (kvcache.write(c, 1, k, v, slots) for c in (nhd, hnd))
        assert np.array_equal(written_keys(hnd.k[1], slots),
                              written_keys(nhd.k[1], slots))
    src, dst = jnp.asarray(table[:2]), jnp.asarray(np.setdiff1d(np.arange(1, N), table)[:2])
    nhd, hnd = (kvcache.copy_blocks(c, src, dst) for c in (nhd, hnd))
    for a, b in zip(nhd.k + nhd.v, hnd.k + hnd.v):
        assert np.array_equal(np.asarray(b.data), np.asarray(a).transpose(0, 2, 1, 3))
    for a, b in zip(nhd.bounds, hnd.bounds):
        assert np.array_equal(np.asarray(a.kmin), np.asarray(b.kmin))
        assert np.array_equal(np.asarray(a.kmax), np.asarray(b.kmax))
    for a, b in zip(*(kvcache.gather(c, 1, jnp.asarray(table), 14) for c in (nhd, hnd))):
        assert np.array_equal(a, b)
    ids = jnp.asarray(np.concatenate([table, np.asarray(dst)]).reshape(2, 3))
    for heads_first in (False, True):
        assert np.array_equal(read_pages(hnd.v[1], ids, heads_first=heads_first),
                              read_pages(nhd.v[1], ids, heads_first=heads_first))


def test_cache_rejects_bad_geometry():
    with pytest.raises(ValueError, match="num_blocks=1"):
        KVCacheSpec(num_layers=1, num_blocks=1, block_size=16, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="block_size=0"):
        KVCacheSpec(num_layers=1, num_blocks=4, block_size=0, num_kv_heads=2, head_dim=8)


def test_cache_is_a_pytree():
    cache = kvcache.init_cache(KVCacheSpec(num_layers=3, num_blocks=4, block_size=2,
                                           num_kv_heads=1, head_dim=4))
    leaves = jax.tree_util.tree_leaves(cache)
    assert len(leaves) == 6 and cache.block_size == 2 and cache.num_layers == 3
    assert cache.nbytes == 6 * 4 * 2 * 1 * 4 * 4
