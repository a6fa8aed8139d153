"""Held-out perplexity of each weight-quantization mode (issue 51): *Persuasion*, a novel jaxkv
does not bundle (bench/lib/heldout.py fetches it from Debian's r-cran-janeaustenr).

    python3 bench/weight_quant_ppl.py [--windows 8] [--out bench/results/weight_quant_ppl.json]
    python3 bench/weight_quant_ppl.py --modes None none --windows 3

Each model loads once per mode (``LLM(quantization=...)``, the pool ``jaxkv eval ppl`` sizes:
one window) and is scored through ``jaxkv.entrypoints.eval.perplexity``: disjoint windows of
``--context`` tokens fed in ``--chunk``-token chunks, the first ``--windows`` of the text, with
the KV cache in the model's dtype. A mode is ``None`` (weights as stored: a GGUF's Q4_1 blocks),
a ``quantization`` value (``none``: dequantized to float32, the model's float reference), or
``MODE:GROUP`` (``quantization_group_size=GROUP``, e.g. ``int4:32``). Δ% is against the same
model's ``none`` row. A mode the engine refuses gets an error row. The HF checkpoint is the
GGUF's Q4_1 weights dequantized to fp32 (bench/peers_setup.py), so its float rows and the
GGUF's agree; quantizing it again measures the loss against that float model. Prints a
markdown table; ``--out`` writes it with the rows, the command, the machine and the load
average as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.heldout import heldout_text  # noqa: E402

MODELS = ("SmolLM2-135M-Instruct", "/work/peers/SmolLM2-135M-Instruct-hf")
MODES = ("None", "none", "int8", "fp8", "int4:128", "int4:32")
BLOCK_SIZE = 16


def engine_args(mode: str) -> dict:
    """``LLM`` keyword arguments of a ``--modes`` entry."""
    name, _, group = mode.partition(":")
    args = {"quantization": None if name == "None" else name}
    return args | ({"quantization_group_size": int(group)} if group else {})


def score(model: str, mode: str, text: str, a) -> dict:
    """One row: the model's perplexity on ``text`` with weights in ``mode``."""
    from jaxkv import LLM
    from jaxkv.entrypoints.eval import perplexity

    row = {"model": model, "quantization": mode}
    try:
        with LLM(model, max_model_len=a.context, max_num_seqs=1, max_num_batched_tokens=a.chunk,
                 block_size=BLOCK_SIZE, num_gpu_blocks_override=-(-a.context // BLOCK_SIZE) + 1,
                 **engine_args(mode)) as llm:
            runner = llm.engine.runner
            ids = llm.tokenizer.encode(text)
            r = perplexity(runner, ids, kv_cache_dtype=runner.kv_cache_dtype, context=a.context,
                           stride=a.context, chunk=a.chunk, max_windows=a.windows,
                           residual_blocks=runner.kv_residual_blocks,
                           group_size=runner.kv_group_size, progress=True)
    except (TypeError, ValueError) as e:       # a mode or argument this engine does not have
        return row | {"error": f"{type(e).__name__}: {e}"}
    return row | {"perplexity": r.perplexity, "nll": r.nll, "tokens": r.num_scored,
                  "windows": r.num_windows, "seconds": r.seconds}


def table(rows: list[dict]) -> str:
    """The markdown table; Δ% against each model's ``none`` row."""
    ref = {r["model"]: r["perplexity"] for r in rows if r["quantization"] == "none"
           and "perplexity" in r}
    lines = ["| model | quantization | perplexity | Δ% vs float | tokens scored | windows | "
             "seconds |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = Path(r["model"]).name
        if "error" in r:
            lines.append(f"| {name} | {r['quantization']} | error: {r['error']} | | | | |")
            continue
        base = ref.get(r["model"])
        delta = f"{100 * (r['perplexity'] / base - 1):+.2f}" if base else "n/a"
        lines.append(f"| {name} | {r['quantization']} | {r['perplexity']:.3f} | {delta} | "
                     f"{r['tokens']} | {r['windows']} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "jaxkv_commit": commit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--modes", nargs="+", default=list(MODES),
                    help="None, a quantization value, or MODE:GROUP (default: %(default)s)")
    ap.add_argument("--book", default="persuasion", help="persuasion or northangerabbey")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    a = ap.parse_args()
    if a.windows < 3:
        ap.error("--windows must be at least 3")
    result = {"command": "python3 bench/weight_quant_ppl.py " + shlex.join(sys.argv[1:]),
              "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "loadavg_start": os.getloadavg(), "text": a.book, "context": a.context,
              "stride": a.context, "chunk": a.chunk}
    text = heldout_text(a.book)
    runs = [(m, q) for m in a.models for q in a.modes]
    result["rows"] = [score(m, q, text, a) for m, q in tqdm(runs, desc="rows", unit="row")]
    result["loadavg_end"] = os.getloadavg()
    result["markdown"] = table(result["rows"])
    m = result["machine"]
    print(f"{result['command']}\n{m['cores']} x {m['cpu']}, jaxkv {m['jaxkv_commit']}, "
          f"{a.book}, context {a.context}, chunk {a.chunk}; load average "
          f"{result['loadavg_start'][0]:.2f} -> {result['loadavg_end'][0]:.2f}\n\n"
          f"{result['markdown']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
