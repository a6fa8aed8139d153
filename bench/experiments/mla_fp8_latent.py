"""fp8 latent cache for MLA (DeepSeek): is the RoPE part better kept in the model dtype?

An MLA layer caches one latent ``[c_kv | k_rope]`` per token (jaxkv/attention/mla.py). Three
ways to store it in fp8 e4m3 (the first is what ``kv_cache_dtype="fp8"`` ships, the pool's
per-token-scale machinery; the others would need a second pool or a wider per-token record):

* ``fp8``: the whole latent as e4m3 codes with one bf16 scale per token (``Lkv + R`` bytes + 2);
* ``fp8_two_scales``: c_kv and k_rope as e4m3 codes, one scale each (``Lkv + R`` + 4 bytes);
* ``fp8_rope_float``: c_kv as e4m3 codes with one scale, k_rope in the model dtype
  (``Lkv + 2 + R x itemsize`` bytes).

Each variant is applied to the latent as the layer writes it (quantized and dequantized by
``jaxkv.kvcache.quant``, so the float pool holds exactly the values the codes stand for); the
``fp8`` row also runs through the real fp8 pool, ``fp8 (pool)``, which must give the same
numbers; ``bf16 (pool)``, a bf16 latent cache, is the control (8 mantissa bits to e4m3's 4).
The model: a tiny random DeepSeek-V3 written by transformers (tests/test_mla.py's: latent 32 +
rotary 8, q LoRA, YaRN, norms and the choice bias perturbed; ``--latent 128 --rope 16`` for V3's
8:1 ratio), fp32, ``--prompts`` prompts of 48 random token ids. Against the float latent:

* teacher-forced: the float cache's greedy continuation of ``--tokens`` tokens scored by each
  variant (``jaxkv.entrypoints.eval.retained_nll``, the prompt in one forward, then one token a
  step as decoding): mean and max |logprob drift| of the reference tokens, top-1 agreement;
* free-running: each variant's own greedy tokens through ``LLM.generate``: positions equal
  before the first difference (mean over prompts), all tokens equal.

Rows print as JSON lines (``per_prompt_drift``: each prompt's mean drift, for paired
comparisons)::

    PYTHONPATH=. python3 bench/experiments/mla_fp8_latent.py [--latent 32 --rope 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/

from jaxkv import LLM, SamplingParams  # noqa: E402
from jaxkv.entrypoints import eval as jaxkv_eval  # noqa: E402
from jaxkv.kvcache import quant  # noqa: E402
from jaxkv.kvcache.spec import get_format  # noqa: E402
from jaxkv.model import mla as mla_layer  # noqa: E402
from jaxkv.retention import FullRetention  # noqa: E402
from lib.random_model import write_tokenizer  # noqa: E402

FP8 = get_format("fp8_e4m3")
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
              token_buckets=(16, 64), seq_buckets=(4,), num_kv_blocks=96)


def fake_fp8(x: jax.Array) -> jax.Array:
    """x [..., D] through e4m3 codes with one scale per vector, back to x's dtype."""
    codes, scale, _ = quant.quantize(x, FP8)
    return quant.dequantize(codes, scale, None, FP8).astype(x.dtype)


def variant_fn(name: str, lkv: int):
    """latent [T, 1, Lkv + R] -> the values the variant's cache gives back."""
    return {
        "fp8": fake_fp8,
        "fp8_two_scales": lambda x: jnp.concatenate([fake_fp8(x[..., :lkv]),
                                                     fake_fp8(x[..., lkv:])], -1),
        "fp8_rope_float": lambda x: jnp.concatenate([fake_fp8(x[..., :lkv]), x[..., lkv:]], -1),
    }[name]


def patched(fn):
    """Makes the MLA layer write ``fn(latent)`` (a fresh trace: jax's caches cleared)."""
    jax.clear_caches()
    jaxkv_eval._make_chunk_fn.cache_clear()
    mla_layer.write_layer = (lambda pool, new, *a: real_write(pool, fn(new), *a)) if fn \
        else real_write


real_write = mla_layer.write_layer


def save_model(path: Path, lkv: int, rope: int):
    """tests/test_mla.py's tiny DeepSeek-V3 (transformers' weights at torch seed 0, then norms
    and the choice bias perturbed) with ``write_tokenizer``'s vocabulary of 400."""
    import torch
    import transformers

    write_tokenizer(str(path), 400)
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6, initializer_range=0.2,
        bos_token_id=1, eos_token_id=[2, 0], kv_lora_rank=lkv, qk_nope_head_dim=16,
        qk_rope_head_dim=rope, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=24, n_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, max_position_embeddings=256,
        rope_parameters=dict(rope_type="yarn", factor=4.0, mscale=0.8, mscale_all_dim=0.8,
                             rope_theta=10000.0, original_max_position_embeddings=64),
        attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(path)


def generate(path, prompts, n, kv="auto"):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    with LLM(str(path), **ENGINE, kv_cache_dtype=kv) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def teacher_forced(path, prompts, continuations, kv="auto"):
    """(nll [prompts, n] of each continuation token, argmax [prompts, n])."""
    nll, top = [], []
    with LLM(str(path), **ENGINE) as llm:
        for p, c in zip(prompts, continuations):
            kv_dtype = "fp32" if kv == "auto" else kv
            r = jaxkv_eval.retained_nll(llm.engine.runner, p + c, retention=FullRetention(),
                                        kv_cache_dtype=kv_dtype, chunk=1,
                                        prompt_tokens=len(p), v_head_dim=0)
            nll.append(r.nll[len(p) - 1:])
            top.append(r.argmax[len(p) - 1:])
    return np.asarray(nll), np.asarray(top)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--latent", type=int, default=32)
    ap.add_argument("--rope", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "deepseek_v3"
    save_model(path, args.latent, args.rope)
    rng = np.random.default_rng(0)     # 48 tokens each: one prompt shape, one compile
    prompts = [rng.integers(3, 400, 48).tolist() for _ in range(args.prompts)]
    patched(None)
    ref_tokens = generate(path, prompts, args.tokens)
    ref_nll, _ = teacher_forced(path, prompts, ref_tokens)
    rows = []
    runs = [(v, variant_fn(v, args.latent), "auto")
            for v in ("fp8", "fp8_two_scales", "fp8_rope_float")] + [
        ("fp8 (pool)", None, "fp8"), ("bf16 (pool)", None, "bf16")]
    for name, fn, kv in runs:
        patched(fn)
        nll, top = teacher_forced(path, prompts, ref_tokens, kv)
        tokens = generate(path, prompts, args.tokens, kv)
        drift = np.abs(nll - ref_nll)
        first = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r))
                 for t, r in zip(tokens, ref_tokens)]
        rows.append(dict(variant=name, mean_drift=float(drift.mean()),
                         max_drift=float(drift.max()),
                         per_prompt_drift=[round(float(d), 4) for d in drift.mean(1)],
                         tf_agreement=float((top == np.asarray(ref_tokens)).mean()),
                         free_first_difference=float(np.mean(first)),
                         free_all_equal=sum(f == args.tokens for f in first)))
        print(json.dumps(rows[-1]), flush=True)
    patched(None)
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": str(args.json)},
                                             rows=rows), indent=1))


if __name__ == "__main__":
    main()
