"""Decode with gpt-oss's experts kept in MXFP4 (``quantization=None``) against de-quantized to
float32 (``"none"``), both engines in one process, alternated round by round (issue 51).

The model is gpt-oss-20b's shape cut to a few layers (hidden 2880, 64 query / 8 kv heads, 32
experts of width 2880, top 4, a sliding and a full layer) with the test tokenizer's 400-token
vocabulary, so the experts are nearly all of the weights: random bf16 attention weights and
random MXFP4 expert blocks (scales 2^-9 .. 2^-5), written as an MXFP4 HF checkpoint.

    python3 bench/experiments/mxfp4_decode.py [--layers 2] [--rounds 3] [--tokens 32] [--batch 1]
    python3 bench/experiments/mxfp4_decode.py --kernel      # the C++ kernel: MXFP4 against Q4_0

Prints the params' bytes and the ms per generated token of each round (a 32-token prompt,
prefill included; a warm-up round compiles) and whether the greedy tokens agree; with
``--kernel``, the best of 5 x 50 calls of the C++ kernel on one random [2880, 2880] weight's
codes read as MXFP4 (scales 2^-9 .. 2^-5) and as Q4_0 (f16 scales), at 1, 4, 8 and 32 rows.
"""

import argparse
import json
import pathlib
import sys
import tempfile
import time

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

from jaxkv import LLM, SamplingParams  # noqa: E402
from jaxkv.model.weights import expected_shapes  # noqa: E402
from jaxkv.model.safetensors_loader import read_hf_config  # noqa: E402
from tiny_models import save_tokenizer  # noqa: E402

E, F, X = 2880, 2880, 32


def write_checkpoint(path: pathlib.Path, layers: int) -> None:
    """An MXFP4 gpt-oss checkpoint of gpt-oss-20b's layer shape (random weights)."""
    save_tokenizer(path)
    config = dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_act="silu",
        hidden_size=E, intermediate_size=F, num_hidden_layers=layers, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=X, num_experts_per_tok=4,
        vocab_size=400, rms_norm_eps=1e-5, rope_theta=150000.0, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + (
            ["sliding_attention"] if layers % 2 else []),
        max_position_embeddings=4096, attention_bias=True, swiglu_limit=7.0,
        tie_word_embeddings=False, quantization_config=dict(quant_method="mxfp4"))
    (path / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape in expected_shapes(read_hf_config(path)).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            x, k, n = shape                                       # [X, in, out]
            tensors[f"{name}_blocks"] = rng.integers(0, 256, (x, n, k // 32, 16), np.uint8)
            tensors[f"{name}_scales"] = rng.integers(118, 123, (x, n, k // 32), np.uint8)
        else:
            w = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0, 0.02, shape)
            tensors[name] = w.astype(ml_dtypes.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))


def kernel() -> None:
    """MXFP4 against Q4_0 through ``cpu_kernels.quant_matmuls``, the same codes."""
    from jaxkv import cpu_kernels
    from jaxkv.model.quantized import QuantizedWeight

    rng = np.random.default_rng(0)
    qs = jax.numpy.asarray(rng.integers(0, 256, (E, E // 2), dtype=np.uint8))
    d16 = (rng.random((E, E // 32)) * 0.01).astype(np.float16)
    ws = {"Q4_0": QuantizedWeight(qs, jax.numpy.asarray(d16), None, "Q4_0", (E, E)),
          "MXFP4": QuantizedWeight(qs, jax.numpy.asarray(
              rng.integers(118, 123, (E, E // 32), dtype=np.uint8)), None, "MXFP4", (E, E))}
    product = jax.jit(lambda x, w: cpu_kernels.quant_matmuls(x, [w])[0])
    for rows in (1, 4, 8, 32):
        x = jax.numpy.asarray(rng.standard_normal((rows, E)).astype(np.float32))
        us = {}
        for name, w in ws.items():
            product(x, w).block_until_ready()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(50):
                    y = product(x, w)
                y.block_until_ready()
                best = min(best, (time.perf_counter() - t) / 50 * 1e6)
            us[name] = best
        print(f"{rows} rows: Q4_0 {us['Q4_0']:.0f} us, MXFP4 {us['MXFP4']:.0f} us "
              f"({us['MXFP4'] / us['Q4_0']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kernel", action="store_true", help="the C++ kernel alone")
    a = ap.parse_args()
    if a.kernel:
        return kernel()
    path = pathlib.Path(tempfile.mkdtemp())
    write_checkpoint(path, a.layers)
    llms = {q: LLM(str(path), dtype="float32", quantization=q, max_model_len=256,
                   max_num_seqs=max(a.batch, 2), seed=0) for q in (None, "none")}
    for q, llm in llms.items():
        held = sum(int(x.nbytes) for x in jax.tree.leaves(llm.engine.runner.params))
        print(f"quantization={q!r}: params {held / 2**20:,.1f} MiB")
    sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 35 + i))} for i in range(a.batch)]
    tokens = {q: [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
              for q, llm in llms.items()}                                     # warm-up
    ms = {q: [] for q in llms}
    for r in range(a.rounds):
        for q in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            t = time.perf_counter()
            llms[q].generate(prompts, sp, use_tqdm=False)
            ms[q].append((time.perf_counter() - t) / a.tokens * 1e3)
    for q, v in ms.items():
        print(f"quantization={q!r}: ms per token step " + " / ".join(f"{x:.1f}" for x in v))
    print("greedy tokens equal:", tokens[None] == tokens["none"])


if __name__ == "__main__":
    main()
