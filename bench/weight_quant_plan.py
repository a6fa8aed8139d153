"""The memory planner's before/after of weight quantization (issue 51): for real model shapes
(dense, and mixtures of experts) on one 80 GiB GPU, the weights, the KV pool they leave and the sequences of 8K tokens it holds
at once, for each ``quantization`` (jaxkv.runner.model_runner.plan_memory: no weight is read).

    python3 bench/weight_quant_plan.py [--device-memory 80GiB] [--max-model-len 8192]

The shapes are the models' HF config.json fields (written to a temporary directory); the
default model's row reads its GGUF's metadata. bf16 weights and KV cache (the GPU default).
gpt-oss ships its experts in MXFP4: as stored (``quantization=None``) they stay in their codes,
``"none"`` de-quantizes them to bf16 (the methods quantize dense projections, not its stacks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxkv.config import EngineConfig  # noqa: E402
from jaxkv.config.options import parse_bytes  # noqa: E402
from jaxkv.model.weights import load_config  # noqa: E402
from jaxkv.runner.memory_plan import format_bytes  # noqa: E402
from jaxkv.runner.model_runner import plan_memory  # noqa: E402

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
              rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256,
              num_key_value_heads=8, tie_word_embeddings=False, max_position_embeddings=8192)
CONFIGS = {      # the fields of each model's config.json on the Hub
    "Llama-3-8B": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32},
    "Llama-3-70B": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672,
                    "num_hidden_layers": 80, "num_attention_heads": 64},
    "Qwen3-8B": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960),
    # mixtures of experts: the experts quantized with the dense projections
    "Mixtral-8x7B": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                         hidden_act="silu", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
                         rope_theta=1000000.0, vocab_size=32000, tie_word_embeddings=False,
                         max_position_embeddings=32768),
    "Qwen3-30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          hidden_act="silu", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                          rope_theta=1000000.0, vocab_size=151936, tie_word_embeddings=False,
                          max_position_embeddings=40960),
}
_GPT_OSS = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_act="silu",
                hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                num_key_value_heads=8, head_dim=64, num_experts_per_tok=4, vocab_size=201088,
                rms_norm_eps=1e-5, rope_theta=150000.0, sliding_window=128,
                rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                  truncate=False, original_max_position_embeddings=4096),
                max_position_embeddings=131072, attention_bias=True, swiglu_limit=7.0,
                tie_word_embeddings=False, quantization_config=dict(
                    quant_method="mxfp4", modules_to_not_convert=[
                        "model.layers.*.self_attn", "model.layers.*.mlp.router",
                        "model.embed_tokens", "lm_head"]))
for _name, _layers, _experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)):
    CONFIGS[_name] = {**_GPT_OSS, "num_hidden_layers": _layers, "num_local_experts": _experts,
                      "layer_types": ["sliding_attention", "full_attention"] * (_layers // 2)}
MODES = (("none", 128), ("int8", 128), ("fp8", 128), ("int4", 128))
MXFP4_MODES = ((None, 32), ("none", 128))      # an MXFP4 checkpoint: as stored, de-quantized


def row(name: str, model: str, mode: str | None, group: int, a) -> str:
    engine = EngineConfig.from_kwargs(
        model=model, dtype="bfloat16", kv_cache_dtype="auto", quantization=mode,
        quantization_group_size=group, max_model_len=a.max_model_len, max_num_seqs=1024)
    p = plan_memory(engine, load_config(model), device_memory_bytes=a.device_memory)
    seqs = p.num_usable_blocks // p.blocks_per_seq if p.runs else 0
    label = (f"{mode} (g{group})" if mode == "int4" else mode if mode
             else "None (MXFP4 experts kept)")
    return (f"| {name} | {label} | {format_bytes(p.weights_bytes)} | "
            f"{format_bytes(p.kv_cache_bytes) if p.runs else 'does not fit'} | "
            f"{p.max_num_tokens if p.runs else 0:,} | {seqs} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-memory", type=parse_bytes, default=parse_bytes("80GiB"))
    ap.add_argument("--max-model-len", type=int, default=8192)
    a = ap.parse_args()
    print(f"one device of {format_bytes(a.device_memory)}, gpu_memory_utilization 0.9, bf16, "
          f"sequences of {a.max_model_len:,} tokens\n")
    print("| model | quantization | weights | KV pool | KV tokens | sequences at once |")
    print("|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, fields in CONFIGS.items():
            path = Path(tmp) / name
            path.mkdir()
            (path / "config.json").write_text(json.dumps(fields))
            for mode, group in MXFP4_MODES if "quantization_config" in fields else MODES:
                print(row(name, str(path), mode, group, a))


if __name__ == "__main__":
    main()
