"""bench/gpu_check.py's end-to-end rows: ``jaxkv.LLM`` on random-weight models written as HF
directories (bench/lib/random_model.py), tokens/s and the host share of each step."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import time
import traceback

import jax.numpy as jnp
import numpy as np

from lib.random_model import SPECIAL_TOKENS, write_random_model
from lib.step_timing import timed_step


@dataclasses.dataclass(frozen=True)
class E2EModel:
    """A model of the end-to-end rows: its HF config fields, and per KV dtype (one LLM each)
    the batches run."""

    label: str
    sizes: tuple[tuple[str, object], ...]
    runs: tuple[tuple[str, tuple[int, ...]], ...]

    def describe(self) -> str:
        z = dict(self.sizes)
        tied = "tied" if z.get("tie_word_embeddings", True) else "untied"
        return (f"{self.label} (L{z['num_hidden_layers']} E{z['hidden_size']} "
                f"F{z['intermediate_size']} H{z['num_attention_heads']}/"
                f"{z['num_key_value_heads']} V{z['vocab_size']} {tied}), random weights")


# SmolLM2-135M's sizes (its other config fields are write_random_model's defaults)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
# Llama-3-8B's shapes with 4 of its 32 layers (1.9B parameters: embedding and untied head are
# 1.05B; 32 layers would be 8B, 16 GB to draw, write and load within the run)
LLAMA3_8B_L4 = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                    tie_word_embeddings=False, rope_theta=500000.0)


def write_models(models, folder: str) -> dict:
    """label -> a future of each model's HF directory, written in a background thread (numpy's
    draws and safetensors' writes release the GIL: the kernels' sections run meanwhile)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    futures = {m.label: pool.submit(write_random_model, os.path.join(folder, f"model{i}"),
                                    dict(m.sizes)) for i, m in enumerate(models)}
    pool.shutdown(wait=False)
    return futures


def build_llm(path: str, kv_cache_dtype: str, max_batch: int, *, prompt: int, tokens: int,
              attention_impl: str | None, interpret: bool):
    """An LLM whose pool holds ``max_batch`` requests of ``prompt + tokens`` and prefills a
    batch's prompts in one step (bf16 weights, no persistent compilation cache)."""
    from jaxkv import LLM

    return LLM(path, dtype="bfloat16", seed=0, kv_cache_dtype=kv_cache_dtype,
               max_model_len=prompt + tokens, max_num_seqs=max_batch,
               max_num_batched_tokens=max_batch * prompt, block_size=16,
               num_kv_blocks=1 + max_batch * -(-(prompt + tokens) // 16),
               attention_impl=attention_impl, interpret=interpret, compilation_cache=False)


def e2e_row(llm, B: int, model: E2EModel, build_s: float, *, prompt: int, tokens: int,
            warmup_tokens: int) -> dict:
    """One batch of ``B`` requests through ``llm`` (``prompt`` random ids, ``tokens`` greedy
    output tokens each, ignore_eos), after a warm-up generate of the same batch (compiles
    excluded; ``recompiles`` counts any in the timed run): output tokens/s over the whole run
    (prefill included), the mean decode step ms, and the host share of step time, (wall -
    device) / wall of each ``llm.step()`` (bench/lib/step_timing.py): median over the
    decode-only steps, and over all steps' sums. ``ok``: every request got ``tokens`` tokens."""
    from jaxkv import SamplingParams

    runner = llm.engine.runner
    vocab = dict(model.sizes)["vocab_size"]
    rng = np.random.default_rng(B)
    row = dict(batch=B, prompt_tokens=prompt, output_tokens=tokens, model=model.describe(),
               attention_impl=runner.attention_impl, dtype=jnp.dtype(runner.dtype).name,
               kv_cache_dtype=llm.kv_cache_dtype, build_s=build_s)

    def prompts():   # fresh ids each call: the timed run gets no prefix-cache hit from warm-up
        return [{"prompt_token_ids": rng.integers(len(SPECIAL_TOKENS), vocab, prompt).tolist()}
                for _ in range(B)]

    try:
        llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=warmup_tokens,
                                               ignore_eos=True), use_tqdm=False)
        compiles = llm.num_compilations()
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        steps, lens = [], {}
        t0 = time.perf_counter()
        for p in prompts():
            llm.add_request(p, params)
        while llm.has_unfinished_requests():
            steps.append(timed_step(llm))
            lens.update((o.request_id, len(o.outputs[0].token_ids))
                        for o in steps[-1].outputs if o.finished)
        wall = time.perf_counter() - t0
        decode = [st for st in steps if st.decode] or steps
        row.update(
            steps=len(steps), decode_steps=sum(st.decode for st in steps), wall_s=wall,
            tokens_per_s=B * tokens / wall,
            decode_step_ms=1e3 * statistics.mean(st.wall_s for st in decode),
            decode_device_ms=1e3 * statistics.mean(st.device_s for st in decode),
            decode_host_ms=1e3 * statistics.mean(st.host_s for st in decode),
            host_share=statistics.median(st.host_share for st in decode),
            host_share_all=sum(st.host_s for st in steps) / sum(st.wall_s for st in steps),
            recompiles=llm.num_compilations() - compiles,
            ok=len(lens) == B and all(n == tokens for n in lens.values()))
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row
