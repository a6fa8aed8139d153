"""DeepSeek-V2/V3 multi-head latent attention over the paged latent cache: the engine against HF
transformers (fp32, CPU) on tiny random checkpoints written by transformers, the absorbed
attention against its pure-jnp spec and against the expanded (MHA) form, the latent pool's
bytes, the planner's, and the refusals."""

import dataclasses
import functools
import importlib.util
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention.mla import (absorb_query, mla_attention, mla_attention_expanded,
                                 mla_attention_reference)
from jaxkv.attention.mla_prefill import expanded_min_tokens, mla_prefill_attention
from jaxkv.kvcache.metadata import AttentionMetadata
from jaxkv.kvcache.pages import init_cache
from jaxkv.kvcache.pools import HNDPages
from jaxkv.kvcache.spec import KVCacheSpec
from jaxkv.model.config import ModelConfig
from jaxkv.model.mla import softmax_scale
from jaxkv.runner import memory_plan, sharding


def _load_bench(name):
    """bench/<name>.py as a module (the released configs and the planner table live there)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                        f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MLA_PLAN = _load_bench("mla_plan")
V3, V2_LITE = MLA_PLAN.CONFIGS["DeepSeek-V3"], MLA_PLAN.CONFIGS["DeepSeek-V2-Lite"]


def test_released_configs_read_as_a_latent_cache():
    """V3: q LoRA, sigmoid router in 8 groups, 3 dense layers; V2-Lite: no q LoRA, greedy
    softmax routing (one group); both cache one 576-wide latent head, and their softmax scales
    are HF's ``yarn_apply_mscale`` values (docs: 0.135234, 0.114721)."""
    v3, lite = ModelConfig.from_hf_dict(V3), ModelConfig.from_hf_dict(V2_LITE)
    assert (v3.num_kv_heads, v3.head_dim, v3.rope_dim, v3.kv_cache_v_dim) == (1, 576, 64, 0)
    assert v3.mla.q_lora_rank == 1536 and lite.mla.q_lora_rank is None
    assert (v3.router_scoring, v3.num_expert_groups, v3.topk_groups) == ("sigmoid", 8, 4)
    assert (lite.router_scoring, lite.num_expert_groups, lite.num_shared_experts) == (
        "softmax", 1, 2)
    assert v3.dense_layers == (0, 1, 2) and lite.dense_layers == (0,)
    assert v3.norm_topk_prob and not lite.norm_topk_prob and v3.routed_scaling_factor == 2.5
    assert softmax_scale(v3) == pytest.approx(0.135234, abs=1e-6)
    assert softmax_scale(lite) == pytest.approx(0.114721, abs=1e-6)
    assert sharding.valid_tensor_parallel_sizes(lite, 4) == [1, 2, 4]    # tests/test_mla_tp.py


def test_latent_pool_bytes_per_token_from_the_arrays():
    """A V3-shaped latent pool (bf16) holds 576 x 2 = 1,152 bytes per token per layer, counted
    from the allocated arrays (the V pool is zero-width); the planner says the same, and counts
    V3's and V2-Lite's parameters."""
    spec = KVCacheSpec(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=1, head_dim=576,
                       v_head_dim=0, dtype="bfloat16")
    cache = init_cache(spec)
    per_layer = [(k.nbytes + v.nbytes) / (spec.num_blocks * spec.block_size)
                 for k, v in zip(jax.tree.leaves(cache.k), jax.tree.leaves(cache.v))]
    assert per_layer == [576 * 2] * 2 and cache.nbytes == spec.nbytes
    v3 = ModelConfig.from_hf_dict(V3)
    assert memory_plan.kv_bytes_per_token(v3, "bf16") == 61 * 1152
    assert memory_plan.kv_bytes_per_block(v3, "bf16", 64) == 64 * 61 * 1152
    lite = ModelConfig.from_hf_dict(V2_LITE)       # the released sizes: 671B and 15.7B
    assert round(memory_plan.num_parameters(v3) / 1e9) == 671
    assert round(memory_plan.num_parameters(lite) / 1e8) == 157


def test_plan_table_counts_the_allocated_latent_bytes():
    """bench/mla_plan.py's rows: the MLA bytes per token are an allocated V3 / V2-Lite latent
    pool's (one device's spec from the planner, its arrays counted), the MHA ones N (P + R + V)
    bf16 values per layer, and the sequences at 8K and 32K what a 40 GiB pool of 16-token blocks
    holds of each (null block kept)."""
    rows = MLA_PLAN.table(40 << 30, 80 << 30)
    fixed = {r["model"]: r for r in rows if r["pool"] == "fixed"}
    for name, layers, heads in (("DeepSeek-V3", 61, 128), ("DeepSeek-V2-Lite", 27, 16)):
        c, r = ModelConfig.from_hf_dict(MLA_PLAN.CONFIGS[name]), fixed[name]
        spec = dataclasses.replace(memory_plan.device_kv_spec(c, "bf16", 16, dtype="bfloat16"),
                                   num_blocks=3)
        cache = init_cache(spec)
        arrays = sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v)))
        assert r["mla_bytes_per_token"] == arrays // (3 * 16) == layers * 576 * 2
        assert r["mha_bytes_per_token"] == layers * heads * (192 + 128) * 2
        for ctx, (mla, mha) in r["seqs"].items():
            blocks = ctx // 16
            assert mla == ((40 << 30) // (16 * r["mla_bytes_per_token"]) - 1) // blocks
            assert mha == ((40 << 30) // (16 * r["mha_bytes_per_token"]) - 1) // blocks
    assert fixed["DeepSeek-V3"]["seqs"][32768] == (18, 0)
    # over 16 devices each holds the whole latent but an MHA cache's 8 heads of V3's 128
    v3_tp = MLA_PLAN.table(40 << 30, 141 << 30, 16)[1]
    assert v3_tp["mla_bytes_per_token"] == 61 * 576 * 2
    assert v3_tp["mha_bytes_per_token"] == 61 * 8 * (192 + 128) * 2 and v3_tp["kv_budget"] > 0


@pytest.mark.parametrize("kv", ["int8", "int4"])      # fp8: tests/test_mla_fp8.py
def test_quantized_latent_cache_refused_naming_kv_cache_dtype(kv):
    with pytest.raises(ValueError, match="kv_cache_dtype=.*latent"):
        KVCacheSpec(num_layers=1, num_blocks=4, block_size=16, num_kv_heads=1, head_dim=576,
                    v_head_dim=0, kv_cache_dtype=kv)


def _random_step(seed, *, N=4, P=16, R=8, V=12, Lkv=32, bs=4, hnd=False):
    """A ragged step (a decode token, a prefill chunk after cached tokens, a fresh prompt, a
    padding sequence) over a random latent pool whose blocks are shuffled."""
    q_lens, seq_lens = [1, 5, 7, 0], [13, 11, 7, 0]
    S, B, T = len(q_lens), 4, 16
    rng = np.random.default_rng(seed)
    tables = np.zeros((S, B), np.int32)
    ids = 1 + rng.permutation(S * B)
    for s, n in enumerate(seq_lens):
        tables[s, :-(-n // bs)] = ids[s * B:s * B + -(-n // bs)]
    pool = jnp.asarray(rng.normal(size=(S * B + 1, bs, 1, Lkv + R)), jnp.float32)
    if hnd:
        pool = HNDPages(pool.swapaxes(1, 2))
    md = AttentionMetadata(slot_mapping=jnp.zeros(T, jnp.int32),
                           query_start_loc=jnp.asarray(np.cumsum([0] + q_lens), jnp.int32),
                           seq_lens=jnp.asarray(seq_lens, jnp.int32),
                           block_tables=jnp.asarray(tables))
    q_nope, q_rope, w_uk, w_uv = (
        jnp.asarray(rng.normal(size=shape) / div, jnp.float32) for shape, div in (
            ((T, N, P), 1), ((T, N, R), 1), ((Lkv, N, P), math.sqrt(Lkv)),
            ((Lkv, N, V), math.sqrt(Lkv))))
    return q_nope, q_rope, pool, w_uk, w_uv, md, sum(q_lens)


def test_absorbed_equals_expanded_and_cpu_path_equals_spec():
    """The absorbed form (W_UK in the query, W_UV after) through the spec and through the CPU
    path (the latent as K and V of one kv head) equals the expanded MHA form on random inputs
    (the CPU path's head-major pool); padding tokens come out zero."""
    q_nope, q_rope, pool, w_uk, w_uv, md, n = _random_step(0, hnd=True)
    scale = 0.3
    want = jax.jit(mla_attention_expanded, static_argnames="sm_scale")(q_nope, q_rope, pool, w_uk, w_uv, md.block_tables,
                                  md.seq_lens, md.query_start_loc, sm_scale=scale)
    got = {}
    for impl in ("reference", "grouped"):
        run = jax.jit(functools.partial(mla_attention, sm_scale=scale, impl=impl))
        got[impl] = run(q_nope, q_rope, pool, w_uk, w_uv, md)
        np.testing.assert_allclose(got[impl][:n], want[:n], atol=2e-5, rtol=1e-5)
        np.testing.assert_array_equal(got[impl][n:], 0.0)
    np.testing.assert_allclose(got["grouped"], got["reference"], atol=1e-5, rtol=1e-5)
    q = absorb_query(q_nope, q_rope, w_uk)
    spec = mla_attention_reference(q, pool, md.block_tables, md.seq_lens, md.query_start_loc,
                                   kv_lora_rank=w_uk.shape[0], sm_scale=scale)
    assert spec.shape == (q.shape[0], q.shape[1], w_uk.shape[0])
    with pytest.raises(ValueError, match="'pallas' reads NHD latent pools, not HNDPages"):
        mla_attention(q_nope, q_rope, pool, w_uk, w_uv, md, sm_scale=scale, impl="pallas")


@pytest.mark.parametrize("hnd", [False, True])
def test_expanded_prefill_equals_the_spec(hnd):
    """The chunked, tiled expanded form (kv chunks of one 4-token block, query tiles of 2, so
    tiles cross chunks and sequences) equals the pure-jnp expanded spec for the chosen
    sequences' tokens and leaves the others zero."""
    q_nope, q_rope, pool, w_uk, w_uv, md, n = _random_step(1, hnd=hnd)
    layout = (md.block_tables, md.seq_lens, md.query_start_loc)
    want = mla_attention_expanded(q_nope, q_rope, pool, w_uk, w_uv, *layout, sm_scale=0.3)
    run = jax.jit(functools.partial(mla_prefill_attention, sm_scale=0.3, block_q=2, kv_chunk=4))
    for chosen in ([True] * 4, [False, True, False, True], [True, False, True, False]):
        got = run(q_nope, q_rope, pool, w_uk, w_uv, *layout, jnp.asarray(chosen))
        seq = np.repeat(np.arange(4), [1, 5, 7, 0])
        picked = np.asarray(chosen)[seq]
        np.testing.assert_allclose(got[:n][picked], want[:n][picked], atol=2e-5, rtol=1e-5)
        np.testing.assert_array_equal(got[:n][~picked], 0.0)
        np.testing.assert_array_equal(got[n:], 0.0)


def test_expanded_min_tokens_follows_the_multiply_add_model():
    """DeepSeek's shapes cross over at 171 query tokens per sequence, the tests' tiny ones at 25
    (Lkv 32, P 16, V 12); a latent no wider than the heads' K and V: expanded past decode."""
    assert expanded_min_tokens(512, 128, 128) == round(512 * 256 / 768) == 171
    assert expanded_min_tokens(32, 16, 12) == 25
    assert expanded_min_tokens(64, 64, 64) == 2


# --- the engine against transformers -------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jaxkv import LLM, SamplingParams  # noqa: E402
from tiny_models import austen_text, hf_reference, save_tiny_model, save_tokenizer  # noqa: E402

# transformers' fields beyond tiny_models' defaults (64 wide, 2 layers, 4 heads): the latent 32
# + rotary 8 (a 40-wide cache head), 8 routed experts (more than a decode step's tokens use),
# a dense first layer; V2 without q LoRA (V2-Lite), 2 shared experts, greedy softmax routing;
# V3 with q LoRA, sigmoid routing with a bias in 4 groups (top 2), scaled, YaRN with mscale
MLA_SHAPES = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, first_k_dense_replace=1)
ARCHITECTURES = {
    "deepseek_v2": dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy"),
    "deepseek_v3": dict(q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, max_position_embeddings=256,
                        rope_parameters=dict(rope_type="yarn", factor=4.0, mscale=0.8,
                                             mscale_all_dim=0.8, rope_theta=10000.0,
                                             original_max_position_embeddings=64)),
}
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
              token_buckets=(8, 32), seq_buckets=(4,), prefix_caching="hash",
              num_kv_blocks=40)     # 39 usable blocks of 8: the four requests do not fit at once
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tokenizer(path)
    model = save_tiny_model(path, request.param, **MLA_SHAPES, **ARCHITECTURES[request.param])
    with torch.no_grad():    # norms and V3's choice bias away from HF's init, so each is checked
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None    # plain argmax, as ignore_eos
    return request.param, path, model


@pytest.fixture
def prefill_forms(monkeypatch):
    """Counts the layer's traces of the expanded form; ``force(n)`` sets the fewest query tokens
    a sequence needs to attend expanded (2: every prefill chunk; a huge n: absorbed only)."""
    import jaxkv.model.mla as layer

    traces = []

    def counted(*args, **kw):
        traces.append(args[0].shape)
        return mla_prefill_attention(*args, **kw)

    monkeypatch.setattr(layer, "mla_prefill_attention", counted)

    def force(n):
        monkeypatch.setattr(layer, "expanded_min_tokens", lambda *_: n)

    return traces, force


def _generate(path, new_tokens: int = NEW_TOKENS, **engine):
    """The workload of the engine tests: four requests, two sharing a 96-token prefix with a
    finished one (prefix hits), prompts longer than a step's 32 tokens (chunked prefill), batched
    in a pool too small for all (preemption). Returns (prompts, outputs, stats, cache)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    with LLM(str(path), **ENGINE, **engine) as llm:
        ids = llm.tokenizer.encode(austen_text(8000))
        shared = ids[:96]
        prompts = [shared + ids[200:240], ids[300:450], shared + ids[500:530], ids[600:620]]
        first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
        outs = first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params,
                                    use_tqdm=False)
        return prompts, [o.outputs[0] for o in outs], llm.stats(), llm.engine.runner.cache


def _assert_equals_hf(arch, model, prompts, outs):
    for prompt, got in zip(prompts, outs):
        want_tokens, want_logprobs = hf_reference(model, prompt, NEW_TOKENS)
        assert got.token_ids == want_tokens, arch
        logprobs = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("offload", [
    pytest.param({}, id="recompute"), pytest.param(dict(kv_offload_bytes=1 << 20, preemption_mode="swap"),
                     marks=pytest.mark.slow, id="swap")])
def test_engine_equals_transformers(checkpoint, offload, prefill_forms):
    """The workload (``_generate``; slow: preempted sequences swapped to the host tier and back)
    with the layer's own choice of form (chunks of 25+ tokens expanded, the rest absorbed, so
    steps mix both): every request's greedy tokens and logprobs are HF's; the latent pool
    holds one 40-wide head per token and layer."""
    arch, path, model = checkpoint
    traces, _ = prefill_forms
    prompts, outs, stats, cache = _generate(path, **offload)
    assert traces, "no step ran the expanded form"
    assert stats["prefix_cache_hits"] >= (88 if offload else 2 * 88), stats
    assert stats["num_preemptions"] > 0, stats
    assert stats.get("num_swap_preemptions", 0) > 0 or not offload, stats
    tokens = ENGINE["num_kv_blocks"] * ENGINE["block_size"]
    assert [(k.nbytes + v.nbytes) // tokens for k, v in zip(
        jax.tree.leaves(cache.k), jax.tree.leaves(cache.v))] == [(32 + 8) * 4] * 2
    _assert_equals_hf(arch, model, prompts, outs)


@pytest.mark.slow     # the default suite: test_engine_equals_transformers runs both forms
def test_expanded_prefill_equals_absorbed_only(checkpoint, prefill_forms):
    """Every prefill chunk expanded, against the absorbed-only engine (the expanded form never
    traced) and against HF: the same greedy tokens, logprobs within 1e-4 of both."""
    arch, path, model = checkpoint
    traces, force = prefill_forms
    force(1 << 30)
    prompts, absorbed, _, _ = _generate(path)
    assert not traces
    force(2)
    _, expanded, stats, _ = _generate(path)
    assert traces and stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    for a, e in zip(absorbed, expanded):
        assert a.token_ids == e.token_ids, arch
        np.testing.assert_allclose([lp[t] for lp, t in zip(e.logprobs, e.token_ids)],
                                   [lp[t] for lp, t in zip(a.logprobs, a.token_ids)],
                                   atol=1e-4, rtol=0)
    _assert_equals_hf(arch, model, prompts, expanded)


def test_engine_refuses_a_quantized_latent_cache(checkpoint):
    """A quantized KV cache is refused naming the field, before any weight loads."""
    _, path, _ = checkpoint
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(str(path), **ENGINE, kv_cache_dtype="int8")


def test_a_latent_cache_short_of_room_is_advised_fp8_not_an_integer_format():
    """The planner's checklist for an MLA model short of KV offers fp8 (with its e5m2
    alternative) and no integer format a latent cache refuses; the count is the fp8 plan's."""
    c = ModelConfig.from_hf_dict(V2_LITE)
    kw = dict(device_memory_bytes=80 * memory_plan.GiB, dtype="bfloat16", max_model_len=32768,
              max_num_seqs=256)
    p = memory_plan.plan(c, **kw)
    assert p.runs and not p.fits
    kv = [r for r in p.reasons if r.startswith("quantize the KV cache")]
    assert len(kv) == 1 and "int" not in kv[0]
    held = int(re.search(r"kv_cache_dtype='fp8_e4m3' \(or 'fp8_e5m2'\) holds ([\d,]+)",
                         kv[0]).group(1).replace(",", ""))
    assert held == memory_plan.plan(c, **{**kw, "kv_cache_dtype": "fp8"}).max_concurrent_seqs
