"""The memory planner on DeepSeek-V3's and V2-Lite's released shapes (issue 53): the latent
cache's bytes per token against an MHA cache of the same model (every layer caching its N heads'
K, P + R wide, and V, V wide), and the sequences of 8K and 32K tokens a KV pool holds at once
with each (``jaxkv.runner.memory_plan.plan``, what ``jaxkv plan`` runs; no weight is read).

    python3 bench/mla_plan.py [--kv-pool 40GiB] [--device-memory 80GiB] [--tensor-parallel-size 1]
        [--quantization fp8]

Two pools per model: the fixed ``--kv-pool`` (the same for both, so the rows compare), and what
one ``--device-memory`` device leaves after its share of the bf16 weights (``--tensor-parallel-
size`` devices split the heads and experts; the latent is whole on each) and the activations of
the planner's default 256 sequences at utilization 0.9 (V3's 1.3 TB of weights leave nothing on
one device); with ``--quantization`` the weights as ``LLM(quantization=...)`` stores them (the
dense projections and experts, int4 in groups of 128; ``quantize.stored_bytes`` of a device's
shares). bf16 cache, blocks of 16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxkv.config.options import parse_bytes  # noqa: E402
from jaxkv.model import quantize  # noqa: E402
from jaxkv.model.config import ModelConfig  # noqa: E402
from jaxkv.runner.device_shares import device_tensor_shapes  # noqa: E402
from jaxkv.runner.memory_plan import format_bytes, plan  # noqa: E402

# the released config.json fields that matter here
CONFIGS = {
    "DeepSeek-V3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=2048, first_k_dense_replace=3, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840,
        rope_scaling=dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0, beta_fast=32,
                          beta_slow=1, original_max_position_embeddings=4096),
        rope_theta=10000),
    "DeepSeek-V2-Lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        moe_intermediate_size=1408, first_k_dense_replace=1, n_group=1, topk_group=1,
        topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=163840,
        rope_scaling=dict(type="yarn", factor=40, mscale=0.707, mscale_all_dim=0.707,
                          beta_fast=32, beta_slow=1, original_max_position_embeddings=4096)),
}
CONTEXTS = (8192, 32768)
BLOCK = 16


def mha_bytes_per_token(c: ModelConfig, dtype_bytes: int = 2) -> int:
    """An MHA cache of the same model: every layer's N heads' K (P + R) and V (V) values."""
    m = c.mla
    return c.num_layers * c.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim
                                         + m.v_head_dim) * dtype_bytes


def pool_row(name: str, c: ModelConfig, pool: str, kv_budget: int | None,
             device_memory: int, tp: int = 1, quantization: str | None = None) -> dict:
    """One pool's row: bytes per token (one device's) and sequences at once per context, MLA
    and MHA (its heads split over ``tp`` devices). With ``kv_budget`` None the pool is what the
    device leaves after its share of the weights (bf16, or as ``quantization`` stores them)."""
    row = dict(model=name, pool=pool, mha_bytes_per_token=mha_bytes_per_token(c) // tp, seqs={})
    stored = None if quantization is None else quantize.stored_bytes(
        device_tensor_shapes(c, tp), quantization, quantize.DEFAULT_GROUP, 2)
    for ctx in CONTEXTS:
        p = plan(c, device_memory_bytes=device_memory, dtype="bfloat16", block_size=BLOCK,
                 max_model_len=ctx, kv_cache_bytes=kv_budget, tensor_parallel_size=tp,
                 stored_weights_bytes=stored)
        mha_blocks = p.kv_budget_bytes // (BLOCK * row["mha_bytes_per_token"])
        row |= dict(mla_bytes_per_token=p.kv_bytes_per_token, kv_budget=p.kv_budget_bytes,
                    weights=p.weights_bytes)
        row["seqs"][ctx] = (p.max_concurrent_seqs, max(mha_blocks - 1, 0) // p.blocks_per_seq)
    return row


def table(kv_pool: int, device_memory: int, tp: int = 1,
          quantization: str | None = None) -> list[dict]:
    rows = []
    where = (f"left on one {format_bytes(device_memory)} device" if tp == 1 else
             f"left on each of {tp} {format_bytes(device_memory)} devices (tp {tp})")
    for name, fields in CONFIGS.items():
        c = ModelConfig.from_hf_dict(fields)
        rows.append(pool_row(name, c, "fixed", kv_pool, device_memory))
        rows.append(pool_row(name, c, where, None, device_memory, tp, quantization))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-pool", type=parse_bytes, default=parse_bytes("40GiB"))
    ap.add_argument("--device-memory", type=parse_bytes, default=parse_bytes("80GiB"))
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--quantization", choices=quantize.METHODS,
                    help="weights quantized at load (default: bf16)")
    a = ap.parse_args()
    held = a.quantization or "bf16"
    print("| model | KV pool | MLA B/token | MHA B/token | ratio | 8K seqs MLA / MHA "
          "| 32K seqs MLA / MHA |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in table(a.kv_pool, a.device_memory, a.tensor_parallel_size, a.quantization):
        if not r["kv_budget"]:
            print(f"| {r['model']} | {r['pool']}: none, its {held} weights "
                  f"({format_bytes(r['weights'])}) do not fit | | | | | |")
            continue
        pool = f"{r['pool']}: {format_bytes(r['kv_budget'])}"
        if r["pool"] != "fixed":
            pool += f" beside {format_bytes(r['weights'])} of {held} weights"
        seqs = " | ".join(f"{m:,} / {h:,}" for m, h in r["seqs"].values())
        print(f"| {r['model']} | {pool} | {r['mla_bytes_per_token']:,} | "
              f"{r['mha_bytes_per_token']:,} | "
              f"{r['mha_bytes_per_token'] / r['mla_bytes_per_token']:.1f}x | {seqs} |")


if __name__ == "__main__":
    main()
