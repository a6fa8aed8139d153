"""Tensor parallelism, data-parallel replicas and sharded checkpoints on 8 fake CPU devices.

Every multi-device check runs tests/tp_worker.py in a subprocess (tests/tp_runner.py) with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (the flag must precede jax's import; this
pytest process already imported jax with one device) and asserts on the JSON it prints.
The two-process jax.distributed run and the Pallas-under-shard_map run are in
tests/test_sharding_multihost.py.
"""

import pytest

from jaxkv.model import store
from jaxkv.model.config import ModelConfig
from jaxkv.model.weights import load_config
from jaxkv.runner import memory_plan, sharding

pytest.importorskip("torch")
from tp_runner import TINY, run_worker, write_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {kind: write_tiny(tmp_path_factory.mktemp(kind), kind) for kind in TINY}


@pytest.mark.parametrize("kind", [   # gpt_oss covers mixtral's experts under TP too
    pytest.param(k, marks=pytest.mark.slow) if k in ("qwen2", "mixtral") else k for k in TINY])
def test_tp_and_dp_give_the_tokens_of_one_device(tiny, kind):
    r = run_worker("parity", tiny[kind], "--tp", 1, 2, 4, 8, "--dp-tp", 2, 4)
    ref = r["tp1"]
    assert len(ref) == 3 and all(len(t) == 8 for t in ref)
    for name in ("tp2", "tp4", "tp8", "dp2xtp4"):
        assert r[name] == ref, name
    assert r["dp_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # per-device KV bytes per token slot (2 layers, or gpt-oss's hybrid cache: its sliding and
    # full layer overlay 1 pool slot, x K,V x heads per device x 16 dims x 4 bytes)
    hkv, slots = TINY[kind]["num_key_value_heads"], 1 if kind == "gpt_oss" else 2
    for tp in (1, 2, 4, 8):
        per_device = max(hkv, tp) // tp
        assert r[f"tp{tp}_plan"] == [slots * 2 * per_device * 16 * 4, max(tp // hkv, 1)]


def test_grouped_attention_under_tp_gives_the_reference_tokens(tiny):
    """The grouped CPU attention under ``shard_map`` (each device its kv-head shard; TP 4
    repeats llama's 2 kv heads) gives one device's reference tokens."""
    ref = run_worker("parity", tiny["llama"], "--tp", 1)["tp1"]
    r = run_worker("parity", tiny["llama"], "--tp", 1, 2, 4, "--attention-impl", "grouped",
                   devices=4)
    assert r["tp1"] == r["tp2"] == r["tp4"] == ref


@pytest.mark.slow
def test_streaming_retention_under_tp_gives_the_tokens_of_one_device(tiny):
    """Sinks + window with dropped blocks and sink queries (split over heads under shard_map)
    at TP 2 and 4 give TP 1's tokens, past the window (prompts ~10 tokens + 40 generated)."""
    r = run_worker("streaming", tiny["llama"], "--tp", 1, 2, 4, "--attention-impl", "grouped",
                   "--tokens", 40, devices=4)
    assert all(len(t) == 40 for t in r["tp1"])
    assert r["tp2"] == r["tp4"] == r["tp1"]


@pytest.mark.slow
def test_scored_retention_under_tp_gives_the_tokens_of_one_device(tiny):
    """H2O and SnapKV rank blocks by attention mass summed over every head, so under TP (heads
    split over devices) they drop the same blocks and give TP 1's tokens."""
    r = run_worker("scored", tiny["llama"], "--tp", 1, 2, 4, "--attention-impl", "grouped",
                   "--tokens", 40, devices=4)
    for policy in ("h2o", "snapkv"):
        assert all(len(t) == 40 for t in r[f"{policy}_tp1"])
        assert r[f"{policy}_tp1_dropped"] > 0
        assert r[f"{policy}_tp2"] == r[f"{policy}_tp4"] == r[f"{policy}_tp1"]
        assert r[f"{policy}_tp2_dropped"] == r[f"{policy}_tp4_dropped"] == \
            r[f"{policy}_tp1_dropped"]


@pytest.mark.slow
def test_host_kv_tier_under_tp_gives_the_tokens_of_one_device(tiny):
    """Swap preemption and prefix blocks demoted to the host tier and promoted back, with the
    cache split over kv heads (tp 2; tp 4 repeats llama's 2 kv heads): TP 1's tokens."""
    r = run_worker("offload", tiny["llama"], "--tp", 1, 2, 4, "--attention-impl", "grouped",
                   "--tokens", 40, devices=4)
    assert all(len(t) == 40 for t in r["tp1"]) and r["tp1_again"] == r["tp1"]
    swaps, host_hits = r["tp1_stats"]
    assert swaps > 0 and host_hits > 0
    for key in ("tp2", "tp4", "tp4_pinned"):   # tp4_pinned: staged through pinned_host
        assert r[key] == r[f"{key}_again"] == r["tp1"]
        assert r[f"{key}_stats"] == r["tp1_stats"]


@pytest.mark.slow
def test_quantized_kv_under_tp_gives_the_tokens_of_one_device(tiny):
    """int8 and KIVI int4 pools sharded over kv heads (tp 2; tp 4 repeats llama's 2 kv heads):
    the greedy tokens of one device, with every pool-shaped array split and the KIVI
    bookkeeping replicated."""
    r = run_worker("kv_parity", tiny["llama"], "--tp", 1, 2, 4, "--kv", "int8", "int4",
                   devices=4)
    for kv, codes in (("int8", "int8"), ("int4", "uint8")):
        assert len(r[f"{kv}_tp1"]) == 8
        assert r[f"{kv}_tp2"] == r[f"{kv}_tp4"] == r[f"{kv}_tp1"], kv
        # through the engine: TP 2 allocates the pools in the KV format and matches TP 1
        assert r[f"{kv}_engine_tp2"] == r[f"{kv}_engine_tp1"], kv
        assert r[f"{kv}_engine_tp2_dtype"] == r[f"{kv}_engine_tp1_dtype"] == codes
    # 11 blocks of 8 tokens, 1 kv head per device, head_dim 16 (int4: 8 bytes, G = 16)
    assert r["int8_tp2_shards"] == {".data": [11, 8, 1, 16], ".scale": [11, 8, 1, 1]}
    assert r["int4_tp4_shards"] == {
        ".data": [11, 8, 1, 8], ".scale": [11, 1, 1, 16], ".zero": [11, 1, 1, 16],
        ".residual": [3, 8, 1, 16], ".res_slot": [11], ".res_owner": [3], ".res_stamp": [3],
        ".clock": [], ".sealed": [11]}


def test_param_and_cache_shardings_follow_the_rules_and_two_all_reduces_per_layer(tiny):
    r = run_worker("inspect", tiny["llama"], "--tp", 4)
    assert r["mesh"] == {"dp": 1, "tp": 4}
    p = r["param_specs"]
    attn, mlp = p["layers"]["0"]["self_attn"], p["layers"]["1"]["mlp"]
    assert p["embed_tokens"] == ["tp", None]                  # vocab, embed
    assert p["lm_head"] == [None, "tp"]                       # embed, vocab
    assert p["norm"]["weight"] == [None]
    assert attn["q_proj"] == [None, "tp", None]               # embed, heads, head_dim
    assert attn["k_proj"] == attn["v_proj"] == [None, "tp", None]
    assert attn["o_proj"] == ["tp", None, None]               # heads, head_dim, embed
    assert mlp["gate_proj"] == mlp["up_proj"] == [None, "tp"]
    assert mlp["down_proj"] == ["tp", None]
    assert r["kv_layout"] == "hnd"                            # [blocks, kv_heads, tokens, dim]
    assert r["cache_specs"] == [[None, "tp", None, None]] * 2
    # 2 kv heads repeated to 4: each device holds one [48 blocks, 1 head, 8, 16] pool shard
    assert r["cache_shard_shape"] == [48, 1, 8, 16]
    # o_proj and down_proj all-reduce once each per layer; +1 for the vocab-split embedding lookup
    assert r["all_reduces"] == 2 * r["num_layers"] + 1


def test_bad_parallel_layouts_fail_before_any_weight_is_loaded(tiny):
    r = run_worker("errors", tiny["llama"])
    assert "only 8 are available" in r["tp_too_large"]
    assert "needs 16 devices" in r["dp_times_tp_too_large"]
    assert "num_heads=8 is not divisible by 3" in r["tp_not_dividing"]
    assert "valid sizes (up to 8 devices): 1, 2, 4, 8" in r["tp_not_dividing"]
    assert "tensor_parallel_size=0" in r["tp_zero"]
    assert "does not match" in r["mesh_mismatch"] and "'tp': 4" in r["mesh_mismatch"]


def test_sharded_orbax_round_trip_is_bit_exact(tiny, tmp_path):
    r = run_worker("checkpoint", tiny["qwen2"], tmp_path / "ckpt", "--tp", 4)
    assert r["bit_exact"] and r["in_shardings"] and r["tokens_equal"]


SMOL = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_smollm2_heads_refuse_tp_2_4_8_listing_valid_sizes(tp):
    with pytest.raises(ValueError, match=r"num_heads=9 is not divisible by .*valid sizes "
                                         r"\(up to 8 devices\): 1, 3$"):
        sharding.check_parallel_sizes(ModelConfig(**SMOL), tp, num_devices=8)


def test_planner_sizes_per_device():
    c = ModelConfig(**SMOL)
    assert memory_plan.kv_bytes_per_token(c, "fp32", 3) == memory_plan.kv_bytes_per_token(c, "fp32") // 3
    assert memory_plan.kv_bytes_per_token(c, "fp32", 9) == memory_plan.kv_bytes_per_token(c, "fp32") // 3
    norms = (2 * 30 + 1) * 576
    assert memory_plan.weights_bytes(c, "float32", 3) == 4 * (
        norms + (memory_plan.num_parameters(c) - norms) // 3)
    p = memory_plan.plan(c, device_memory_bytes=8 << 30, max_model_len=1024, tensor_parallel_size=9)
    assert (p.tensor_parallel_size, p.kv_head_replication) == (9, 3)
    assert "kv heads replicated on" in p.summary()


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1():
    path = store.fetch(store.DEFAULT_MODEL)
    assert load_config(path).num_kv_heads == 3
    r = run_worker("parity", path, "--tp", 1, 3, "--tokens", 4, devices=3, timeout=600)
    assert r["tp3"] == r["tp1"]
    assert r["tp3_plan"][1] == 1
