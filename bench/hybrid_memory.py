"""Hybrid KV cache: how many 8K and 32K sequences fit on one 80 GiB device when sliding-window
layers keep only their window's blocks (hybrid) against every layer caching every token (full),
from the memory planner's arithmetic (``memory_plan.plan(..., hybrid_kv_cache=True/False)``).

    python3 bench/hybrid_memory.py --out bench/results/hybrid_memory.md

Both columns of a model share one KV budget: 0.9 x 80 GiB less the weights and the planner's
activation estimate (bf16, 2,048 batched tokens, 256 sequences); bf16 KV, 16-token blocks. A
sliding group holds ``(W - 1 + 2048) // 16 + 2`` blocks of a sequence (a 2,048-token prefill
chunk in its window), a full group all of them; a block id owns one page in each of the
``num_slots`` pool slots (the largest group's layers). No device is touched.

Shapes from the models' HF ``config.json`` (text decoder; Gemma 3 4B/27B's ``text_config``):
  google/gemma-3-1b-it   hidden 1152, 26 layers, 4 q / 1 kv heads x 256, window 512,
                         every 6th layer full, 32K context, tied embeddings, vocab 262144
  google/gemma-3-4b-it   hidden 2560, 34 layers, 8 q / 4 kv heads x 256, window 1024, vocab 262208
  google/gemma-3-27b-it  hidden 5376, 62 layers, 32 q / 16 kv heads x 128, window 1024
  openai/gpt-oss-20b     hidden 2880, 24 layers, 64 q / 8 kv heads x 64, window 128, layer_types
                         sliding/full alternating from layer 0, 32 experts of 2880, vocab 201088
  openai/gpt-oss-120b    as 20b with 36 layers and 128 experts
(https://huggingface.co/google/gemma-3-1b-it/blob/main/config.json, .../gemma-3-4b-it/...,
.../gemma-3-27b-it/..., https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json,
.../gpt-oss-120b/...). Gemma's weights are the planner's bf16 estimate of the text decoder (the
4B/27B SigLIP vision tower, ~0.4B, is left out). The planner does not count experts
(``num_parameters`` is the dense decoder's), so gpt-oss's weights are counted here as shipped:
MXFP4 experts (4-bit codes + one scale byte per 32), everything else bf16 (20.9B / 116.8B
parameters; all-bf16 120b, 218 GiB, would not fit). jaxkv does not run gpt-oss: its config is
only a shape for the planner.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository root's jaxkv

from jaxkv.model.config import ModelConfig  # noqa: E402
from jaxkv.runner import memory_plan  # noqa: E402
from jaxkv.runner.memory_plan import GiB  # noqa: E402

DEVICE, UTILIZATION, BATCHED_TOKENS, SEQS, BLOCK = 80 * GiB, 0.9, 2048, 256, 16
LENGTHS = (8192, 32768)


def gemma3(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
           window: int, vocab: int, context: int) -> ModelConfig:
    """A Gemma 3 text decoder: every 6th layer full attention, the others sliding."""
    return ModelConfig(
        architecture="gemma3_text", vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=context, tie_word_embeddings=True, qk_norm=True, gemma=True,
        sliding_window=window,
        layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                          for i in range(layers)))


def gpt_oss(layers: int, experts: int) -> ModelConfig:
    """gpt-oss's attention shape (sliding 128 at even layers, full at odd ones) on a MoE config."""
    return ModelConfig(
        architecture="mixtral", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=layers, num_heads=64, num_kv_heads=8, head_dim=64,
        max_position_embeddings=131072, attention_bias=True, num_experts=experts,
        num_experts_per_tok=4, moe_intermediate_size=2880, sliding_window=128,
        layer_types=("sliding_attention", "full_attention") * (layers // 2))


def gpt_oss_weights(c: ModelConfig) -> tuple[int, int]:
    """(parameters, bytes as shipped): MXFP4 expert matrices (4.25 bits), the rest bf16."""
    E, F, D, X = c.hidden_size, c.expert_size, c.head_dim, c.num_experts
    qkv = (c.num_heads + 2 * c.num_kv_heads) * D
    attention = E * qkv + qkv + c.num_heads * D * E + E + c.num_heads     # + biases, sinks
    expert_matrices = X * (E * 2 * F + F * E)                             # gate_up, down
    dense = attention + E * X + X + X * (2 * F + E) + 2 * E               # router, biases, norms
    other = c.num_layers * dense + 2 * c.vocab_size * E + E                # embed, unembed, norm
    mxfp4 = c.num_layers * expert_matrices * 17 // 32                       # 4.25 / 8 B each
    return c.num_layers * expert_matrices + other, mxfp4 + 2 * other


MODELS = (
    ("Gemma 3 1B", gemma3(26, 1152, 6912, 4, 1, 256, 512, 262144, 32768), None),
    ("Gemma 3 4B", gemma3(34, 2560, 10240, 8, 4, 256, 1024, 262208, 131072), None),
    ("Gemma 3 27B", gemma3(62, 5376, 21504, 32, 16, 128, 1024, 262208, 131072), None),
    ("gpt-oss-20b", gpt_oss(24, 32), "mxfp4"),
    ("gpt-oss-120b", gpt_oss(36, 128), "mxfp4"),
)


def kv_budget(config: ModelConfig, weights: int) -> int:
    """Bytes left for the KV pool: the budget less weights and the activation estimate."""
    activations = memory_plan.activation_bytes_estimate(
        config, dtype="bfloat16", max_num_batched_tokens=BATCHED_TOKENS, max_num_seqs=SEQS)
    return max(int(DEVICE * UTILIZATION) - weights - activations, 0)


def seqs(config: ModelConfig, kv: int, length: int, hybrid: bool) -> tuple[int, int]:
    """(``length``-token sequences a ``kv``-byte pool holds at once, KV bytes of one)."""
    p = memory_plan.plan(
        config, device_memory_bytes=DEVICE, memory_utilization=UTILIZATION, dtype="bfloat16",
        block_size=BLOCK, max_model_len=length, max_num_seqs=SEQS,
        max_num_batched_tokens=BATCHED_TOKENS, kv_cache_bytes=kv, hybrid_kv_cache=hybrid)
    return p.max_concurrent_seqs, p.blocks_per_seq * p.kv_bytes_per_block


def row(name: str, config: ModelConfig, weights_format: str | None) -> list[str]:
    """One table row: shape, weights, KV budget, then per length full, hybrid and the ratio."""
    weights = (gpt_oss_weights(config)[1] if weights_format == "mxfp4"
               else memory_plan.weights_bytes(config, "bfloat16"))
    kv, groups = kv_budget(config, weights), memory_plan.kv_groups(config)
    full_layers = sum(len(ls) for w, ls in zip(groups.windows, groups.layers) if w is None)
    cells = [name, f"{full_layers} full + {config.num_layers - full_layers} sliding "
             f"{config.sliding_window}", f"{groups.num_slots(config.num_layers)} / "
             f"{config.num_layers}", f"{weights / GiB:.1f}"
             + (" (MXFP4 experts)" if weights_format else ""), f"{kv / GiB:.1f}"]
    for length in LENGTHS:
        (full, full_seq), (hybrid, hybrid_seq) = (seqs(config, kv, length, h)
                                                  for h in (False, True))
        ratio = f"{hybrid / full:.2f}×" if full else "∞"
        cells += [f"{full:,}", f"{hybrid:,}", f"{ratio} ({full_seq / hybrid_seq:.2f}×)"]
    return cells


HEADER = ("model", "layers (window)", "pool slots / layers", "weights GiB", "KV budget GiB",
          "8K full", "8K hybrid", "8K × (bytes/seq)", "32K full", "32K hybrid",
          "32K × (bytes/seq)")


def table() -> str:
    rows = [HEADER, ("---",) * len(HEADER)] + [row(*m) for m in MODELS]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/hybrid_memory.md"))
    a = p.parse_args(argv)
    for name, config, fmt in MODELS:
        if fmt:
            print(f"{name}: {gpt_oss_weights(config)[0] / 1e9:.1f}B parameters")
    text = table()
    command = "python3 bench/hybrid_memory.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    a.out.write_text(
        f"# Hybrid KV cache: concurrent sequences on one 80 GiB device\n\n`{command.strip()}`\n\n"
        f"KV budget = {UTILIZATION} x 80 GiB - weights - the planner's activation estimate "
        f"(bf16, {BATCHED_TOKENS:,} batched tokens, {SEQS} sequences); bf16 KV, {BLOCK}-token "
        f"blocks; full = every layer caches every token (`hybrid_kv_cache=False`), hybrid = "
        f"sliding groups keep their window's blocks. × = hybrid / full sequences (in brackets: "
        f"full / hybrid KV bytes of one sequence, the ratio without the rounding to whole "
        f"sequences). Shapes and weights: the script's docstring.\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
