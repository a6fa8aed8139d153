"""A small draft model for ``speculative="draft"``, distilled from SmolLM2-135M-Instruct's own outputs.

SmolLM2-135M's layer subsets accept too few drafts for their cost (BENCHMARKS.md, draft-model
proposer). This trains a short one instead: the target's embedding (tied LM head, frozen: it
is what makes the draft speak the target's vocabulary) and final norm, and ``--layers`` of the
target's decoder layers as the draft's trunk (initialised from them, then trained), on what
the target itself generates, greedy, for chat prompts like bench/speculative.py's but disjoint
from them: short stories about other subjects, and "repeat" / "summarise" requests over
paragraphs of *Emma* and *Mansfield Park* (bench/speculative.py's passages are *Pride and
Prejudice*'s). The loss is the cross-entropy of the draft's next-token logits against the
target's greedy token at every output position (a greedy draft is accepted exactly when its
argmax equals the target's). Adam, written out (no optax), on a dense causal forward of the
draft; the generation and the draft's agreement with the target are measured on held-out
conversations before and after training (teacher-forced greedy agreement: the per-token
acceptance a greedy draft would see). The draft is written as an orbax checkpoint with the
target's tokenizer, loadable as ``speculative_model=``:

    python3 bench/train_draft.py --out ~/.cache/jaxkv/drafts/SmolLM2-135M-Instruct-trained2
    python3 bench/speculative.py --proposer draft --batch-sizes 1,4 \\
        --drafts ~/.cache/jaxkv/drafts/SmolLM2-135M-Instruct-trained2:a4

``--data FILE.npz`` keeps the target's generations (the 10 minutes of the first run) for a
later run, and ``--init DIR`` continues from an earlier run's draft (more epochs):

    python3 bench/train_draft.py --data ~/.cache/jaxkv/drafts/generations.npz \
        --init ~/.cache/jaxkv/drafts/SmolLM2-135M-Instruct-trained2 --epochs 4 \
        --out ~/.cache/jaxkv/drafts/SmolLM2-135M-Instruct-trained3

Prints the generation and training times, the loss curve and the agreement, and writes them as
JSON next to the checkpoint (``train_draft.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import LLM, SamplingParams
from jaxkv.model import checkpoint
from jaxkv.model.llama import params_from_hf
from jaxkv.model.rope import apply_rope, inv_frequencies
from jaxkv.model.weights import load_model_files
from jaxkv.data import austen

ROOT = Path(__file__).resolve().parents[1]
SUBJECTS = [
    "a baker who bakes bread for a whole village", "a cat that guards a library",
    "two brothers who build a boat", "a knight who is afraid of horses", "a snowman in spring",
    "a robot that wants to paint", "an old map in an attic", "a fox and a crow",
    "a girl who collects buttons", "a river that changes course", "a lost umbrella",
    "a soldier coming home", "a garden on a roof", "a violin with one string",
    "a fisherman and a storm", "a king who could not sleep", "a train that never stops",
    "a mouse in a cathedral", "a teacher on her last day", "a mountain that sings",
    "a boy and his kite", "a secret door in a school", "a queen who loved maps",
    "an owl who could not hoot", "a city under the sea", "a farmer and a comet",
    "a wolf who wanted friends", "a detective who hates rain", "a tree older than the town",
    "a sailor who could not swim", "a bell that rang by itself", "a bridge built in a night",
]


def conversations(n_stories: int, n_passages: int) -> list[list[dict]]:
    """Chat prompts: stories about ``SUBJECTS`` and repeat / summarise requests over Emma and
    Mansfield Park paragraphs (none of bench/speculative.py's)."""
    paras = []
    for book in ("emma.txt", "mansfield_park.txt"):
        text = austen(book)
        paras += [" ".join(p.split()) for p in text.split("\n\n")
                  if 300 <= len(" ".join(p.split())) <= 700]
    rng = np.random.default_rng(0)
    chosen = [paras[i] for i in rng.choice(len(paras), n_passages, replace=False)]
    out = [[{"role": "user", "content": f"Write a short story about {SUBJECTS[i % len(SUBJECTS)]}."}]
           for i in range(n_stories)]
    for i, p in enumerate(chosen):
        verb = ("Repeat the following passage exactly, word for word" if i % 2 == 0 else
                "Summarise the following passage, quoting its key sentences word for word")
        out.append([{"role": "user", "content": f"{verb}:\n\n{p}"}])
    return out


def generate(model: str, convs, max_tokens: int) -> list[tuple[list[int], int]]:
    """The target's greedy generations: ``(prompt + output token ids, prompt length)`` each."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    with LLM(model, max_model_len=1536) as llm:
        outs = llm.chat(convs, params)
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
            for o in outs]


def save_generations(path: Path, seqs) -> None:
    """Writes ``generate``'s sequences as .npz (tokens concatenated, with their lengths)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, tokens=np.concatenate([np.asarray(ids, np.int32) for ids, _ in seqs]),
             lengths=np.asarray([len(ids) for ids, _ in seqs]),
             prompt_lengths=np.asarray([p for _, p in seqs]))


def load_generations(path: Path) -> list[tuple[list[int], int]]:
    """``save_generations``'s sequences back."""
    z = np.load(path)
    ends = np.cumsum(z["lengths"])
    return [(z["tokens"][end - n:end].tolist(), int(p))
            for end, n, p in zip(ends, z["lengths"], z["prompt_lengths"])]


def batches(seqs, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Padded int32 tokens [N, length], targets [N, length] (the next token) and float32 loss
    weights [N, length] (1 at the output positions whose next token is an output token)."""
    n = len(seqs)
    tokens = np.zeros((n, length), np.int32)
    targets = np.zeros((n, length), np.int32)
    weights = np.zeros((n, length), np.float32)
    for i, (ids, prompt_len) in enumerate(seqs):
        ids = ids[:length + 1]
        tokens[i, :len(ids) - 1] = ids[:-1]
        targets[i, :len(ids) - 1] = ids[1:]
        weights[i, prompt_len - 1:len(ids) - 1] = 1.0
    return tokens, targets, weights


def forward(params, tokens, *, config, inv_freq):
    """Dense causal forward of a Llama decoder (jaxkv's params tree): logits f32 [B, L, V]
    for tokens int32 [B, L] (positions 0 .. L-1)."""
    c = config
    B, L = tokens.shape
    G = c.num_heads // c.num_kv_heads
    pos = jnp.arange(L, dtype=jnp.int32)
    mask = pos[:, None] >= pos[None, :]                                        # [L, L]

    def norm(x, w):
        return w * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps)

    x = params["embed_tokens"][tokens]                                         # [B, L, E]
    for i in range(c.num_layers):
        lp = params["layers"][i]
        a = lp["self_attn"]
        h = norm(x, lp["input_layernorm"]["weight"])
        q = jnp.einsum("ble,ehd->blhd", h, a["q_proj"])
        k = jnp.einsum("ble,ehd->blhd", h, a["k_proj"])
        v = jnp.einsum("ble,ehd->blhd", h, a["v_proj"])
        q, k = (jax.vmap(lambda t: apply_rope(t, pos, inv_freq))(t) for t in (q, k))
        q = q.reshape(B, L, c.num_kv_heads, G, c.head_dim) / np.sqrt(c.head_dim)
        s = jnp.einsum("blhgd,bmhd->bhglm", q, k)
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = jnp.einsum("bhglm,bmhd->blhgd", p, v).reshape(B, L, c.num_heads, c.head_dim)
        x = x + jnp.einsum("blhd,hde->ble", o, a["o_proj"])
        h = norm(x, lp["post_attention_layernorm"]["weight"])
        m = lp["mlp"]
        x = x + (jax.nn.silu(h @ m["gate_proj"]) * (h @ m["up_proj"])) @ m["down_proj"]
    x = norm(x, params["norm"]["weight"])
    return x @ params["embed_tokens"].T


def split(params):
    """(trained: the trunk and the final norm, frozen: the embedding / tied LM head)."""
    return {"layers": params["layers"], "norm": params["norm"]}, params["embed_tokens"]


def loss_fn(trained, embed, tokens, targets, weights, *, config, inv_freq):
    logits = forward({**trained, "embed_tokens": embed}, tokens, config=config,
                     inv_freq=inv_freq)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def agreement(params, data, *, config, inv_freq, batch: int, head_ids=None) -> float:
    """Share of the output positions where the model's argmax (among ``head_ids`` only, int
    [N], when given: a reduced head's) equals the target's token."""
    fwd = jax.jit(partial(forward, config=config, inv_freq=inv_freq))
    tokens, targets, weights = data
    hit = total = 0.0
    for i in range(0, len(tokens), batch):
        logits = fwd(params, jnp.asarray(tokens[i:i + batch]))
        if head_ids is None:
            pred = np.asarray(jnp.argmax(logits, axis=-1))
        else:
            pred = np.asarray(head_ids)[np.asarray(jnp.argmax(logits[..., head_ids], axis=-1))]
        w = weights[i:i + batch]
        hit += float(((pred == targets[i:i + batch]) * w).sum())
        total += float(w.sum())
    return hit / total


def adam_step(trained, grads, m, v, step, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam update (Kingma & Ba), bias-corrected; returns (params, m, v)."""
    m = jax.tree_util.tree_map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
    v = jax.tree_util.tree_map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
    mc, vc = 1 - b1 ** step, 1 - b2 ** step
    trained = jax.tree_util.tree_map(lambda p, a, b: p - lr * (a / mc) / (jnp.sqrt(b / vc) + eps),
                                     trained, m, v)
    return trained, m, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--layers", default="0,29", help="the target layers the trunk starts from")
    ap.add_argument("--stories", type=int, default=96)
    ap.add_argument("--passages", type=int, default=96)
    ap.add_argument("--held-out", type=int, default=24, help="conversations kept for eval")
    ap.add_argument("--max-tokens", type=int, default=256, help="target tokens per prompt")
    ap.add_argument("--length", type=int, default=512, help="training sequence length")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--init", type=Path, default=None, help="start from this draft checkpoint "
                    "(e.g. an earlier run's --out: more epochs) instead of --layers")
    ap.add_argument("--data", type=Path, default=None, help="the target's generations as .npz: "
                    "read when the file exists, else generated and written there")
    ap.add_argument("--head-vocab", type=int, default=None, help="also write OUT-vN: the "
                    "draft with an LM head over the N tokens most frequent in the target's "
                    "training outputs (FR-Spec; "
                    "jaxkv.spec_decode.draft_model.write_reduced_head_draft)")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()

    t0 = time.perf_counter()
    if a.data is not None and a.data.exists():
        seqs = load_generations(a.data)
    else:
        seqs = generate(a.model, conversations(a.stories, a.passages), a.max_tokens)
        if a.data is not None:
            save_generations(a.data, seqs)
    gen_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    order = rng.permutation(len(seqs))
    held, train = [seqs[i] for i in order[:a.held_out]], [seqs[i] for i in order[a.held_out:]]
    train_data, held_data = batches(train, a.length), batches(held, a.length)
    n_out = int(train_data[2].sum())
    print(f"generated {len(seqs)} conversations in {gen_s:.0f} s; {n_out} training output "
          f"tokens, {int(held_data[2].sum())} held out", flush=True)

    loaded = load_model_files(a.model)
    target_config = loaded.config
    target = params_from_hf(target_config, loaded.tensors, jnp.float32, source=loaded.source)
    if a.init is not None:
        config = checkpoint.read_config(a.init)
        draft = jax.tree_util.tree_map(jnp.asarray, checkpoint.restore_params(a.init))
        draft["layers"] = {int(i): layer for i, layer in draft["layers"].items()}
        keep = checkpoint.read_metadata(a.init)["layers"]
    else:
        keep = [int(x) for x in a.layers.split(",")]
        config = dataclasses.replace(target_config, num_layers=len(keep))
        draft = {"embed_tokens": target["embed_tokens"], "norm": target["norm"],
                 "layers": {i: target["layers"][j] for i, j in enumerate(keep)}}
    inv_freq = inv_frequencies(config)
    kw = dict(inv_freq=inv_freq, batch=a.batch)
    target_agree = agreement(target, held_data, config=target_config, **kw)
    before = agreement(draft, held_data, config=config, **kw)
    print(f"held-out agreement with the target's greedy tokens: the target itself "
          f"{target_agree:.3f} (the forward's check), the draft before training {before:.3f}",
          flush=True)

    trained, embed = split(draft)
    grad_fn = jax.jit(jax.value_and_grad(partial(loss_fn, config=config, inv_freq=inv_freq)))
    update = jax.jit(adam_step)
    m = jax.tree_util.tree_map(jnp.zeros_like, trained)
    v = jax.tree_util.tree_map(jnp.zeros_like, trained)
    losses, step, t1 = [], 0, time.perf_counter()
    for epoch in range(a.epochs):
        perm = rng.permutation(len(train_data[0]))
        for i in range(0, len(perm) - a.batch + 1, a.batch):
            idx = perm[i:i + a.batch]
            loss, grads = grad_fn(trained, embed, *(jnp.asarray(x[idx]) for x in train_data))
            step += 1
            trained, m, v = update(trained, grads, m, v, step, a.lr)
            losses.append(float(loss))
        print(f"epoch {epoch + 1}: mean loss {np.mean(losses[-(len(perm) // a.batch):]):.3f} "
              f"({time.perf_counter() - t1:.0f} s)", flush=True)
    train_s = time.perf_counter() - t1
    draft = {**trained, "embed_tokens": embed}
    after = agreement(draft, held_data, config=config, **kw)
    print(f"held-out agreement after training: {after:.3f} (before {before:.3f})", flush=True)

    checkpoint.save_params(a.out, draft, {"source": loaded.source, "dtype": "float32",
                                          "layers": keep, "trained": "bench/train_draft.py"},
                           config=config, overwrite=True)
    checkpoint.write_tokenizer(a.out, loaded.tokenizer)
    report = {"args": {k: str(x) for k, x in vars(a).items()}, "generate_s": gen_s,
              "train_s": train_s, "train_output_tokens": n_out,
              "held_out_output_tokens": int(held_data[2].sum()), "steps": step,
              "losses": losses, "agreement": {"target": target_agree, "before": before,
                                              "after": after}}
    if a.head_vocab:
        report["reduced_head"] = reduced_head(a, draft, train_data, held_data, config,
                                              loaded.tokenizer.eos_token_ids, **kw)
    (a.out / "train_draft.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")


def reduced_head(a, draft, train_data, held_data, config, eos_ids, **kw) -> dict:
    """Writes ``OUT-vN`` (``--head-vocab N``): the trained draft with a head over the N tokens
    most frequent among the training outputs (the eos ids always among them); returns the
    held-out coverage (share of the target's output tokens among them) and agreement."""
    from jaxkv.spec_decode.draft_model import write_reduced_head_draft

    tokens, weights = train_data[1], train_data[2] > 0
    counts = np.bincount(tokens[weights], minlength=config.vocab_size)
    counts[list(eos_ids)] = counts.max() + 1
    ids = np.sort(np.argsort(-counts, kind="stable")[:a.head_vocab])
    held_targets = held_data[1][held_data[2] > 0]
    coverage = float(np.isin(held_targets, ids).mean())
    agree = agreement(draft, held_data, config=config, head_ids=ids, **kw)
    path = a.out.with_name(f"{a.out.name}-v{a.head_vocab}")
    write_reduced_head_draft(str(a.out), str(path), ids.tolist(), overwrite=True)
    print(f"reduced head over {a.head_vocab} tokens: held-out coverage {coverage:.3f}, "
          f"agreement {agree:.3f}; wrote {path}", flush=True)
    return {"path": str(path), "tokens": a.head_vocab, "held_out_coverage": coverage,
            "agreement": agree}


if __name__ == "__main__":
    main()
