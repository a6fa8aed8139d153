"""Tensor-parallel scaling on a fake-device CPU mesh: tokens/s, per-device KV capacity, collectives.

CPU SIMULATION: ``--fake-cpu-devices N`` splits this host's CPU into N XLA devices that share
the same cores and memory, so tokens/s here measure the sharded program's overhead, not a
speed-up (real scaling needs real devices). The per-device KV numbers and the all-reduce count
are exact: they are what the same program holds and runs on N GPUs.

The model is a random Llama-architecture checkpoint (8 q heads, 2 kv heads, so TP 4 and 8
repeat kv heads) written once as an orbax checkpoint with SmolLM2's tokenizer, then restored
into each TP layout (jaxkv.model.checkpoint). For each TP size it reports:

* greedy generation tokens/s on a fixed workload (after warm-up), and whether the tokens equal
  TP 1's;
* KV bytes per token on one device and how many tokens one device's pool holds at
  ``--kv-budget-per-device``;
* all-reduces in the compiled step (HLO) and per layer, ``(total - 1) / num_layers`` (the one
  extra is the vocab-split embedding lookup).

    python3 bench/tp_scaling.py --out bench/results/tp_scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fake-cpu-devices", type=int, default=8,
                   help="XLA host devices to create (set before jax is imported)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--kv-budget-per-device", type=int, default=1 << 30,
                   help="bytes of KV pool per device for the capacity column")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={a.fake_cpu_devices}")
    import jax
    import numpy as np

    from jaxkv import LLM, SamplingParams
    from jaxkv.model import checkpoint, gguf, store
    from jaxkv.model.config import ModelConfig
    from jaxkv.model.llama import init_params
    from jaxkv.model.tokenizer import Tokenizer
    from jaxkv.runner import memory_plan, sharding

    tokenizer = Tokenizer.from_gguf_metadata(gguf.open_gguf(store.fetch(store.DEFAULT_MODEL)))
    config = ModelConfig(architecture="llama", vocab_size=tokenizer.vocab_size,
                         hidden_size=a.hidden_size, intermediate_size=3 * a.hidden_size,
                         num_layers=a.num_layers, num_heads=8, num_kv_heads=2,
                         head_dim=a.hidden_size // 8, max_position_embeddings=2048,
                         eos_token_ids=tokenizer.eos_token_ids)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, config.vocab_size, a.prompt_len).tolist()}
               for _ in range(a.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    engine = dict(dtype="float32", block_size=16, max_model_len=256, max_num_seqs=a.num_prompts,
                  max_num_batched_tokens=512, token_buckets=(a.num_prompts, 512),
                  seq_buckets=(a.num_prompts,), num_kv_blocks=128)
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        checkpoint.save_params(ckpt, init_params(config, jax.random.PRNGKey(0)), config=config)
        checkpoint.write_tokenizer(ckpt, tokenizer)
        for tp in a.tp:
            with LLM(str(ckpt), tensor_parallel_size=tp, **engine) as llm:
                llm.warmup()
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                elapsed = time.perf_counter() - t
                tokens = [o.outputs[0].token_ids for o in outs]
                ref = tokens if ref is None else ref
                n_out = sum(map(len, tokens))
                per_token = memory_plan.kv_bytes_per_token(config, "fp32", tp)
                hlo = llm.compiled_step_text(512, a.num_prompts) if tp > 1 else ""
                all_reduces = sharding.count_all_reduces(hlo)
                rows.append({
                    "tensor_parallel_size": tp,
                    "output_tokens_per_s": round(n_out / elapsed, 1),
                    "elapsed_s": round(elapsed, 3),
                    "tokens_equal_tp1": tokens == ref,
                    "kv_head_replication": sharding.kv_replication(config, tp),
                    "kv_bytes_per_token_per_device": per_token,
                    "kv_tokens_per_device_at_budget": a.kv_budget_per_device // per_token,
                    "weights_bytes_per_device": memory_plan.weights_bytes(config, "float32", tp),
                    "all_reduces_in_step": all_reduces,
                    "all_reduces_per_layer": (all_reduces - 1) / config.num_layers if tp > 1 else 0,
                })
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "label": f"CPU simulation: {a.fake_cpu_devices} fake XLA host devices sharing "
                 f"{os.cpu_count()} CPU cores; tokens/s show overhead, not speed-up",
        "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
        "model": {"layers": config.num_layers, "hidden": config.hidden_size, "q_heads": 8,
                  "kv_heads": 2, "head_dim": config.head_dim, "vocab": config.vocab_size,
                  "weights": "random, float32"},
        "workload": {"num_prompts": a.num_prompts, "prompt_len": a.prompt_len,
                     "output_len": a.output_len, "greedy": True},
        "kv_budget_per_device_bytes": a.kv_budget_per_device,
        "rows": rows,
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
