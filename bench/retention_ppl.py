"""Teacher-forced perplexity of SmolLM2-135M under KV budgets: full cache, StreamingLLM (sinks +
window) and H2O (heavy hitters + recent window), through ``jaxkv.eval.retained_nll``.

    python bench/retention_ppl.py --out bench/results/retention_ppl.json

``--texts`` disjoint segments of ``--tokens`` tokens from *Emma* (after ``--skip`` tokens), fed in
``--chunk``-token steps; a budget of b% keeps ``b% x tokens`` KV tokens per sequence (whole
blocks). H2O observes the last query of every chunk (``--chunk 1``: every query, the paper's
accumulation) and keeps half its budget as the recent window; streaming keeps 4 sinks + the
rest as its window. Perplexity over all scored tokens, relative to the full cache on the same
texts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxkv import LLM
from jaxkv.eval import retained_nll
from jaxkv.retention import FullRetention, H2ORetention, StreamingRetention

AUSTEN = Path(__file__).resolve().parents[2] / "shared" / "data" / "austen"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/retention_ppl.json")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--skip", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    args = ap.parse_args()

    with LLM(max_model_len=args.tokens + 16, max_num_seqs=1) as llm:
        runner = llm.engine.runner
        bs = runner.cache_config.block_size
        ids = llm.tokenizer.encode((AUSTEN / "emma.txt").read_text(encoding="utf-8"))
        texts = [np.asarray(ids[args.skip + i * args.tokens:args.skip + (i + 1) * args.tokens
                                + 1], np.int32) for i in range(args.texts)]
        configs = [("full", None, FullRetention())]
        for b in args.budgets:
            budget = max(bs * 3, int(b * args.tokens) // bs * bs)
            configs.append(("h2o", b, H2ORetention(budget_tokens=budget, sink_tokens=4)))
            configs.append(("streaming", b, StreamingRetention(sink_tokens=4,
                                                               window_tokens=budget - 4)))
        rows = []
        for name, frac, policy in tqdm(configs, desc="budgets"):
            nll = np.concatenate([retained_nll(runner, t, retention=policy,
                                               kv_cache_dtype="fp32", chunk=args.chunk).nll
                                  for t in texts])
            rows.append({"policy": name, "budget": frac, "ppl": float(np.exp(nll.mean())),
                         "tokens": len(nll), "loadavg": [round(x, 2) for x in os.getloadavg()]})
            print(rows[-1], flush=True)
    full = rows[0]["ppl"]
    for r in rows:
        r["vs_full"] = r["ppl"] / full
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
