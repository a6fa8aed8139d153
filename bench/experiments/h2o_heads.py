"""H2O's selection granularity: what a table per layer, or per (layer, kv head), would buy.

The engine's H2O (jaxkv/retention/h2o.py) keeps one set of KV positions per sequence, chosen by
attention mass summed over all 30 layers and 9 heads, because one block table serves every
layer and head. The paper (Zhang et al. 2023) keeps heavy hitters per head. Before anyone builds
per-head tables, this measures the difference in a plain numpy forward of SmolLM2-135M (float32,
the GGUF's dequantized weights, token by token with a KV cache), teacher-forced on
bench/retention_ppl.py's texts (``--texts`` segments of ``--tokens`` tokens of *Emma* after
``--skip``), with token-granular H2O at each budget:

* ``shared``: one kept set, scores summed over every layer and head (the engine's choice, at
  token granularity and scored by every query);
* ``layer``: a kept set per layer, scores summed over its heads;
* ``head``: a kept set per (layer, kv head), scores summed over the kv head's 3 query heads (the
  paper's per-head choice under GQA: K and V exist per kv head).

Every variant keeps 4 sink positions and a recent window of half the budget (``--recent``);
the rest of the budget holds the positions of highest accumulated mass (every query's attention weights added
after it attends; ties evict the older). Before each token, each set is cut back to the budget,
so a query attends to at most ``budget + 1`` positions (as the engine's step, ``budget + one
step``). ``full`` (no eviction) is checked against the engine's own full-cache perplexity on
the same texts (bench/retention_ppl.py: 23.652). Perplexity over all ``--tokens`` predictions::

    python3 bench/experiments/h2o_heads.py --budgets 0.2 \
        --out bench/experiments/results/h2o_heads.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxkv.model.weights import load_model_files
from jaxkv.data import austen

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
SINKS = 4


class Model:
    """SmolLM2's weights as float32 numpy arrays ([in, out] for the matvecs) and its config."""

    def __init__(self, path: Path):
        m = load_model_files(path)
        c, t = m.config, m.tensors
        self.c, self.tokenizer = c, m.tokenizer
        self.embed = t["model.embed_tokens.weight"]                       # [V, E]
        self.norm = t["model.norm.weight"]
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            w = {k: t[p + k] for k in ("input_layernorm.weight",
                                       "post_attention_layernorm.weight")}
            for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                w[k] = np.ascontiguousarray(t[p + k + ".weight"].T)         # [in, out]
            self.layers.append(w)
        D = c.head_dim
        inv = 1.0 / c.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
        self.inv_freq = inv                                                # [D/2]

    def rms(self, x, w):
        return (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.c.rms_norm_eps) * w
                ).astype(np.float32)

    def rope(self, x, pos):
        """HF rotate-half RoPE of x [..., D] at one position."""
        ang = pos * self.inv_freq
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        h = x.shape[-1] // 2
        return np.concatenate([x[..., :h] * cos - x[..., h:] * sin,
                               x[..., h:] * cos + x[..., :h] * sin], -1)


def kept_units(mode: str, L: int, Hkv: int) -> tuple[int, ...]:
    """The shape of the kept-set index: one set, one per layer, or one per (layer, kv head)."""
    return {"full": (1, 1), "shared": (1, 1), "layer": (L, 1), "head": (L, Hkv)}[mode]


def run(model: Model, tokens: np.ndarray, mode: str, budget: int | None,
        recent_frac: float = 0.5) -> np.ndarray:
    """NLL [T] of ``tokens[1:]`` given ``tokens[:-1]`` under ``mode``'s H2O at ``budget``
    with a recent window of ``recent_frac`` of the budget."""
    c = model.c
    L, H, Hkv, D = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
    G, T = H // Hkv, len(tokens) - 1
    K = np.zeros((L, T, Hkv, D), np.float32)                # rotated keys of every position
    V = np.zeros((L, T, Hkv, D), np.float32)
    units = kept_units(mode, L, Hkv)
    kept = np.zeros((*units, T), bool)                      # [UL, UH, T]
    score = np.zeros((*units, T), np.float64)
    recent = 0 if budget is None else int(budget * recent_frac)
    hidden = np.zeros((T, c.hidden_size), np.float32)
    scale = np.float32(1.0 / np.sqrt(D))
    for t in range(T):
        if budget is not None:                              # cut every set back to the budget
            while True:
                over = kept[..., :t].sum(-1) > budget       # [UL, UH]
                if not over.any():
                    break
                pos = np.arange(t)
                cand = kept[..., :t] & (pos >= SINKS) & (pos < t - recent)
                key = np.where(cand, score[..., :t], np.inf)
                victim = key.argmin(-1)                     # lowest mass; ties: the older
                ul, uh = np.nonzero(over & np.isfinite(key.min(-1)))
                if len(ul) == 0:
                    break
                kept[ul, uh, victim[ul, uh]] = False
        kept[..., t] = True
        x = model.embed[tokens[t]].astype(np.float32)
        for i, w in enumerate(model.layers):
            h = model.rms(x, w["input_layernorm.weight"])
            q = model.rope((h @ w["self_attn.q_proj"]).reshape(H, D), t)
            K[i, t] = model.rope((h @ w["self_attn.k_proj"]).reshape(Hkv, D), t)
            V[i, t] = (h @ w["self_attn.v_proj"]).reshape(Hkv, D)
            mask = kept[min(i, units[0] - 1)]                  # [UH, T]
            mask = np.broadcast_to(mask, (Hkv, T))[:, :t + 1]  # [Hkv, t + 1]
            qg = q.reshape(Hkv, G, D)
            s = np.einsum("hgd,nhd->hgn", qg, K[i, :t + 1]) * scale       # [Hkv, G, t + 1]
            s = np.where(mask[:, None, :], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out = np.einsum("hgn,nhd->hgd", p, V[i, :t + 1]).reshape(H * D)
            mass = p.sum(1)                                               # [Hkv, t + 1]
            if units == (L, Hkv):
                score[i, :, :t + 1] += mass
            elif units == (L, 1):
                score[i, 0, :t + 1] += mass.sum(0)
            else:
                score[0, 0, :t + 1] += mass.sum(0)
            x = x + out @ w["self_attn.o_proj"]
            h = model.rms(x, w["post_attention_layernorm.weight"])
            gate = h @ w["mlp.gate_proj"]
            x = x + ((gate / (1 + np.exp(-gate))) * (h @ w["mlp.up_proj"])) @ w["mlp.down_proj"]
        hidden[t] = x
    logits = model.rms(hidden, model.norm) @ model.embed.T                # [T, V] (tied)
    m = logits.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return lse - logits[np.arange(T), tokens[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--texts", type=int, default=2)
    ap.add_argument("--skip", type=int, default=2000)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.2])
    ap.add_argument("--modes", nargs="+", default=["shared", "layer", "head"])
    ap.add_argument("--recent", type=float, default=0.5,
                    help="the recent window's share of the budget (H2O's paper: half)")
    ap.add_argument("--full-ppl", type=float, help="the full cache's perplexity from an "
                    "earlier run on the same texts (skips computing it again)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/experiments/results/h2o_heads.json")
    a = ap.parse_args()
    model = Model(GGUF)
    ids = model.tokenizer.encode(austen("emma"))
    texts = [np.asarray(ids[a.skip + i * a.tokens: a.skip + (i + 1) * a.tokens + 1], np.int64)
             for i in range(a.texts)]
    configs = [("full", None, None)] * (a.full_ppl is None) + [
        (m, b, int(b * a.tokens)) for b in a.budgets for m in a.modes]
    full = a.full_ppl
    rows = []
    for mode, frac, budget in tqdm(configs, desc="configs"):
        t0 = time.perf_counter()
        nll = np.concatenate([run(model, x, mode, budget, a.recent) for x in texts])
        rows.append({"mode": mode, "budget": frac, "budget_tokens": budget,
                     "recent_tokens": None if budget is None else int(budget * a.recent),
                     "ppl": float(np.exp(nll.mean())), "tokens": len(nll),
                     "seconds": time.perf_counter() - t0,
                     "loadavg": [round(x, 2) for x in os.getloadavg()]})
        full = full or rows[-1]["ppl"]
        rows[-1]["vs_full"] = rows[-1]["ppl"] / full
        print(rows[-1], flush=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                 "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
