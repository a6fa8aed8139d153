"""Memory planner: byte counts by hand and against HF transformers, block counts, advice, errors."""

import dataclasses
import re

import pytest

from jaxkv.kvcache.spec import resolve_kv_cache_dtype
from jaxkv.model.config import ModelConfig
from jaxkv.runner import memory_plan
from jaxkv.runner.memory_plan import (GiB, GroupPlan, kv_bytes_per_block, kv_bytes_per_token,
                                      num_parameters, plan, weights_bytes)

SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
    tie_word_embeddings=True)
LLAMA3_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192)
TINY = ModelConfig(
    architecture="llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
# google/gemma-3-1b-it's config.json: every 6th layer full (5, 11, 17, 23), the others slide 512
GEMMA3_1B = ModelConfig(
    architecture="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
    num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768,
    tie_word_embeddings=True, qk_norm=True, gemma=True, query_pre_attn_scalar=256.0,
    sliding_window=512,
    layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                      for i in range(26)))


def test_kv_bytes_per_token_by_hand():
    assert kv_bytes_per_token(SMOLLM2_135M, "fp32") == 2 * 30 * 3 * 64 * 4 == 46080
    # GQA: 8 kv heads, not the seed article's 32 (which gives 512 KiB)
    assert kv_bytes_per_token(LLAMA3_8B, "bf16") == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_bytes_per_token(LLAMA3_8B, "fp8_e4m3") == 2 * 32 * 8 * (128 + 2)   # + bf16 scale
    assert kv_bytes_per_token(LLAMA3_8B, "fp8") == kv_bytes_per_token(LLAMA3_8B, "int8")
    assert kv_bytes_per_token(LLAMA3_8B, "fp16") == kv_bytes_per_token(LLAMA3_8B, "bfloat16")
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bf16"
    assert resolve_kv_cache_dtype("fp8", "float32") == "fp8_e4m3"


def test_parameter_counts_of_known_models():
    assert num_parameters(SMOLLM2_135M) == 134_515_008
    assert num_parameters(LLAMA3_8B) == 8_030_261_248
    assert weights_bytes(LLAMA3_8B, "bfloat16") == 2 * 8_030_261_248


# beyond the shared fields: the mixtures of experts (the experts, not one MLP, a layer),
# Qwen3's q/k norms, Gemma 2's four norms a layer
MOE_FIELDS = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
              "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                mlp_only_layers=[1]),
              "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
              "qwen3": {}, "gemma2": {}}


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True),
                                        ("qwen2", False), ("qwen2", True), ("mistral", False),
                                        *((a, False) for a in MOE_FIELDS)])
def test_weights_bytes_equal_hf_and_jaxkv_parameters(arch, tied):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import jax.numpy as jnp
    from jaxkv.model.llama import param_shapes
    import jax

    cls = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "mixtral": "Mixtral",
           "qwen3_moe": "Qwen3Moe", "gpt_oss": "GptOss", "qwen3": "Qwen3",
           "gemma2": "Gemma2"}[arch]
    hf_config = getattr(transformers, f"{cls}Config")(
        vocab_size=96, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=4, tie_word_embeddings=tied,
        **MOE_FIELDS.get(arch, {}))
    model = getattr(transformers, f"{cls}ForCausalLM")(hf_config)
    hf_elems = sum(p.numel() for p in model.parameters())   # tied weights are counted once
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    assert config.attention_bias == (arch in ("qwen2", "gpt_oss"))
    assert weights_bytes(config, "float32") == 4 * hf_elems
    assert weights_bytes(config, "bfloat16") == 2 * hf_elems
    jaxkv_elems = sum(a.size for a in jax.tree_util.tree_leaves(param_shapes(config, jnp.float32)))
    assert num_parameters(config) == jaxkv_elems


def test_block_counts_from_utilization_and_overrides():
    per_block = kv_bytes_per_token(TINY, "fp32") * 16          # 2*2*2*8*4*16 = 4096
    assert per_block == 4096
    weights = weights_bytes(TINY)
    device = weights + 10 * per_block + 100                    # 10 blocks and change
    p = plan(TINY, device_memory_bytes=device, memory_utilization=1.0, activation_bytes=0,
             max_model_len=64, max_num_seqs=3)
    assert (p.num_blocks, p.num_usable_blocks, p.max_num_tokens) == (10, 9, 144)
    assert p.kv_cache_bytes == 10 * per_block and p.blocks_per_seq == 4
    assert p.max_concurrent_seqs == 2 and p.runs and not p.fits
    p = plan(TINY, device_memory_bytes=device, memory_utilization=1.0, activation_bytes=0,
             max_model_len=64, max_num_seqs=2)
    assert p.fits and p.reasons == ()
    p = plan(TINY, device_memory_bytes=GiB, num_kv_blocks=7, max_model_len=64)
    assert p.num_blocks == 7 and p.kv_cache_bytes == 7 * per_block and p.max_concurrent_seqs == 1
    p = plan(TINY, device_memory_bytes=GiB, kv_cache_bytes=5 * per_block + 1, block_size=16)
    assert p.num_blocks == 5
    p = plan(TINY, device_memory_bytes=GiB, block_size=32, num_kv_blocks=3, max_model_len=64)
    assert p.kv_bytes_per_block == 8192 and p.max_num_tokens == 64 and p.runs


def test_activation_estimate_follows_its_formula():
    E, F, D, Hq, Hkv, V = 32, 64, 8, 4, 2, 100
    want = 16 * ((2 * E + (2 * Hq + 2 * Hkv) * D + 3 * F) * 4
                 + 256 * (2 * Hkv * D * 4 + 2 * Hq * 4)) + 4 * V * 4 * 6
    got = memory_plan.activation_bytes_estimate(TINY, max_num_batched_tokens=16, max_num_seqs=4)
    assert got == want
    p = plan(TINY, device_memory_bytes=GiB, max_num_batched_tokens=16, max_num_seqs=4,
             max_model_len=64)
    assert p.activation_bytes == want
    assert p.weights_bytes + p.activation_bytes + p.kv_cache_bytes <= p.budget_bytes


def _lever(reasons, pattern):
    for r in reasons:
        m = re.search(pattern, r)
        if m:
            return int(m.group(1).replace(",", ""))
    raise AssertionError(f"no reason matches {pattern!r}: {reasons}")


def test_kv_shortage_reasons_name_levers_that_fit():
    kw = dict(device_memory_bytes=80 * GiB, dtype="bfloat16", max_model_len=8192,
              max_num_seqs=256)
    p = plan(LLAMA3_8B, **kw)
    assert p.runs and not p.fits
    assert p.reasons[0].startswith("needs 256.00 GiB of KV for 256 x 8,192 tokens")
    # each suggested value, applied, fits; one step beyond it does not
    longest = _lever(p.reasons, r"max_model_len <= ([\d,]+) would fit")
    assert longest == (p.num_usable_blocks // 256) * 16
    assert plan(LLAMA3_8B, **{**kw, "max_model_len": longest}).fits
    assert not plan(LLAMA3_8B, **{**kw, "max_model_len": longest + 16}).fits
    seqs = _lever(p.reasons, r"max_num_seqs <= ([\d,]+) would fit")
    assert seqs >= p.max_concurrent_seqs       # fewer sequences also shrink the sampler's share
    assert plan(LLAMA3_8B, **{**kw, "max_num_seqs": seqs}).fits
    assert not plan(LLAMA3_8B, **{**kw, "max_num_seqs": seqs + 1}).fits
    fp8 = _lever(p.reasons, r"kv_cache_dtype='fp8_e4m3' \(or 'fp8_e5m2', 'int8'\) holds ([\d,]+)")
    assert fp8 == plan(LLAMA3_8B, **{**kw, "kv_cache_dtype": "fp8"}).max_concurrent_seqs
    assert any(r.startswith("add tensor parallelism: 4 devices") for r in p.reasons)


def test_utilization_lever_and_one_sequence_shortage():
    kw = dict(device_memory_bytes=21 * GiB, dtype="bfloat16", max_model_len=8192,
              max_num_seqs=2)
    p = plan(LLAMA3_8B, **kw)
    assert p.runs and not p.fits
    u = re.search(r"raise memory_utilization: ([\d.]+) would fit", " ".join(p.reasons))
    assert u and plan(LLAMA3_8B, **kw, memory_utilization=float(u.group(1))).fits
    assert not plan(LLAMA3_8B, **kw, memory_utilization=float(u.group(1)) - 0.01).fits
    kw = dict(kw, device_memory_bytes=20 * GiB)
    p = plan(LLAMA3_8B, **kw)
    assert not p.runs and p.reasons[0].startswith("needs 1.00 GiB of KV for 1 x 8,192 tokens")
    longest = _lever(p.reasons, r"max_model_len <= ([\d,]+) would fit")
    assert plan(LLAMA3_8B, **{**kw, "max_model_len": longest}).runs
    assert not plan(LLAMA3_8B, **{**kw, "max_model_len": longest + 16}).runs


def test_weights_that_do_not_fit_suggest_bf16_tensor_parallelism_and_fewer_tokens():
    p = plan(LLAMA3_8B, device_memory_bytes=16 * GiB, max_model_len=8192)
    assert not p.runs and p.num_blocks == 0
    assert p.reasons[0].startswith("weights 29.92 GiB (float32) + activations")
    text = "\n".join(p.reasons)
    assert "use dtype='bfloat16': weights become 14.96 GiB, is not enough" in text
    assert "add tensor parallelism: 4 devices" in text and "kv_cache_dtype" not in text
    kw = dict(device_memory_bytes=18 * GiB, dtype="bfloat16", max_model_len=8192, max_num_seqs=4)
    p = plan(LLAMA3_8B, **kw)
    assert not p.runs and "exceed the budget" in p.reasons[0]
    tokens = _lever(p.reasons, r"max_num_batched_tokens: <= ([\d,]+) shrinks")
    assert plan(LLAMA3_8B, **kw, max_num_batched_tokens=tokens).runs
    assert not plan(LLAMA3_8B, **kw, max_num_batched_tokens=tokens + 1).runs


def test_weights_that_do_not_fit_suggest_quantizing_them_at_load():
    """The lever names the mildest ``quantization`` that fits, at the bytes
    ``quantize.stored_bytes`` counts (what the engine holds, tests/test_quantize_on_load.py);
    re-planned with those bytes the model runs."""
    from jaxkv.model import quantize
    from jaxkv.model.weights import expected_shapes

    kw = dict(device_memory_bytes=16 * GiB, dtype="bfloat16", max_model_len=8192)
    p = plan(LLAMA3_8B, **kw)
    assert not p.runs
    stored = {m: quantize.stored_bytes(expected_shapes(LLAMA3_8B), m, 128, 2)
              for m in quantize.METHODS}
    assert stored["int8"] == stored["fp8"] > stored["int4"]
    lever = next(r for r in p.reasons if r.startswith("quantize the weights"))
    assert lever == (f"quantize the weights: quantization='int8' (or 'fp8') holds the dense "
                     f"projections in {memory_plan.format_bytes(stored['int8'])} of weights, "
                     "would fit")
    assert plan(LLAMA3_8B, **kw, stored_weights_bytes=stored["int8"]).runs
    p = plan(LLAMA3_8B, **{**kw, "device_memory_bytes": 11 * GiB})
    assert any(r.startswith("quantize the weights: quantization='int4' holds") and
               r.endswith("would fit") for r in p.reasons)


def test_indivisible_kv_heads_rule_out_tensor_parallelism():
    p = plan(SMOLLM2_135M, device_memory_bytes=2 * GiB, max_model_len=8192)
    assert not p.fits
    assert any("cannot split num_kv_heads=3" in r for r in p.reasons)


def test_explicit_pool_larger_than_budget_is_reported():
    p = plan(TINY, device_memory_bytes=1 << 20, activation_bytes=0, num_kv_blocks=1000,
             max_model_len=64)
    assert not p.runs and "exceed the budget" in p.reasons[0]


def test_summary_renders_the_table():
    text = plan(LLAMA3_8B, device_memory_bytes=80 * GiB, dtype="bfloat16",
                max_model_len=8192).summary()
    for needle in ("weights (bfloat16)", "14.96 GiB", "KV bytes per token", "131,072 B",
                   "blocks (incl. null block 0)", "runs / fits", "yes / no", "- needs"):
        assert needle in text


def test_hybrid_blocks_hold_one_page_per_pool_slot():
    """Gemma 3 1B: 4 full layers and 22 sliding ones cut into groups of <= 4 layers, so a
    block id owns 4 pages (K and V, 16 tokens, 1 kv head of 256 bf16 channels), not 26."""
    page = 2 * 16 * 1 * 256 * 2                                  # K and V of one slot: 16 KiB
    assert kv_bytes_per_block(GEMMA3_1B, "bf16", 16) == 4 * page == 65_536
    assert kv_bytes_per_block(GEMMA3_1B, "bf16", 16, hybrid_kv_cache=False) == 26 * page
    p = plan(GEMMA3_1B, device_memory_bytes=80 * GiB, dtype="bfloat16")
    assert p.kv_bytes_per_block == 4 * page and p.kv_bytes_per_token == 4 * page // 16


def test_hybrid_groups_blocks_per_sequence():
    """A full group holds all 2,048 blocks of a 32K sequence; a sliding one the window's 511
    positions before a step plus the step's 2,048 tokens, starting anywhere in a block."""
    p = plan(GEMMA3_1B, device_memory_bytes=80 * GiB, dtype="bfloat16", max_model_len=32768)
    slide = (511 + 2048) // 16 + 2                                # 161 blocks
    token = 2 * 1 * 256 * 2                                       # B per token and layer
    assert p.groups == (GroupPlan(None, 4, 4 * token, 2048),
                        *[GroupPlan(512, 4, 4 * token, slide)] * 4,
                        *[GroupPlan(512, 3, 3 * token, slide)] * 2)
    assert p.hybrid and p.blocks_per_seq == 2048 + 6 * 161 == 3014
    text = p.summary()
    for needle in ("KV bytes per token (4 pool slots)", "group 0: full, 4 layers",
                   "group 6: sliding 512, 3 layers", "2,048 blocks/seq", "161 blocks/seq",
                   "blocks per 32,768-token sequence"):
        assert needle in text
    full = plan(GEMMA3_1B, device_memory_bytes=80 * GiB, dtype="bfloat16", max_model_len=32768,
                hybrid_kv_cache=False)
    assert full.groups == (GroupPlan(None, 26, 26 * token, 2048),) and not full.hybrid
    assert "group" not in full.summary() and "pool slots" not in full.summary()


def test_hybrid_cache_holds_more_32k_sequences():
    """Per 32K sequence: 3,014 blocks of 4 pages (hybrid) against 2,048 blocks of 26 pages
    (every layer caches every token), 4.42x fewer bytes, so 4.42x the sequences."""
    page = 2 * 16 * 256 * 2
    kw = dict(device_memory_bytes=80 * GiB, dtype="bfloat16", max_model_len=32768,
              kv_cache_bytes=64 * GiB)
    hybrid = plan(GEMMA3_1B, **kw)
    full = plan(GEMMA3_1B, **kw, hybrid_kv_cache=False)
    assert hybrid.max_concurrent_seqs == (64 * GiB // (4 * page) - 1) // 3014 == 347
    assert full.max_concurrent_seqs == (64 * GiB // (26 * page) - 1) // 2048 == 78
    ratio = (26 * 2048) / (4 * 3014)                              # 4.417
    assert full.max_concurrent_seqs * ratio <= hybrid.max_concurrent_seqs
    assert hybrid.max_concurrent_seqs < (full.max_concurrent_seqs + 1) * ratio


def test_hybrid_equal_buckets_and_advice():
    """gpt-oss-20b's shape (alternate sliding 128 / full from layer 0): two groups of 12 layers
    over 12 slots; a plan that does not fit offers fp8 with the hybrid count of sequences."""
    config = dataclasses.replace(
        LLAMA3_8B, num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64,
        max_position_embeddings=131072, sliding_window=128,
        layer_types=("sliding_attention", "full_attention") * 12)
    kw = dict(device_memory_bytes=80 * GiB, dtype="bfloat16", max_model_len=32768,
              max_num_seqs=4096)
    p = plan(config, **kw)
    assert kv_bytes_per_block(config, "bf16", 16) == 12 * 2 * 16 * 8 * 64 * 2
    assert [(g.kind, g.num_layers, g.blocks_per_seq) for g in p.groups] == [
        ("full", 12, 2048), ("sliding 128", 12, (127 + 2048) // 16 + 2)]
    fp8 = _lever(p.reasons, r"kv_cache_dtype='fp8_e4m3' .* holds ([\d,]+)")
    assert fp8 == plan(config, **kw, kv_cache_dtype="fp8").max_concurrent_seqs
    assert fp8 > p.max_concurrent_seqs


def test_one_attention_kind_plans_the_same_either_way():
    for config in (LLAMA3_8B, dataclasses.replace(LLAMA3_8B, sliding_window=4096)):
        kw = dict(device_memory_bytes=80 * GiB, dtype="bfloat16", max_model_len=8192)
        p = plan(config, **kw)
        assert p == plan(config, **kw, hybrid_kv_cache=False)
        assert p.groups == (GroupPlan(None, 32, 131072, 512),) and p.blocks_per_seq == 512
        assert p.summary() == plan(config, **kw, hybrid_kv_cache=False).summary()


def test_retention_is_refused_on_a_hybrid_cache():
    kw = dict(device_memory_bytes=80 * GiB, dtype="bfloat16", retained_blocks_per_seq=40)
    with pytest.raises(ValueError, match="^retained_blocks_per_seq=40: .*hybrid_kv_cache=False"):
        plan(GEMMA3_1B, **kw)
    assert plan(GEMMA3_1B, **kw, hybrid_kv_cache=False).blocks_per_seq == 40
    assert plan(LLAMA3_8B, **kw).blocks_per_seq == 40


@pytest.mark.parametrize("kwargs, field", [
    (dict(device_memory_bytes=0), "device_memory_bytes"),
    (dict(memory_utilization=0.0), "memory_utilization"),
    (dict(memory_utilization=1.2), "memory_utilization"),
    (dict(dtype="int3"), "dtype"),
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_model_len=257), "max_model_len"),
    (dict(activation_bytes=-1), "activation_bytes"),
    (dict(kv_cache_bytes=-1), "kv_cache_bytes"),
    (dict(num_kv_blocks=1), "num_kv_blocks"),
    (dict(num_kv_blocks=4, kv_cache_bytes=10), "kv_cache_bytes and num_kv_blocks"),
])
def test_bad_arguments_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}"):
        plan(TINY, **{"device_memory_bytes": GiB, **kwargs})


def test_unknown_kv_dtype_lists_the_choices():
    with pytest.raises(ValueError, match=r"^kv_cache_dtype='int3'.*fp8_e4m3.*int8"):
        plan(TINY, device_memory_bytes=GiB, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="kv_cache_dtype='auto' needs the model dtype"):
        memory_plan.kv_bytes_per_vector("auto", 64)


def test_host_memory_budget(monkeypatch):
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    budget = memory_plan.host_memory_budget()
    assert 0 < budget <= info["MemAvailable"]    # half of a value that moves between the reads
    assert budget % (info["MemTotal"] // 16) == 0
    assert memory_plan.host_memory_budget(fraction=1.0) > budget
    with pytest.raises(ValueError, match="^fraction="):
        memory_plan.host_memory_budget(fraction=0.0)
    # 16 GiB total: half the available memory, down to a GiB; the same while free memory drifts
    # within a step, so a restart plans the same pool (and hits the compilation cache)
    for available, want in ((9.9, 4), (9.1, 4), (10.1, 5), (1.5, 0.75)):
        monkeypatch.setattr(memory_plan, "_host_memory", lambda: (16 * GiB, int(available * GiB)))
        assert memory_plan.host_memory_budget() == int(want * GiB), available


def test_the_cpu_pool_is_sized_to_the_work(monkeypatch):
    """On the CPU an engine's pool holds at most ``CPU_KV_CACHE_BYTES`` (one full-length
    sequence at least) and what max_num_seqs full-length sequences use; a given size, or a
    given device's memory, is planned as before."""
    from jaxkv.config import EngineConfig
    from jaxkv.runner.model_runner import plan_memory

    monkeypatch.setattr(memory_plan, "_host_memory", lambda: (64 * GiB, 60 * GiB))   # 28 GiB budget
    per_block = kv_bytes_per_token(SMOLLM2_135M, "fp32") * 16

    def cpu_plan(model=SMOLLM2_135M, **kwargs):
        return plan_memory(EngineConfig.from_kwargs(**kwargs), model)

    p = cpu_plan()
    assert p.num_blocks == memory_plan.CPU_KV_CACHE_BYTES // per_block and p.runs and not p.fits
    assert p.kv_source.startswith("the CPU default 2.00 GiB")
    assert p.headline().startswith(f"KV pool: {p.num_blocks - 1:,} blocks x 16 tokens")
    assert "(the CPU default 2.00 GiB; --kv-cache-memory sets it)" in p.headline()
    p = cpu_plan(max_num_seqs=2)
    assert p.num_blocks == 2 * 8192 // 16 + 1 and p.fits
    assert p.kv_source == "capped at max_num_seqs=2 sequences of 8,192 tokens"
    p = cpu_plan(kv_cache_memory_bytes=4 * GiB)
    assert p.num_blocks == 4 * GiB // per_block
    assert p.kv_source == f"given kv_cache_memory_bytes={4 * GiB}"
    # one 8,192-token sequence of fp32 KV is 2 GiB + a block: the pool grows to hold it
    p = cpu_plan(LLAMA3_8B, dtype="bfloat16", kv_cache_dtype="fp32")
    assert p.num_blocks == 8192 // 16 + 1 and p.runs
    p = plan_memory(EngineConfig.from_kwargs(), SMOLLM2_135M, device_memory_bytes=16 * GiB)
    assert p.kv_cache_bytes > 10 * GiB                 # a device's memory given: no CPU default
    assert p.kv_source.endswith("x 16.00 GiB less weights and activations")
