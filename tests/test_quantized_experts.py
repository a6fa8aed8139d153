"""A mixture's experts quantized at load (``LLM(quantization=...)``: jaxkv/model/quantize.py's
``EXPERT``, stacked by ``quantized.stack``, multiplied by jaxkv/model/grouped_matmul.py's tile
loop) against independent references: a float64 numpy grouped product of the dequantized
experts, HF transformers running a checkpoint whose dense projections and experts were
replaced by their quantized-then-dequantized values (the engine's own numbers), a GGUF's
experts kept in their blocks against the same file dequantized by ``gguf``, and one device
against two (the multi-device check runs this file as a script with 2 fake CPU devices,
``tp_runner.run_script``, which prints one JSON line)."""

import dataclasses
import json
import shutil
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv import LLM, SamplingParams  # noqa: E402
from jaxkv.model import quantize  # noqa: E402
from jaxkv.model.grouped_matmul import grouped_matmul  # noqa: E402
from jaxkv.model.quantized import QuantizedWeight, dequantize_numpy, stack, to_device  # noqa: E402
from jaxkv.model.weights import expected_shapes, load_config  # noqa: E402
from tiny_models import assert_greedy_equals_hf, save_tiny_model, save_tokenizer  # noqa: E402
from tp_runner import quantized_run  # noqa: E402

CASES = [("int8", 128), ("fp8", 128), ("int4", 32)]
# 4 experts top 2 (Mixtral's w1/w2/w3 names); 6 experts top 3 with a dense layer (Qwen3-MoE's
# gate/up/down names); DeepSeek-V3: MLA (its latent projections stay float, o_proj K = 4 x 16
# quantized), a dense first layer, 8 routed experts in 4 groups and a shared expert
MODELS = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
          "qwen3_moe": dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
                            moe_intermediate_size=96, mlp_only_layers=[1], head_dim=16),
          "deepseek_v3": dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=24,
                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              moe_intermediate_size=32, first_k_dense_replace=1, n_group=4,
                              topk_group=2, max_position_embeddings=256)}
METHODS_OF = {"qwen3_moe": [("int4", 32)], "deepseek_v3": [("int8", 128)]}
ENGINE = dict(max_model_len=128, num_gpu_blocks_override=24, max_num_seqs=2)


def expert_weights(X=4, N=64, K=96, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((N, K)) * 0.05).astype(np.float32) for _ in range(X)]


@pytest.mark.parametrize("method,group", [*CASES, ("int4", 64)])
@pytest.mark.parametrize("A", [3, 40])
def test_grouped_matmul_of_quantized_experts_equals_the_dequantized_product(method, group, A):
    """Decode-sized (3 rows) and prefill-sized (40) steps, an expert with no rows, one with a
    single row; K = 96 (int4 groups of 64 end partial)."""
    ws = expert_weights()
    qs = [quantize.quantize(w, method, group) for w in ws]
    stacked = to_device(stack(qs), (4, 96, 64))
    assert stacked.stacked and stacked.rows == 64 and stacked.cols == 96
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((A, 96)).astype(np.float32)
    sizes = np.array([A // 4, 0, A - A // 4 - 1, 1], np.int32)
    got = jax.jit(grouped_matmul)(jnp.asarray(rows), stacked, jnp.asarray(sizes))
    want, start = np.zeros((A, 64)), 0
    for q, n in zip(qs, sizes):
        want[start:start + n] = rows[start:start + n].astype(np.float64) @ dequantize_numpy(q).T
        start += n
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_a_stack_refuses_experts_of_different_formats():
    ws = expert_weights(X=2)
    with pytest.raises(ValueError, match="one qtype, group and shape"):
        stack([quantize.quantize(ws[0], "int8"), quantize.quantize(ws[1], "int4", 32)])


def hf_with_weights(src, dst, weights: dict):
    """transformers' float32 model of the checkpoint at ``src`` (copied to ``dst`` without its
    ``quantization_config``) with each Linear ``P`` of ``weights`` ({P.weight: float32}) holding
    those values in place of what ``src`` stores for it."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    linears = {k.rsplit(".", 1)[0] for k in weights}
    tensors = {k: v for k, v in load_torch(src / "model.safetensors").items()
               if k.rsplit(".", 1)[0] not in linears}
    tensors |= {k: torch.from_numpy(np.ascontiguousarray(w)) for k, w in weights.items()}
    save_torch(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


def dequantized_copy(src, dst, method: str, group: int):
    """(``hf_with_weights`` of the checkpoint at ``src`` with each tensor ``quantize_tensors``
    quantizes replaced by its dequantized values, how many)."""
    weights = {name: dequantize_numpy(quantize.quantize(w, method, group))
               for name, w in load_file(src / "model.safetensors").items()
               if quantize.quantizable(name)}
    return hf_with_weights(src, dst, weights), len(weights)


@pytest.fixture(scope="module", params=list(MODELS))
def moe_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tokenizer(path)
    save_tiny_model(path, request.param, **MODELS[request.param])
    return path


def test_engine_equals_transformers_on_the_dequantized_experts(moe_checkpoint, tmp_path):
    """Every method on Mixtral; one on each of the others (the path is the same)."""
    config = load_config(moe_checkpoint)
    experts = sum(bool(quantize.EXPERT.fullmatch(k)) for k in expected_shapes(config))
    assert experts == 3 * config.num_experts * sum(map(config.is_moe_layer,
                                                       range(config.num_layers)))
    for method, group in METHODS_OF.get(config.architecture, CASES):
        hf, n = dequantized_copy(moe_checkpoint, tmp_path / f"{method}{group}", method, group)
        assert n > experts
        assert_greedy_equals_hf(moe_checkpoint, hf, list(range(3, 40)), 24, quantization=method,
                                quantization_group_size=group, **ENGINE)


def test_planner_counts_the_stacked_experts_the_engine_holds(moe_checkpoint):
    with LLM(str(moe_checkpoint), quantization="int4", quantization_group_size=32,
             max_model_len=64, num_gpu_blocks_override=8, max_num_seqs=1) as llm:
        runner = llm.engine.runner
        held = sum(int(a.nbytes) for a in jax.tree.leaves(runner.params))
        kept = [a for a in jax.tree.leaves(runner.params, is_leaf=lambda a: isinstance(
            a, QuantizedWeight)) if isinstance(a, QuantizedWeight)]
        plan = runner.memory_plan
    config = load_config(moe_checkpoint)
    moe_layers = sum(map(config.is_moe_layer, range(config.num_layers)))
    stacks = [w for w in kept if w.stacked]
    assert len(stacks) == 3 * moe_layers
    assert {w.shape[0] for w in stacks} == {config.num_experts}
    assert {w.qtype for w in kept} == {"Q4_1"}
    assert plan.weights_bytes == held
    assert "int4 (groups of 32) dense projections and experts" in plan.weights_format
    assert quantize.stored_bytes(expected_shapes(config), "int4", 32, 4) == held


def test_checkpoint_convert_keeps_the_experts_quantized(moe_checkpoint, tmp_path):
    from jaxkv.model import checkpoint

    out = tmp_path / "ckpt"
    checkpoint.convert(str(moe_checkpoint), out, quantization="int8")
    meta = json.loads((out / "jaxkv.json").read_text())
    stacked = [k for k, v in meta["quantized"].items() if len(v["arrays"]["qs"][0]) == 3]
    config = load_config(moe_checkpoint)
    assert len(stacked) == 3 * sum(map(config.is_moe_layer, range(config.num_layers)))
    params = checkpoint.restore_params(out)
    leaves = jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, QuantizedWeight))
    assert sum(isinstance(w, QuantizedWeight) and w.stacked for w in leaves) == len(stacked)


# a Qwen3-MoE whose Linears (each expert's) llm-compressor would compress: K of 128 everywhere
CT_MOE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32,
              num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])


@pytest.mark.parametrize("preset", ["W4A16_ASYM", "FP8"])
def test_a_compressed_tensors_moe_keeps_its_experts_codes(preset, tmp_path):
    """Experts compressed by the compressed-tensors package (int4 with zero points in groups of
    64, fp8 per channel): kept as stacks of the preset's codes; the engine equals transformers
    running the package's decompression of the same file; the planner counts the bytes held."""
    pytest.importorskip("compressed_tensors")
    from jaxkv.model.weights import load_model_files
    from test_compressed_tensors import PRESETS, package_weights, write_compressed

    path = tmp_path / "ct"
    write_compressed(path, preset, kind="qwen3_moe", **CT_MOE)
    theirs = package_weights(path, preset)
    kept = {k: w for k, w in load_model_files(path, keep_quantized=True).tensors.items()
            if isinstance(w, QuantizedWeight)}
    config = load_config(path)
    experts = [k for k in kept if quantize.EXPERT.fullmatch(k)]
    assert len(experts) == 3 * config.num_experts * 2 and len(kept) == len(theirs)
    assert {w.qtype for w in kept.values()} == {PRESETS[preset][2]}
    hf = hf_with_weights(path, tmp_path / "oracle", theirs)
    assert_greedy_equals_hf(path, hf, list(range(3, 40)), 24, **ENGINE)
    with LLM(str(path), max_model_len=64, num_gpu_blocks_override=8, max_num_seqs=1) as llm:
        runner = llm.engine.runner
        assert sum(w.stacked for w in jax.tree.leaves(runner.params, is_leaf=lambda a: isinstance(
            a, QuantizedWeight)) if isinstance(w, QuantizedWeight)) == 3 * 2
        assert runner.memory_plan.weights_bytes == sum(
            int(a.nbytes) for a in jax.tree.leaves(runner.params))


Q = gguf.GGMLQuantizationType
# a GGUF's stacked experts (and q) in three block types
GGUF_TYPES = {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_1, "ffn_down_exps": Q.Q4_0,
              "attn_q": Q.Q4_1}
MXFP4_TYPES = dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), Q.MXFP4)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_a_ggufs_experts_stay_in_their_blocks(kind, tmp_path):
    """The converter's GGUF with Q8_0 / Q4_1 / Q4_0 experts (gpt-oss: MXFP4, as its GGUFs
    ship, expert width 64): kept as stacks of those blocks, the tokens and logprobs of the
    same file dequantized (``quantization="none"``), the planner's weights the bytes held."""
    from test_gguf_families import FAMILIES, write_gguf

    family = FAMILIES[kind]
    types = MXFP4_TYPES if kind == "gpt_oss" else GGUF_TYPES
    if kind == "gpt_oss":
        family = dataclasses.replace(family, overrides={**family.overrides,
                                                        "intermediate_size": 64})
    save_tokenizer(tmp_path)
    save_tiny_model(tmp_path, kind, **family.overrides)
    path = str(write_gguf(tmp_path, family, tmp_path / "q.gguf", types))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = {}
    for mode in (None, "none"):
        with LLM(path, quantization=mode, **ENGINE) as llm:
            out = llm.generate({"prompt_token_ids": list(range(3, 40))}, sp,
                               use_tqdm=False)[0].outputs[0]
            runner = llm.engine.runner
            stacks = {w.qtype for w in jax.tree.leaves(runner.params, is_leaf=lambda a: isinstance(
                a, QuantizedWeight)) if isinstance(w, QuantizedWeight) and w.stacked}
            held = sum(int(a.nbytes) for a in jax.tree.leaves(runner.params))
            runs[mode] = (out.token_ids, [lp[t] for lp, t in zip(out.logprobs, out.token_ids)],
                          stacks, held, runner.memory_plan.weights_bytes)
    (tokens, logprobs, stacks, held, planned), ref = runs[None], runs["none"]
    assert stacks == {t.name for k, t in types.items() if k.endswith("exps")} and ref[2] == set()
    if kind == "gpt_oss":    # under TP the experts stay kept where a device's K is whole blocks
        from jaxkv.config import EngineConfig
        from jaxkv.runner.model_runner import keeps_quantized

        # gpt-oss-20b's widths: o_proj's 4,096 splits into whole blocks at tp 2 and 4, the
        # experts' 2,880 at tp 2 (1,440), not at tp 4 (720)
        twenty_b = dataclasses.replace(load_config(path), num_heads=64, head_dim=64,
                                       intermediate_size=2880, moe_intermediate_size=2880)
        assert [keeps_quantized(EngineConfig.from_kwargs(model=path, tensor_parallel_size=tp),
                                twenty_b) for tp in (2, 4)] == [True, False]
    assert held == planned < ref[3]
    assert tokens == ref[0]
    np.testing.assert_allclose(logprobs, ref[1], atol=1e-4, rtol=0)


TP_MIXTRAL = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                  num_local_experts=4, num_experts_per_tok=2)    # experts [128 -> 128 -> 128]
TP_ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=24,
                 block_size=8, token_buckets=(16,), seq_buckets=(2,), quantization="int4",
                 quantization_group_size=32)


def _tp_run(path: str, tp: int) -> dict:
    """Greedy tokens and logprobs, the planned weights, device 0's bytes and layer 0's expert
    stacks' shard shapes there, of one engine at ``tp`` devices."""
    with LLM(path, tensor_parallel_size=tp, **TP_ENGINE) as llm:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
        done = [o.outputs[0] for o in llm.generate(["Emma Woodhouse, handsome,", "and rich"], sp,
                                                   use_tqdm=False)]
        runner = llm.engine.runner
        mlp = runner.params["layers"][0]["mlp"]
        return quantized_run(done, runner, {k: w for k, w in mlp.items()
                                            if isinstance(w, QuantizedWeight)})


@pytest.fixture(scope="module")
def tp_result(tmp_path_factory):
    from tp_runner import run_script

    path = tmp_path_factory.mktemp("moe_tp")
    save_tokenizer(path)
    save_tiny_model(path, "mixtral", **TP_MIXTRAL)
    return run_script(__file__, path, devices=2, timeout=300)


def test_tp_splits_the_experts_codes_by_width_and_gives_one_devices_tokens(tp_result):
    """int4 in groups of 32: gate and up split by rows (F), down by K (F) with its groups; the
    tokens and logprobs of one device; the planner's weights device 0's bytes."""
    one, two = tp_result["1"], tp_result["2"]
    assert two["tokens"] == one["tokens"] and all(len(t) == 6 for t in one["tokens"])
    assert max(abs(a - b) for x, y in zip(two["logprobs"], one["logprobs"])
               for a, b in zip(x, y)) < 1e-4
    assert one["shards"]["gate_proj"] == [[4, 128, 64], [4, 128, 4]]
    assert two["shards"]["gate_proj"] == [[4, 64, 64], [4, 64, 4]]
    assert two["shards"]["up_proj"] == two["shards"]["gate_proj"]
    assert two["shards"]["down_proj"] == [[4, 128, 32], [4, 128, 2]]
    for run in (one, two):
        assert run["plan_weights"] == run["device0_bytes"]


def test_a_tp_split_that_cuts_an_experts_group_is_refused_naming_the_field(tmp_path):
    """Expert width 384 over 2 devices: 192 values each, whole groups of 32 or 64, not of 128
    (o_proj's K = 128 is one group a row at 128: its scales replicated, no cut)."""
    from jaxkv.config import EngineConfig
    from jaxkv.runner.model_runner import check_quantization

    save_tiny_model(tmp_path, "mixtral", **{**TP_MIXTRAL, "intermediate_size": 384})
    for group in (32, 64):
        check_quantization(EngineConfig.from_kwargs(
            model=str(tmp_path), quantization="int4", quantization_group_size=group,
            tensor_parallel_size=2), from_checkpoint=False)
    bad = EngineConfig.from_kwargs(model=str(tmp_path), quantization="int4",
                                   quantization_group_size=128, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor \"experts' down_proj\" \[128, 384\] split "
                                         r"over tensor_parallel_size=2 .* groups of 128"):
        check_quantization(bad, from_checkpoint=False)


if __name__ == "__main__":
    print(json.dumps({str(tp): _tp_run(sys.argv[1], tp) for tp in (1, 2)}))
