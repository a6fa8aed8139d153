"""What the CPU's matrix multiply gives XLA and torch: SmolLM2's MLP dots, side by side.

The ceiling under jaxkv's prefill on a CPU is XLA's dot: a 512-token step of SmolLM2-135M is
~0.1 TFLOP of projections. This times the same chain in both frameworks, one process, one
thread pool each at its default: ``--layers`` MLP layers of SmolLM2-135M's shapes
(``x @ W_up`` [E, F] then SiLU then ``@ W_down`` [F, E], E = 576, F = 1536), jitted in JAX
and run eagerly in torch (one dot each, so the framework overhead is the dots'), for each
``--rows`` count and dtype (fp32, bf16), in ``--rounds`` rounds that alternate the two
frameworks; median and min milliseconds and GFLOP/s (2·rows·E·F·2 flops a layer), and the
load average. "XLA speed / torch's" is torch ms / XLA ms (above 1: XLA is faster). In fp32 the
same chain also runs with jaxkv's C++ matmul (``jaxkv.cpu_kernels.matmul``, which
jaxkv/model/linear.py takes for 2-16 rows) in place of XLA's dots, and the tied head's product
``x @ embedding.T`` ([rows, 576] @ [576, 49,152]) both ways ("head").

    PYTHONPATH=. python3 bench/experiments/dot_throughput.py [--rows 8,128,512] \
        [--json bench/experiments/results/dot_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxkv import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench/, for lib/ and the suite
from lib.step_timing import alternating_times, loadavg, ms_summary  # noqa: E402

E, F = 576, 1536


def jax_chain(dtype):
    """A jitted chain of MLP blocks: (x [R, E], ups: list of [E, F], downs: list of [F, E]),
    each weight its own array (a slice of a stacked [L, E, F] one would be copied per call)."""
    @jax.jit
    def f(x, ups, downs):
        for u, d in zip(ups, downs):
            x = (jax.nn.silu(x @ u) @ d).astype(dtype)
        return x
    return f


@jax.jit
def kernel_chain(x, ups, downs):
    """``jax_chain``'s fp32 chain with jaxkv's C++ matmul for both dots."""
    for u, d in zip(ups, downs):
        x = cpu_kernels.matmul(jax.nn.silu(cpu_kernels.matmul(x, u)), d)
    return x


def torch_chain(x, ups, downs):
    for u, d in zip(ups, downs):
        x = torch.nn.functional.silu(x @ u) @ d
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,128,512")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    ups = rng.standard_normal((a.layers, E, F), np.float32) * 0.02
    downs = rng.standard_normal((a.layers, F, E), np.float32) * 0.02
    out = {"jax": jax.__version__, "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "layers": a.layers, "cells": []}
    print(f"jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    emb = jnp.asarray(rng.standard_normal((49152, E), np.float32) * 0.02)
    heads = {"xla": jax.jit(lambda x, e: x @ e.T),
             "kernel": jax.jit(lambda x, e: cpu_kernels.matmul(x, e, transposed_w=True))}
    print("| rows | dtype | XLA ms | torch ms | kernel ms | XLA GFLOP/s | torch GFLOP/s "
          "| kernel GFLOP/s | XLA speed / torch's | head: XLA ms | head: kernel ms | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in a.rows.split(",")):
        x = rng.standard_normal((rows, E), np.float32)
        for name, jdt, tdt in (("fp32", jnp.float32, torch.float32),
                               ("bf16", jnp.bfloat16, torch.bfloat16)):
            jargs = [jnp.asarray(x, jdt), [jnp.asarray(u, jdt) for u in ups],
                     [jnp.asarray(d, jdt) for d in downs]]
            targs = [torch.from_numpy(t).to(tdt) for t in (x, ups, downs)]
            f = jax_chain(jdt)
            runs = {"xla": lambda: jax.block_until_ready(f(*jargs)),
                    "torch": lambda: torch_chain(targs[0], targs[1], targs[2])}
            if name == "fp32":
                runs["kernel"] = lambda: jax.block_until_ready(kernel_chain(*jargs))
                for k, h in heads.items():
                    runs[f"head_{k}"] = lambda h=h: jax.block_until_ready(h(jargs[0], emb))
            for fn in runs.values():
                fn()                                   # compile / warm up
            before = loadavg()
            with torch.inference_mode():
                times = alternating_times(runs, a.rounds, a.repeats)
            flops = 4 * rows * E * F * a.layers
            cell = {"rows": rows, "dtype": name, "load_before": before, "load_after": loadavg()}
            for k, ts in times.items():
                cell[k] = {**ms_summary(ts), "gflops_median": flops / statistics.median(ts) / 1e9}
            out["cells"].append(cell)
            xm, tm = cell["xla"]["ms_median"], cell["torch"]["ms_median"]

            def ms(k):
                return f"{cell[k]['ms_median']:.2f} ({cell[k]['ms_min']:.2f})" if k in cell else "-"

            def gf(k):
                return f"{cell[k]['gflops_median']:.0f}" if k in cell else "-"

            print(f"| {rows} | {name} | {ms('xla')} | {ms('torch')} | {ms('kernel')} | "
                  f"{gf('xla')} | {gf('torch')} | {gf('kernel')} | {tm / xm:.2f} | "
                  f"{ms('head_xla')} | {ms('head_kernel')} | {before[0]}-{cell['load_after'][0]} |",
                  flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
