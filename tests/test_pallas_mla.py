"""The Pallas MLA decode kernel (jaxkv/attention/pallas/mla_decode.py) in interpret mode against
the pure-jnp spec ``mla_attention_reference``: random latent pools with shuffled blocks, ragged
lengths, several block, head-tile and split sizes, f32 and bf16; ``mla_attention``'s "pallas"
path on decode-only and mixed steps; the engine on a tiny DeepSeek model (the same greedy
tokens as the default path); the refusals; bench/gpu_check.py's MLA section on tiny sizes."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.mla import mla_attention, mla_attention_reference
from jaxkv.attention.pallas.mla_decode import MLADecodeConfig, mla_decode_attention
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pages import init_cache
from jaxkv.kvcache.pools import HNDPages, QuantizedPages, write_layer
from jaxkv.kvcache.spec import KVCacheSpec

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def latent_batch(seed, seq_lens, *, N, Lkv, R, bs, dtype=jnp.float32, spare_blocks=2):
    """(q [S, N, Lkv + R], pool, block tables, seq_lens) over shuffled blocks of a random
    latent pool; tables hold ``spare_blocks`` padding entries past the longest sequence."""
    rng = np.random.default_rng(seed)
    S, B = len(seq_lens), -(-max(seq_lens) // bs) + spare_blocks
    tables = np.zeros((S, B), np.int32)
    ids = 1 + rng.permutation(S * B)
    for s, n in enumerate(seq_lens):
        tables[s, :-(-n // bs)] = ids[s * B:s * B - (-n // bs)]
    pool = jnp.asarray(rng.normal(size=(S * B + 1, bs, 1, Lkv + R)), dtype)
    q = jnp.asarray(rng.normal(size=(S, N, Lkv + R)), dtype)
    return q, pool, jnp.asarray(tables), jnp.asarray(seq_lens, jnp.int32)


def latent_pool(latent: jax.Array, kv: str, static_scale: float | None = None) -> QuantizedPages:
    """A latent pool of format ``kv`` (fp8) holding ``latent`` [num_blocks, block_size, 1, D],
    every slot written by ``write_layer`` (the layer's write: codes and per-token scales, or
    codes of ``static_scale``)."""
    n, bs, _, d = latent.shape
    spec = KVCacheSpec(num_layers=1, num_blocks=n, block_size=bs, num_kv_heads=1, head_dim=d,
                       v_head_dim=0, kv_cache_dtype=kv, static_scale=static_scale)
    return write_layer(init_cache(spec).k[0], latent.reshape(n * bs, 1, d),
                       jnp.arange(n * bs, dtype=jnp.int32))


def reference(q, pool, tables, lens, Lkv, scale):
    """The spec on a decode step: sequence s's one token is q[s]."""
    qsl = jnp.arange(len(lens) + 1, dtype=jnp.int32)
    return mla_attention_reference(q, pool, tables, lens, qsl, kv_lora_rank=Lkv, sm_scale=scale)


def assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOL[dtype])


# DeepSeek-like small latents (Lkv 64 + R 16, V3's 8:1), ragged lengths (1, block and tile
# boundaries +-1, long), contexts that do not divide into the splits, heads not a multiple of
# the head tile, a padding sequence (length 0); SLOW: run with -m slow
CASES = {
    "bs8-splits3": dict(N=4, Lkv=64, R=16, bs=8, lens=[1, 37, 100, 0], splits=3, config=None),
    "bs16-auto-splits-bkv16-20heads": dict(N=20, Lkv=64, R=16, bs=16, lens=[5, 16, 17, 250],
                                           splits=None, config=MLADecodeConfig(block_kv=16)),
    "bs32-one-split-bh32": dict(N=16, Lkv=32, R=16, bs=32, lens=[33, 64, 1], splits=1,
                                config=MLADecodeConfig(block_h=32, block_kv=64)),
    "bs4-splits5-batch1": dict(N=4, Lkv=64, R=16, bs=4, lens=[203], splits=5,
                               config=MLADecodeConfig(block_kv=16, num_warps=4)),
}
SLOW = ("bs32-one-split-bh32", "bs4-splits5-batch1")


@pytest.mark.parametrize("name", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in CASES])
def test_kernel_equals_reference(name):
    c = CASES[name]
    q, pool, tables, lens = latent_batch(list(CASES).index(name), c["lens"], N=c["N"],
                                         Lkv=c["Lkv"], R=c["R"], bs=c["bs"])
    scale = 1 / math.sqrt(c["Lkv"] + c["R"])
    out, lse = mla_decode_attention(q, pool, tables, lens, kv_lora_rank=c["Lkv"], sm_scale=scale,
                                    num_splits=c["splits"], config=c["config"], return_lse=True,
                                    interpret=True)
    want = reference(q, pool, tables, lens, c["Lkv"], scale)
    assert out.shape == want.shape == (len(c["lens"]), c["N"], c["Lkv"]) and out.dtype == q.dtype
    assert_close(out, want, jnp.float32)
    padding = np.asarray(c["lens"]) == 0
    assert np.all(np.asarray(out)[padding] == 0) and np.all(np.isneginf(np.asarray(lse)[padding]))
    assert np.all(np.isfinite(np.asarray(lse)[~padding]))


def test_bf16_kernel_equals_reference():
    """bf16 q and pool (the kernel's p in bf16 for the value product): within 2e-2."""
    q, pool, tables, lens = latent_batch(7, [9, 130, 64], N=16, Lkv=64, R=16, bs=16,
                                         dtype=jnp.bfloat16)
    out = mla_decode_attention(q, pool, tables, lens, kv_lora_rank=64, sm_scale=0.1,
                               interpret=True)
    assert out.dtype == jnp.bfloat16
    assert_close(out, reference(q, pool, tables, lens, 64, 0.1), jnp.bfloat16)


# fp8 latent pools (codes dequantized in the kernel by their per-token scales, or one static
# scale): V3's chunking (c_kv in 64-channel chunks, k_rope one) and narrower chunks; bf16 q
FP8_CASES = {
    "e4m3-v3-chunks": dict(kv="fp8_e4m3", static=None, Lkv=128, R=64, dtype=jnp.float32),
    "e5m2-narrow": dict(kv="fp8_e5m2", static=None, Lkv=32, R=16, dtype=jnp.float32),
    "e4m3-static": dict(kv="fp8_e4m3", static=0.05, Lkv=64, R=16, dtype=jnp.float32),
    "e4m3-bf16-q": dict(kv="fp8_e4m3", static=None, Lkv=64, R=16, dtype=jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_kernel_equals_reference(name):
    """The kernel over an fp8 latent pool equals the spec over the same pool (which reads it
    dequantized, ``read_pages``); the pool's values are not the float latent's."""
    c = FP8_CASES[name]
    q, latent, tables, lens = latent_batch(11, [1, 37, 100, 0], N=20, Lkv=c["Lkv"], R=c["R"],
                                           bs=8)
    pool = latent_pool(latent, c["kv"], c["static"])
    q = q.astype(c["dtype"])
    scale = 1 / math.sqrt(c["Lkv"] + c["R"])
    out = mla_decode_attention(q, pool, tables, lens, kv_lora_rank=c["Lkv"], sm_scale=scale,
                               num_splits=3, interpret=True)
    want = reference(q, pool, tables, lens, c["Lkv"], scale)
    assert out.shape == (4, 20, c["Lkv"]) and out.dtype == c["dtype"]
    assert_close(out, want, c["dtype"])
    np.testing.assert_array_equal(np.asarray(out, np.float32)[3], 0.0)
    floats = reference(q, latent.astype(c["dtype"]), tables, lens, c["Lkv"], scale)
    assert np.abs(np.asarray(floats, np.float32) - np.asarray(want, np.float32)).max() > 1e-3


def step_inputs(seed, q_lens, seq_lens, T, *, N=4, P=16, R=16, V=12, Lkv=32, bs=8):
    """A ragged step's layer inputs (``mla_attention``'s) over a random NHD latent pool."""
    rng = np.random.default_rng(seed)
    _, pool, tables, lens = latent_batch(seed, seq_lens, N=N, Lkv=Lkv, R=R, bs=bs)
    q_nope, q_rope, w_uk, w_uv = (
        jnp.asarray(rng.normal(size=shape) / div, jnp.float32) for shape, div in (
            ((T, N, P), 1), ((T, N, R), 1), ((Lkv, N, P), math.sqrt(Lkv)),
            ((Lkv, N, V), math.sqrt(Lkv))))
    md = AttentionMetadata(slot_mapping=jnp.zeros(T, jnp.int32), seq_lens=lens,
                           query_start_loc=jnp.asarray(np.cumsum([0] + q_lens), jnp.int32),
                           block_tables=tables, decode_only=max(q_lens) <= 1)
    return q_nope, q_rope, pool, w_uk, w_uv, md


@pytest.mark.parametrize("q_lens,seq_lens", [
    pytest.param([1, 1, 1, 0], [13, 40, 1, 0], id="decode-only"),
    pytest.param([1, 5, 7, 0], [13, 11, 7, 0], id="mixed", marks=pytest.mark.slow),
])
def test_mla_attention_pallas_path_equals_reference(q_lens, seq_lens):
    """The layer's "pallas" path (decode-only: the kernel, padding tokens past the sequences;
    mixed: the grouped path) equals its "reference" path; padding tokens give zeros."""
    q_nope, q_rope, pool, w_uk, w_uv, md = step_inputs(3, q_lens, seq_lens, T=16)
    got, want = (jax.jit(functools.partial(mla_attention, sm_scale=0.2, impl=impl,
                                           interpret=True))(q_nope, q_rope, pool, w_uk, w_uv, md)
                 for impl in ("pallas", "reference"))
    n = sum(q_lens)
    np.testing.assert_allclose(got[:n], want[:n], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[n:], 0.0)
    if md.decode_only:
        jaxpr = str(jax.make_jaxpr(functools.partial(
            mla_attention, sm_scale=0.2, impl="pallas", interpret=True))(
                q_nope, q_rope, pool, w_uk, w_uv, md))
        assert "jaxkv_mla_decode_attention" in jaxpr


def test_refusals_name_the_problem():
    q, pool, tables, lens = latent_batch(0, [5, 9], N=4, Lkv=48, R=16, bs=8)
    call = functools.partial(mla_decode_attention, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="kv_lora_rank=48"):
        call(q, pool, tables, lens, kv_lora_rank=48)
    with pytest.raises(ValueError, match="qk_rope_head_dim=48"):
        call(q, pool, tables, lens, kv_lora_rank=16)
    q, pool, tables, lens = latent_batch(0, [5, 9], N=4, Lkv=32, R=16, bs=8)
    hnd = HNDPages(pool.swapaxes(1, 2))
    with pytest.raises(ValueError, match="NHD array"):
        call(q, hnd, tables, lens, kv_lora_rank=32)
    int8 = KVCacheSpec(num_layers=1, num_blocks=pool.shape[0], block_size=8, num_kv_heads=1,
                       head_dim=48, kv_cache_dtype="int8")           # not a latent spec
    with pytest.raises(ValueError, match="or fp8 QuantizedPages of one head"):
        call(q, init_cache(int8).k[0], tables, lens, kv_lora_rank=32)
    q_nope, q_rope, _, w_uk, w_uv, md = step_inputs(0, [1, 1], [5, 9], T=2, R=16)
    with pytest.raises(ValueError, match="attention_impl='pallas' reads NHD"):   # any step
        mla_attention(q_nope, q_rope, hnd, w_uk, w_uv, md, sm_scale=0.1, impl="pallas")
    with pytest.raises(ValueError, match="a float latent pool share it"):
        call(q.astype(jnp.bfloat16), pool, tables, lens, kv_lora_rank=32)
    with pytest.raises(ValueError, match="is not a page id"):
        call(q, pool, tables.at[1, 0].set(pool.shape[0]), lens, kv_lora_rank=32)
    with pytest.raises(ValueError, match="block_h=8"):
        MLADecodeConfig(block_h=8)


# --- the engine ----------------------------------------------------------------------------

# a tiny DeepSeek-V2 (no q LoRA) of one dense layer (attention is what differs): latent 32 +
# rotary 16, powers of two as the kernel needs, in a 48-wide cache head (not one: the engine's
# Pallas check reads a latent pool as its two chunks, as DeepSeek's 512 + 64)
TINY_MLA = dict(num_hidden_layers=1, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=None,
                n_shared_experts=1, topk_method="greedy")
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
              num_kv_blocks=48, token_buckets=(64,), seq_buckets=(4,), decode_buckets=(4,))


@pytest.mark.parametrize("kv", ["auto", pytest.param("fp8", marks=pytest.mark.slow)])
def test_engine_pallas_decode_gives_the_default_paths_tokens(tmp_path, caplog, kv):
    """Greedy tokens of three requests on the Pallas path (interpret mode: prefill through the
    grouped path, decode-only steps, a step variant of their own, through the MLA kernel) equal
    the default CPU path's, with a float and (slow; test_fp8_kernel_equals_reference checks the
    kernel on fp8 pools) an fp8 latent cache."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxkv import LLM, SamplingParams
    from tiny_models import austen_prompts, save_tiny_model, save_tokenizer

    save_tokenizer(tmp_path)
    save_tiny_model(tmp_path, "deepseek_v2", **TINY_MLA)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = austen_prompts(3, seed=2, max_chars=120)
    tokens = {}
    for impl in ("grouped", "pallas"):
        with LLM(str(tmp_path), **ENGINE, attention_impl=impl, interpret=True,
                 kv_cache_dtype=kv) as llm, \
                caplog.at_level("INFO", logger="jaxkv"):
            outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[impl] = [o.outputs[0].token_ids for o in outs]
    assert "4 tokens, 4 sequences (width 1, 0 logprobs, decode-only True)" in caplog.text
    assert tokens["pallas"] == tokens["grouped"] and all(len(t) == 10 for t in tokens["grouped"])


# --- bench/gpu_check.py ----------------------------------------------------------------------


def test_gpu_check_mla_section_dry_run():
    """The MLA section of bench/gpu_check.py alone on its dry-run sizes (interpret mode): every
    row timed, and its batch-1 rows' kernel output within tolerance of the spec."""
    from test_gpu_check import load_gpu_check

    gc = load_gpu_check()
    s = gc.DRY
    run = gc.Run(s, gc.artifacts.Executables(gc.artifacts.local_target()))
    report = dict(device="cpu", jax=jax.__version__, dry_run=True, quick=False, sections_s={},
                  artifacts=dict(archives=[]))
    gc.run_sections(run, report, ["copy_gbps", "mla"], None)
    assert not run.errors
    rows = report["mla"]
    assert [(r["context"], r["batch"]) for r in rows] == [
        (c, b) for c in sorted(s.mla_contexts, reverse=True) for b in s.mla_batches]
    assert all(r["ok"] and r["ours_ms"] > 0 and r["h64_ms"] > 0 for r in rows)
    assert [r["batch"] for r in rows if "max_err" in r] == [1]
    assert "## (b5) MLA decode" in gc.markdown(report)
