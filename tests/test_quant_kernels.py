"""Pallas kernels over fp8/int8 pools (interpret mode): output equals the reference applied to the
same quantized pages (fp8/int8 codes, packed KIVI int4/int2 with their residual); every quantized
variant lowers to CUDA (Triton)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.pallas import paged_decode_attention, ragged_paged_attention
from jaxkv.attention.reference import paged_attention_reference
from jaxkv.kvcache import pages as kvcache
from jaxkv.kvcache.pools import quantize_pages, read_pages
from jaxkv.kvcache.spec import KVCacheSpec

H, HKV, D, BS, NB = 4, 2, 16, 8, 12


def quantized_pools(kv, lengths, seed=0, d=D, **kw):
    """A one-layer quantized cache holding random K/V for sequences of ``lengths`` tokens."""
    rng = np.random.default_rng(seed)
    c = kvcache.init_cache(KVCacheSpec(num_layers=1, num_blocks=NB, block_size=BS,
                                       num_kv_heads=HKV, head_dim=d, kv_cache_dtype=kv,
                                       num_residual_slots=4, **kw))
    perm = rng.permutation(np.arange(1, NB))
    nb = max(-(-n // BS) for n in lengths)
    tables = np.zeros((len(lengths), nb), np.int32)
    slots, at = [], 0
    for s, n in enumerate(lengths):
        k = -(-n // BS)
        tables[s, :k] = perm[at:at + k]
        at += k
        slots += [tables[s, p // BS] * BS + p % BS for p in range(n)]
    new = jnp.asarray(rng.normal(size=(len(slots), HKV, d)), jnp.float32)
    c = kvcache.write(c, 0, new, new * 0.5 + 0.1, jnp.asarray(slots, jnp.int32))
    return c.k[0], c.v[0], jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)


def assert_kernels_match_reference(k, v, tables, lens):
    """Ragged (prefill chunks of 7, 1, 4 tokens) and split-K decode kernels == the reference on
    the pools of three sequences."""
    q_lens = np.array([7, 1, 4])
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(np.random.default_rng(1).normal(size=(int(q_lens.sum()), H, k.shape[3])),
                    jnp.float32)
    want = paged_attention_reference(q, k, v, tables, lens, qsl)
    got = ragged_paged_attention(q, k, v, tables, lens, qsl, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    qd = q[:3]
    want = paged_attention_reference(qd, k, v, tables, lens, jnp.arange(4, dtype=jnp.int32))
    got = paged_decode_attention(qd, k, v, tables, lens, num_splits=2, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_ragged_and_decode_kernels_match_reference_on_quantized_pages(kv):
    lengths = [19, 5, 12]
    k, v, tables, lens = quantized_pools(kv, lengths)
    assert_kernels_match_reference(k, v, tables, lens)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_quantized_pools_are_read_in_several_chunks(kv):
    """head_dim 128: fp8/int8 tiles are dequantized DEQUANT_CHUNK channels at a time (fewer
    live registers: no spill on the GPU), the partial dots summed, as the reference computes."""
    from jaxkv.attention.pallas.kv_format import DEQUANT_CHUNK, kv_operands

    k, v, tables, lens = quantized_pools(kv, [19, 5, 12], d=128)
    assert len(kv_operands(k, v)[1].chunks) == 128 // DEQUANT_CHUNK == 2
    assert_kernels_match_reference(k, v, tables, lens)


def test_static_scale_fp8_kernel_matches_reference():
    k, v, tables, lens = quantized_pools("fp8_e5m2", [10, 3], static_scale=0.01)
    q = jnp.asarray(np.random.default_rng(2).normal(size=(2, H, D)), jnp.float32)
    want = paged_attention_reference(q, k, v, tables, lens, jnp.arange(3, dtype=jnp.int32))
    got = paged_decode_attention(q, k, v, tables, lens, num_splits=1, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kv,d", [("int4", 32), ("int2", 64)])
@pytest.mark.parametrize("axes", [("channel", "token"), ("token", "channel")])
def test_kivi_kernels_match_reference_on_packed_pages(kv, d, axes):
    """Packed int4/int2 pools (sealed blocks read as codes * scale + zero, unsealed tails from the
    full-precision residual) give the reference's output, for KIVI's grouping and the ablation's."""
    lengths = [19, 5, 16]                        # 19: two sealed + a tail; 16: sealed exactly
    k, v, tables, lens = quantized_pools(kv, lengths, d=d, key_axis=axes[0],
                                         value_axis=axes[1], group_size=16)
    assert int((k.res_slot > 0).sum()) == 2      # the tails of 19 and 5 are unsealed
    assert_kernels_match_reference(k, v, tables, lens)


def test_kivi_kernel_errors_name_the_problem():
    k, v, tables, lens = quantized_pools("int2", [10], d=32, group_size=16)
    q = jnp.zeros((1, H, 32), jnp.float32)
    with pytest.raises(ValueError, match="8-channel chunks"):
        paged_decode_attention(q, k, v, tables, lens, interpret=True)
    k, v, tables, lens = quantized_pools("int4", [10], d=32, group_size=16,
                                         residual_full_precision=False)
    with pytest.raises(ValueError, match="residual_full_precision=False"):
        paged_decode_attention(q, k, v, tables, lens, interpret=True)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"])
def test_quantized_kernels_lower_to_cuda(kv):
    pools = kvcache.abstract_cache(KVCacheSpec(num_layers=1, num_blocks=300, block_size=16,
                                               num_kv_heads=8, head_dim=128, kv_cache_dtype=kv,
                                               num_residual_slots=9))
    k, v = pools.k[0], pools.v[0]
    tables = jax.ShapeDtypeStruct((8, 64), jnp.int32)
    lens = jax.ShapeDtypeStruct((8,), jnp.int32)
    for dtype in (jnp.bfloat16, jnp.float16):
        q = jax.ShapeDtypeStruct((8, 32, 128), dtype)
        for f, extra in ((functools.partial(paged_decode_attention, num_splits=4), ()),
                         (ragged_paged_attention, (jax.ShapeDtypeStruct((9,), jnp.int32),))):
            text = jax.jit(f).trace(q, k, v, tables, lens, *extra).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("kv", ["int8", "int4", "int2"])
def test_quantize_pages_equals_writing_every_token(kv):
    """The benchmarks' whole-pool quantizer gives what writing and sealing every block gives."""
    lengths = [16, 24]                                       # whole blocks only: all sealed
    k, v, tables, lens = quantized_pools(kv, lengths, d=64, group_size=16)
    pool = read_pages(k, jnp.arange(NB))             # f32 [NB, BS, HKV, 64]
    raw = jnp.zeros((NB, BS, HKV, 64))
    rng = np.random.default_rng(0)                           # replays quantized_pools' draws
    rng.permutation(np.arange(1, NB))
    new = jnp.asarray(rng.normal(size=(sum(lengths), HKV, 64)), jnp.float32)
    ids = np.concatenate([tables[0, :2], tables[1, :3]])
    raw = raw.at[ids].set(new.reshape(-1, BS, HKV, 64))
    q = quantize_pages(raw, kv, axis="channel" if kv in ("int4", "int2") else "token",
                               group_size=16)
    np.testing.assert_array_equal(read_pages(q, jnp.asarray(ids)), pool[ids])


def test_one_byte_pools_of_two_to_four_gib_are_refused():
    """Triton would address them with overflowing int32 offsets (jax's lowering switches to int64
    only past 2^32 bytes); checked on shapes, nothing is allocated."""
    from jaxkv.attention.pallas.kv_format import check_offsets

    big = jax.ShapeDtypeStruct((2 ** 17 + 1, 16, 8, 128), jnp.int8)          # 2 GiB + 16 KiB
    with pytest.raises(ValueError, match="overflowing int32 offsets"):
        check_offsets([big])
    check_offsets([jax.ShapeDtypeStruct((2 ** 17, 16, 8, 128), jnp.int8),   # exactly 2 GiB
                   jax.ShapeDtypeStruct((2 ** 17 + 1, 16, 8, 128), jnp.bfloat16)])
