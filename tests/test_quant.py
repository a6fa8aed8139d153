"""Quantized KV: quantize/dequantize error bounds, packing, quantized cache writes (KIVI seal and
residual), reference attention over dequantized pages, copy_blocks, and geometry errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.reference import paged_attention_reference
from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache import quant
from jaxkv.kvcache.pools import read_pages
from jaxkv.kvcache.spec import KV_FORMATS, KVCacheSpec, get_format

FORMATS = tuple(name for name, f in KV_FORMATS.items() if f.quantized)


def outlier_data(shape, seed=0):
    """Normal data with a few large channels (like real keys) and one constant channel."""
    x = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    x[..., 3] *= 8.0
    x[..., 5] = 0.7
    return jnp.asarray(x)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("axis", [-1, 0])
def test_quantize_dequantize_within_bound(name, axis):
    fmt = get_format(name)
    x = outlier_data((16, 3, 64))
    group = 32 if fmt.kivi else None
    codes, scale, zero = quant.quantize(x, fmt, axis=axis, group_size=group)
    assert codes.dtype == jnp.dtype(fmt.storage) and codes.shape == x.shape
    y = quant.dequantize(codes, scale, zero, fmt, axis=axis)
    if axis == -1:
        g = x.shape[-1] // scale.shape[-1]
        s_full = jnp.repeat(scale.astype(jnp.float32), g, -1)
        z_full = None if zero is None else jnp.repeat(zero, g, -1)
    else:
        s_full, z_full = jnp.broadcast_to(scale, x.shape), (
            None if zero is None else jnp.broadcast_to(zero, x.shape))
    err = jnp.abs(y - x)
    bound = quant.error_bound(x, s_full, z_full, fmt)
    assert bool(jnp.all(err <= bound)), float(jnp.max(err - bound))
    # relative error ranking: more bits, less error
    rel = float(jnp.linalg.norm(y - x) / jnp.linalg.norm(x))
    assert rel < {"fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "int8": 0.02, "int4": 0.12,
                  "int2": 0.6}[name]


def test_static_scale_and_constant_groups():
    fmt = get_format("fp8_e4m3")
    x = outlier_data((4, 2, 16))
    codes, scale, zero = quant.quantize(x, fmt, static_scale=0.05)
    assert scale is None and zero is None
    y = quant.dequantize(codes, None, None, fmt, static_scale=0.05)
    np.testing.assert_allclose(y, x, rtol=2 ** -4, atol=0.05 * 2 ** -9)
    for name in ("int8", "int4", "int2"):
        f = get_format(name)
        c = jnp.full((2, 8), 1.5)
        q, s, z = quant.quantize(c, f, group_size=8 if f.kivi else None)
        np.testing.assert_allclose(quant.dequantize(q, s, z, f), c, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_layout(bits):
    n = 8 // bits
    codes = jnp.asarray(np.random.default_rng(1).integers(0, 2 ** bits, (5, 3, 16)), jnp.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape == (5, 3, 16 // n) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(quant.unpack(packed, bits), codes)
    # byte j holds channel j + k * D / n in bits [k * bits, (k + 1) * bits)
    d = 16 // n
    for k in range(n):
        np.testing.assert_array_equal((packed >> (k * bits)) & (2 ** bits - 1),
                                      codes[..., k * d:(k + 1) * d])


def fill(cache_kw, lengths, block_size=4, chunk=3, seed=0, num_blocks=16):
    """Writes sequences of ``lengths`` tokens into a fresh cache in steps of ``chunk`` tokens per
    sequence (ragged, like chunked prefill then decode); returns (cache, tables, k, v)."""
    rng = np.random.default_rng(seed)
    H, D = 2, 16
    c = kvcache.init_cache(KVCacheSpec(num_layers=1, num_blocks=num_blocks, block_size=block_size,
                                       num_kv_heads=H, head_dim=D, **cache_kw))
    perm = rng.permutation(np.arange(1, num_blocks))
    nb = [-(-n // block_size) for n in lengths]
    tables, at = [], 0
    for b in nb:
        tables.append(list(perm[at:at + b]) + [0] * (max(nb) - b))
        at += b
    tables = np.array(tables, np.int32)
    ks = [np.asarray(outlier_data((n, H, D), seed + i)) for i, n in enumerate(lengths)]
    vs = [np.asarray(outlier_data((n, H, D), seed + 10 + i)) for i, n in enumerate(lengths)]
    write = jax.jit(kvcache.write, static_argnums=1)
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        slots, kk, vv = [], [], []
        for s, n in enumerate(lengths):
            step = min(chunk if done[s] == 0 else 1, n - done[s])
            for p in range(done[s], done[s] + step):
                slots.append(tables[s, p // block_size] * block_size + p % block_size)
                kk.append(ks[s][p])
                vv.append(vs[s][p])
            done[s] += step
        pad = 12 - len(slots)
        slots += [0] * pad
        kk += [np.zeros((H, D), np.float32)] * pad
        vv += [np.zeros((H, D), np.float32)] * pad
        c = write(c, 0, jnp.stack(kk), jnp.stack(vv), jnp.asarray(slots, jnp.int32))
    return c, tables, ks, vs


@pytest.mark.parametrize("name", FORMATS)
def test_cache_write_seals_blocks(name):
    lengths = [9, 4, 6]      # block_size 4: 2 sealed + 1 tail, 1 sealed, 1 sealed + tail
    c, tables, ks, vs = fill({"kv_cache_dtype": name, "num_residual_slots": 4}, lengths)
    fmt = get_format(name)
    for s, n in enumerate(lengths):
        k, v = kvcache.gather(c, 0, jnp.asarray(tables[s]), n)
        sealed = (n // 4) * 4 if fmt.kivi else n
        for got, want, axis in ((k, ks[s], "channel"), (v, vs[s], "token")):
            if fmt.kivi:
                blocks = jnp.asarray(want[:sealed]).reshape(-1, 4, *want.shape[1:])
                ax = 1 if axis == "channel" else -1
                q, sc, z = quant.quantize(blocks, fmt, axis=ax, group_size=16)
                ref = quant.dequantize(q, sc, z, fmt, axis=ax).reshape(want[:sealed].shape)
            else:
                q, sc, z = quant.quantize(jnp.asarray(want), fmt)
                ref = quant.dequantize(q, sc, z, fmt)
            np.testing.assert_array_equal(got[:sealed], ref[:sealed])
            np.testing.assert_array_equal(got[sealed:], want[sealed:])   # residual: exact
    if fmt.kivi:
        pool = c.k[0]
        live = np.asarray(pool.res_slot)[tables[:, :3].ravel()]
        assert (live > 0).sum() == 2           # the two unsealed tails
        assert sorted(np.asarray(pool.res_owner)[live[live > 0]]) == sorted(
            tables.ravel()[np.flatnonzero(live)])


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp8_e5m2"])
def test_reference_attention_reads_dequantized_pages(name):
    lengths = [9, 4, 6]
    c, tables, *_ = fill({"kv_cache_dtype": name, "num_residual_slots": 4}, lengths)
    ids = jnp.arange(c.num_blocks)
    dense_k = read_pages(c.k[0], ids)
    dense_v = read_pages(c.v[0], ids)
    q = outlier_data((sum(lengths), 4, 16), 7)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    args = (jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), qsl)
    got = paged_attention_reference(q, c.k[0], c.v[0], *args, kv_chunk_blocks=2)
    want = paged_attention_reference(q, dense_k, dense_v, *args, kv_chunk_blocks=2)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


def test_residual_off_reads_tail_fake_quantized():
    lengths = [6]
    on, tables, ks, _ = fill({"kv_cache_dtype": "int2", "num_residual_slots": 2}, lengths)
    off, *_ = fill({"kv_cache_dtype": "int2", "num_residual_slots": 2,
                    "residual_full_precision": False}, lengths)
    k_on, _ = kvcache.gather(on, 0, jnp.asarray(tables[0]), 6)
    k_off, _ = kvcache.gather(off, 0, jnp.asarray(tables[0]), 6)
    np.testing.assert_array_equal(k_on[:4], k_off[:4])
    np.testing.assert_array_equal(k_on[4:], ks[0][4:])
    assert float(jnp.abs(k_off[4:] - ks[0][4:]).max()) > 0.05


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_copy_blocks_copies_codes_scales_and_residual(name):
    c, tables, *_ = fill({"kv_cache_dtype": name, "num_residual_slots": 4}, [6])
    src = tables[0, :2]                      # a sealed block and the unsealed tail
    free = sorted(set(range(1, c.num_blocks)) - set(tables.ravel()))[:2]
    before = jax.tree_util.tree_map(np.asarray, c)
    c2 = kvcache.copy_blocks(c, jnp.asarray(src), jnp.asarray(free, jnp.int32))
    ids_src, ids_dst = jnp.asarray(src), jnp.asarray(free)
    for pool in (c2.k[0], c2.v[0]):
        np.testing.assert_array_equal(read_pages(pool, ids_dst),
                                      read_pages(pool, ids_src))
        np.testing.assert_array_equal(pool.data[ids_dst], pool.data[ids_src])
        np.testing.assert_array_equal(pool.scale[ids_dst], pool.scale[ids_src])
    np.testing.assert_array_equal(read_pages(c2.k[0], ids_src),
                                  read_pages(before.k[0], ids_src))
    if name == "int4":
        slots = np.asarray(c2.k[0].res_slot)
        assert slots[free[1]] > 0 and slots[free[1]] != slots[src[1]] and slots[free[0]] == 0


def test_residual_slots_are_recycled():
    # 6 sequences one after another through a 2-slot residual: stale tails are reclaimed
    c = kvcache.init_cache(KVCacheSpec(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1,
                                       head_dim=8, kv_cache_dtype="int4", num_residual_slots=2))
    write = jax.jit(kvcache.write, static_argnums=1)
    x = outlier_data((3, 1, 8))
    for i in range(6):
        blk = 1 + i % 7
        c = write(c, 0, x, x, jnp.asarray([blk * 4, blk * 4 + 1, blk * 4 + 2], jnp.int32))
        got = read_pages(c.k[0], jnp.asarray([blk]))[0, :3]
        np.testing.assert_array_equal(got, x)
    owners = np.asarray(c.k[0].res_owner)
    assert owners[0] == 0 and len(set(owners[1:])) == 2


def test_bad_geometry_and_dtype():
    spec = functools.partial(KVCacheSpec, num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1,
                             head_dim=8)
    with pytest.raises(ValueError, match="kv_cache_dtype='int3'"):
        spec(kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="head_dim=6 must be a multiple of 4"):
        spec(head_dim=6, kv_cache_dtype="int2")
    with pytest.raises(ValueError, match="block_size=1"):
        spec(block_size=1, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="group_size=24"):
        spec(head_dim=64, kv_cache_dtype="int4", group_size=24)
    with pytest.raises(ValueError, match="static_scale"):
        spec(kv_cache_dtype="int8", static_scale=0.1)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp8_e4m3", "int8", "int4", "int2"])
def test_planner_counts_the_exact_cache_bytes(name):
    from jaxkv.kvcache.spec import kivi_residual_slots
    from jaxkv.model.config import ModelConfig
    from jaxkv.runner import memory_plan
    cfg = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                      max_position_embeddings=256)
    p = memory_plan.plan(cfg, device_memory_bytes=1 << 30, kv_cache_dtype=name, block_size=16,
                     max_num_seqs=3, max_model_len=64, num_kv_blocks=9, dtype="float32")
    spec = functools.partial(KVCacheSpec, num_layers=2, num_kv_heads=2, head_dim=64,
                             kv_cache_dtype=name)
    c = kvcache.init_cache(spec(num_blocks=9, block_size=16, num_residual_slots=4))
    assert p.kv_cache_bytes + p.kv_residual_bytes == c.nbytes
    ratio = memory_plan.kv_bytes_per_block(cfg, "bf16", 32) / memory_plan.kv_bytes_per_block(cfg, name, 32)
    assert ratio >= {"fp32": 0.5, "bf16": 1, "fp8_e4m3": 1.9, "int8": 1.9, "int4": 3.1,
                     "int2": 5.0}[name]
    # KIVI geometry levers: a 64-token key group (block) and 64-channel value groups, with a
    # residual window of 2 blocks per sequence
    p = memory_plan.plan(cfg, device_memory_bytes=1 << 30, kv_cache_dtype=name, block_size=64,
                     max_num_seqs=3, max_model_len=128, num_kv_blocks=5, dtype="float32",
                     kv_residual_blocks=2, kv_group_size=64)
    c = kvcache.init_cache(spec(num_blocks=5, block_size=64,
                                num_residual_slots=kivi_residual_slots(3, 2),
                                residual_blocks=2, group_size=64))
    assert p.kv_cache_bytes + p.kv_residual_bytes == c.nbytes


def test_rewrite_into_sealed_kivi_block_keeps_its_codes():
    # a fully cached prompt recomputes its last token: the sealed block must not change
    c, tables, *_ = fill({"kv_cache_dtype": "int4", "num_residual_slots": 2}, [8])
    before = jax.tree_util.tree_map(np.asarray, c.k[0])
    last = int(tables[0, 1]) * 4 + 3
    c = jax.jit(kvcache.write, static_argnums=1)(
        c, 0, jnp.ones((1, 2, 16)), jnp.ones((1, 2, 16)), jnp.asarray([last], jnp.int32))
    np.testing.assert_array_equal(c.k[0].data, before.data)
    np.testing.assert_array_equal(c.k[0].scale, before.scale)
    assert int(c.k[0].res_owner.max()) == 0


def _decode_writes(cache, tables, n, *, residual_blocks, seed=0):
    """Writes n tokens of one sequence one decode step at a time (with the step metadata);
    returns the cache and the written K."""
    from jaxkv.kvcache.metadata import AttentionMetadata

    rng = np.random.default_rng(seed)
    ks = rng.normal(size=(n, 1, 8)).astype(np.float32)
    bs = cache.block_size
    write = jax.jit(kvcache.write, static_argnums=1)
    for p in range(n):
        md = AttentionMetadata(slot_mapping=jnp.asarray([tables[p // bs] * bs + p % bs], jnp.int32),
                               query_start_loc=jnp.asarray([0, 1], jnp.int32),
                               seq_lens=jnp.asarray([p + 1], jnp.int32),
                               block_tables=jnp.asarray([tables], jnp.int32))
        cache = write(cache, 0, jnp.asarray(ks[p:p + 1]), jnp.asarray(ks[p:p + 1]),
                      md.slot_mapping, md)
    return cache, ks


@pytest.mark.parametrize("n", [13, 16, 22])
def test_residual_window_holds_the_last_blocks_exactly(n):
    """R = 3: the unsealed block and the last two sealed blocks keep residual slots (exact block
    ids), read back bit-exactly; blocks before the window read as codes identical to R = 1's."""
    tables = [5, 2, 7, 4, 6, 3]
    spec = functools.partial(KVCacheSpec, num_layers=1, num_blocks=8, block_size=4,
                             num_kv_heads=1, head_dim=8, kv_cache_dtype="int2",
                             num_residual_slots=3)
    c3, ks = _decode_writes(kvcache.init_cache(spec(residual_blocks=3)), tables, n,
                            residual_blocks=3)
    c1, _ = _decode_writes(kvcache.init_cache(spec(residual_blocks=1)), tables, n,
                           residual_blocks=1)
    nb, full = -(-n // 4), n // 4
    window = [tables[j] for j in range(max(full - 2, 0), nb)]
    assert sorted(np.nonzero(np.asarray(c3.k[0].res_slot))[0].tolist()) == sorted(window)
    assert np.asarray(c1.k[0].res_slot > 0).sum() == (n % 4 > 0)
    got3 = np.asarray(read_pages(c3.k[0], jnp.asarray(tables[:nb])))
    got1 = np.asarray(read_pages(c1.k[0], jnp.asarray(tables[:nb])))
    flat3, flat1 = got3.reshape(-1, 1, 8)[:n], got1.reshape(-1, 1, 8)[:n]
    first = max(full - 2, 0) * 4
    np.testing.assert_array_equal(flat3[first:], ks[first:])
    np.testing.assert_array_equal(flat3[:first], flat1[:first])
    np.testing.assert_array_equal(np.asarray(c3.k[0].data), np.asarray(c1.k[0].data))
