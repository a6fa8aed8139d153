"""Speculative decoding with the n-gram, suffix or draft-model proposer on SmolLM2-135M (fp32, CPU), greedy.

Workloads (``--workloads``, default both):

* ``extractive``: "repeat this passage exactly" over an Austen paragraph (Pride and Prejudice),
  where prompt lookup finds most of the output in the prompt;
* ``summary``: "summarise this passage, quoting its key sentences word for word" (quote-heavy:
  some of the output is in the prompt);
* ``free``: a free story (control): little to look up;
* ``agentic``: an agent's tool call: "call the search_flights tool ... as a JSON object" for a
  different trip in every request. The JSON scaffolding of the answer is not in the prompt but
  is the same in every answer: what a proposer that learns across requests (suffix) can draft
  and prompt lookup cannot.

``--context N`` lengthens every prompt to about N tokens: the extractive and summary passages are
that many tokens of consecutive Pride and Prejudice paragraphs, the free story gets them as
background text before its instruction. ``--keep-prefix-cache`` times decoding alone: the
timed runs take their prompts from the prefix cache the compiling run filled (the prefill is
the same work for every variant), so tok/s is output tokens per second of decoding.
``--kv-cache-dtype`` (e.g. int8) shrinks the KV pools of the variants' engines (all alive at
once for the round robin), each sized to the batch's prompts + outputs.

For each workload and batch size (``--batch-sizes``, default 1) there is one engine per variant:
no speculation, fixed draft lengths k (``--ks``, default 2,4,8) and adaptive k up to
``--adaptive`` (default 8). Each runs the batch once to compile (with ``--keep-prefix-cache``
twice: the first run's decodes start staggered behind the chunked prefills, the timed runs' in
lockstep, shapes of their own; the second run's tok/s is reported as ``warmup_tok_per_s``:
where an adaptive engine's exploration steps land), then ``--reps`` timed runs, taken
round robin over the variants so that load drift on a shared machine hits them alike (the
order reversed every other round, so that no variant always runs right after another). Reported
(medians over the runs): output tok/s (generated tokens / wall time of ``chat``), decode tok/s
(1 / TPOT), speed-up against no speculation (of the medians, and ``speedup_paired``: the
median of each round's ratio to the round's run without speculation, which cancels
the drift of a shared VM's speed over minutes; ``steal_share_runs``: the CPU time the
hypervisor took during each run; ``step_ms_runs`` and ``host_ms_per_step_runs``: each run's
target step time and the rest of its wall time, per step), acceptance rate, mean acceptance
length (tokens emitted per verifying sequence and step), target forwards (steps) per output
token, and whether the outputs equal those without speculation token for token (else the
first difference, ``[request, token]``).

``--shared-baseline`` runs the rows without speculation on the first speculating variant's
engine with its ``Speculator`` swapped for one without a proposer: a step without drafts is
the same compiled width-1 step on the same KV pool and prefix cache, so the two rows share one
prefill (at 4K tokens × batch 64 the bulk of the run) and differ by nothing but speculation.
Two engines doing identical work otherwise differ by up to 7% on these VMs
(bench/experiments/spec_overhead.py), which a ratio near 1.0 cannot tell from a real difference.

    python3 bench/speculative.py --out bench/results/speculative.json

``--proposer suffix`` gives the same rows for the suffix proposer (``speculative="suffix"``),
which also drafts from earlier requests' tokens: timed runs that re-send the warm-up's prompts
would then draft from their own earlier outputs. ``--fresh-prompts`` sends every timed round
prompts no earlier run sent (the next passages; stories about topics of ``MORE_STORIES``),
the same prompts to every variant of the round, and resets the prefix cache as usual:

    python3 bench/speculative.py --proposer ngram,suffix --fresh-prompts --workloads free,summary \
        --batch-sizes 1,4 --max-tokens 128

The draft-model proposer (``--proposer draft``): the rows are no speculation and one per
``--drafts`` entry ``NAME:K`` (fixed k) or ``NAME:aK`` (adaptive up to K: the engine measures
the draft's forwards itself), where NAME is ``self`` (the target as its own draft: every draft
accepted, the machinery's ceiling), ``firstN`` (the target's first N layers) or ``skipA-B`` (every layer
but ``[A, B)``), each written once by ``jaxkv.spec_decode.draft_model.write_truncated_draft`` under
``--draft-dir``, or a draft checkpoint's directory (bench/train_draft.py writes one). Greedy outputs are compared with no speculation; at a first difference the
fp32 top-2 logprob margin of the non-speculative run there is reported.

    python3 bench/speculative.py --proposer draft --batch-sizes 1,4 \
        --drafts self:4,first8:2,skip12-18:3,skip12-18:a4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from jaxkv import LLM, SamplingParams
from jaxkv.spec_decode.speculator import Speculator
from jaxkv.data import austen

ROOT = Path(__file__).resolve().parents[1]
BASELINE = (None, 0, False)   # the variant without speculation: (proposer, k, adaptive)
STORIES = ["a lighthouse keeper who finds a message in a bottle",
           "a girl who learns to talk to crows", "a clockmaker's last clock",
           "a dragon that is afraid of the dark"]
MORE_STORIES = STORIES + [   # --fresh-prompts: a new topic for every request of every run
    "a baker who bakes bread for ghosts", "a robot that collects bottle caps",
    "a river that flows uphill", "a painter who paints only doors", "a cat who runs a library",
    "a lost glove looking for its pair", "a violin that plays at midnight",
    "an astronaut who misses the rain", "a fox who guards a lighthouse",
    "a village where it always snows", "a postman who delivers dreams",
    "a whale that sings to ships", "a garden that grows overnight",
    "a girl who trades with the moon", "a snowman in the desert", "a map that draws itself",
    "a tortoise who wants to fly", "a chef who cooks with starlight", "a door at the bottom of a lake",
    "a kite that will not come down", "a mirror that shows tomorrow",
    "a shepherd counting falling stars", "a spider who weaves letters", "a clock that runs backwards",
    "a sparrow who befriends a giant", "a lantern that follows a child",
    "a pirate afraid of water", "a forest where the trees whisper",
]


def passages(n: int, n_chars: int = 700, context: int | None = None, start: int = 0
             ) -> list[str]:
    """``n`` paragraphs of Pride and Prejudice of about ``n_chars`` characters, or with
    ``context``, ``n`` runs of consecutive paragraphs of about ``context`` tokens each (4.2
    characters a token), each starting at a different paragraph; ``start`` skips that many
    passages (``--fresh-prompts``)."""
    text = austen("pride_and_prejudice")
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    if context is None:
        paras = [p for p in paras if n_chars // 2 <= len(p) <= n_chars and p[0].isalpha()]
        return paras[10 + start:10 + start + n]
    paras = [p for p in paras if len(p) > 80 and p[0].isalpha()]
    out = []
    for i in range(start, start + n):
        run, j = "", 10 + 7 * i
        while len(run) < 4.2 * context:
            run, j = f"{run}\n\n{paras[j]}".strip(), j + 1
        out.append(run[:int(4.2 * context)].rsplit(" ", 1)[0])
    return out


CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Dublin", "Oslo",
          "Athens", "Warsaw", "Zurich", "Brussels", "Amsterdam", "Stockholm", "Budapest"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]


def trip_request(i: int) -> str:
    """The ``agentic`` workload's ``i``-th request: a tool-call instruction for a trip that
    differs from every other ``i`` below len(CITIES) x len(MONTHS) x 28 (origin, month, day)."""
    n = len(CITIES)
    origin, destination = CITIES[i % n], CITIES[(i + 1 + i // n % (n - 1)) % n]
    people = f"{1 + i % 4} people want" if i % 4 else "One person wants"
    return ("Call the search_flights tool for the request below: answer with a JSON object "
            "with the keys name and arguments (origin, destination, date, passengers) and "
            f"nothing else.\n\nRequest: {people} to fly from {origin} to "
            f"{destination} on {1 + (i * 11) % 28} {MONTHS[i // n % len(MONTHS)]}.")


def conversations(workload: str, n: int, context: int | None = None, start: int | None = None
                  ) -> list[list[dict]]:
    """The batch's chat conversations of a workload (see the module docstring); with
    ``start`` (``--fresh-prompts``), other passages (from the ``start``-th on), stories about
    ``MORE_STORIES[start:start + n]`` and other trips, no topic twice in a batch."""
    first = start or 0
    if workload == "agentic":
        return [[{"role": "user", "content": trip_request(first + i)}] for i in range(n)]
    if workload == "extractive":
        return [[{"role": "user", "content": "Repeat the following passage exactly, word for "
                  f"word:\n\n{p}"}] for p in passages(n, context=context, start=first)]
    if workload == "summary":
        return [[{"role": "user", "content": "Summarise the following passage, quoting its key "
                  f"sentences word for word:\n\n{p}"}] for p in passages(n, context=context,
                                                                       start=first)]
    background = passages(n, context=context, start=first) if context else [""] * n
    if start is not None and start + n > len(MORE_STORIES):
        raise ValueError(f"--fresh-prompts: {start + n} story topics needed, "
                         f"{len(MORE_STORIES)} written")
    topics = [MORE_STORIES[start + i] if start is not None else STORIES[i % 4] for i in range(n)]
    return [[{"role": "user", "content": (f"Background:\n\n{background[i]}\n\n"
                                          if background[i] else "")
              + f"Write a short story about {topics[i]}."}] for i in range(n)]


def draft_path(name: str, args) -> str:
    """The draft model of a ``--drafts`` name, written on first use (see the module docstring)."""
    from jaxkv.spec_decode.draft_model import write_truncated_draft
    from jaxkv.model.weights import load_config

    if name == "self":
        return args.model
    if Path(name).expanduser().is_dir():   # a draft checkpoint (e.g. bench/train_draft.py's)
        return str(Path(name).expanduser())
    n = load_config(args.model).num_layers
    if name.startswith("first"):
        layers = list(range(int(name[5:])))
    elif name.startswith("skip"):
        a, b = map(int, name[4:].split("-"))
        layers = [i for i in range(n) if not a <= i < b]
    else:
        raise SystemExit(f"--drafts: unknown draft {name!r} (self, firstN, skipA-B or a "
                         f"checkpoint directory)")
    path = Path(args.draft_dir) / f"{Path(args.model).stem}-{name}"
    if not path.exists():
        write_truncated_draft(args.model, str(path), layers)
    return str(path)


def layer_subset_agreement(hf_dir: str, subsets: list[str], n_tokens: int = 400) -> dict:
    """Teacher-forced greedy agreement of layer-subset drafts with the full model (HF
    transformers, fp32, on ``n_tokens`` of Pride and Prejudice): the share of positions where
    the draft's argmax equals the full model's, an estimate of a greedy draft's acceptance."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    text = austen("pride_and_prejudice")[20000:23000]
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens]
    layers, n = model.model.layers, model.config.num_hidden_layers
    out = {}
    with torch.no_grad():
        full = model(ids, use_cache=False).logits.argmax(-1)
        for name in subsets:
            a, b = (0, int(name[5:])) if name.startswith("first") else map(int, name[4:].split("-"))
            keep = (list(range(b)) if name.startswith("first")
                    else [i for i in range(n) if not a <= i < b])
            model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
            model.config.num_hidden_layers = len(keep)
            draft = model(ids, use_cache=False).logits.argmax(-1)
            out[name] = float((draft == full).float().mean())
    return out


def engine(batch: int, variant: tuple, args) -> LLM:
    """A SmolLM2 engine for batch size ``batch`` and a variant ``(proposer, k, adaptive)``
    (proposer None: no speculation; ``"ngram"``; or a ``--drafts`` name); with ``--context``
    its KV pool holds the batch's prompts and outputs (and a block per sequence to spare)."""
    proposer, k, adaptive = variant
    spec = {}
    if proposer in ("ngram", "suffix"):
        spec = dict(speculative=proposer, num_speculative_tokens=k, speculative_adaptive=adaptive)
    elif proposer:
        spec = dict(speculative="draft", speculative_model=draft_path(proposer, args),
                    num_speculative_tokens=k, speculative_adaptive=adaptive)
    sizes = dict(max_model_len=2048)
    if args.context:
        max_len = args.context + args.max_tokens + 256   # the chat template and instruction
        sizes = dict(max_model_len=max_len, num_kv_blocks=batch * (max_len // 16 + 2) + 1)
    return LLM(args.model, dtype="float32", max_num_seqs=batch,
               max_num_batched_tokens=1024, token_buckets=(16, 64, 256, 1024),
               seq_buckets=(batch,), kv_cache_dtype=args.kv_cache_dtype, warmup=args.warmup,
               **spec | sizes)


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs since boot from /proc/stat (None off Linux): the
    share of time the hypervisor gave this VM's CPUs to others."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[7], sum(fields)


def timed_run(llm: LLM, convs, params, keep_prefix_cache: bool = False) -> dict:
    """One greedy ``chat`` of the whole batch (prefix cache reset first, unless
    ``keep_prefix_cache``): its wall time, tokens and the engine counters it moved, the CPU
    steal share during it, and the outputs."""
    if not keep_prefix_cache:
        llm.reset_prefix_cache()
    before, cpu0 = llm.stats(), cpu_times()
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after, cpu1 = llm.stats(), cpu_times()
    steal = ((cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]) if cpu0 and cpu1 else None)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    keys = ("num_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_num_drafts",
            "spec_draft_num_steps", "spec_draft_device_time_s", "device_time_s")
    return dict(wall_s=wall, tok_per_s=generated / wall, generated=generated, steal_share=steal,
                prompt_tokens=statistics.mean(len(o.prompt_token_ids) for o in outs),
                decode_tok_per_s=statistics.mean(1 / o.metrics.tpot for o in outs),
                outputs=[o.outputs[0].token_ids for o in outs],
                **{key: after.get(key, 0) - before.get(key, 0) for key in keys})


def _margin(logprobs: dict[int, float]) -> float | None:
    """The gap between the two most likely tokens' logprobs at one position."""
    top = sorted(logprobs.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else None


def top2_margins(llm: LLM, convs, params) -> list[list[float | None]]:
    """Per request and output token, the fp32 top-2 logprob margin of an (untimed) run."""
    outs = llm.chat(convs, dataclasses.replace(params, logprobs=2), use_tqdm=False)
    return [[_margin(lp) for lp in o.outputs[0].logprobs] for o in outs]


def summary(workload: str, batch: int, variant: tuple, runs: list[dict],
            base: list[dict], margins: list[list[float | None]]) -> dict:
    """One table row: medians over the timed runs, against the runs without speculation
    (``margins``: its ``top2_margins``)."""
    proposer, k, adaptive = variant
    med = {key: statistics.median(r[key] for r in runs)
           for key in ("tok_per_s", "decode_tok_per_s", "wall_s")}
    r = runs[0]   # greedy: every run emits the same tokens
    drafted, accepted, drafts = (r["spec_num_draft_tokens"], r["spec_num_accepted_tokens"],
                                 r["spec_num_drafts"])
    diff = next(([i, j] for i, (a, b) in enumerate(zip(r["outputs"], base[0]["outputs"]))
                 for j, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y), None)
    return dict(
        workload=workload, batch=batch, proposer=proposer, k=k, adaptive=adaptive,
        prompt_tokens=r["prompt_tokens"], generated=r["generated"], **med,
        speedup=med["tok_per_s"] / statistics.median(b["tok_per_s"] for b in base),
        speedup_paired=statistics.median(r["tok_per_s"] / b["tok_per_s"]
                                         for r, b in zip(runs, base)),
        steps_per_token=r["num_steps"] / r["generated"],
        acceptance_rate=accepted / drafted if drafted else None,
        mean_acceptance_length=1 + accepted / drafts if drafts else None,
        draft_steps_per_token=r["spec_draft_num_steps"] / r["generated"],
        draft_device_share=(r["spec_draft_device_time_s"] / r["wall_s"]
                            if r["spec_draft_device_time_s"] else None),
        target_step_ms=1e3 * r["device_time_s"] / r["num_steps"],
        draft_step_ms=(1e3 * r["spec_draft_device_time_s"] / r["spec_draft_num_steps"]
                       if r["spec_draft_num_steps"] else None),
        tok_per_s_runs=[x["tok_per_s"] for x in runs],
        step_ms_runs=[1e3 * x["device_time_s"] / x["num_steps"] for x in runs],
        host_ms_per_step_runs=[1e3 * (x["wall_s"] - x["device_time_s"]) / x["num_steps"]
                               for x in runs],
        steal_share_runs=[x["steal_share"] for x in runs],
        outputs_equal=r["outputs"] == base[0]["outputs"],
        first_difference=diff,
        first_difference_top2_margin=(margins[diff[0]][diff[1]] if diff
                                      and diff[1] < len(margins[diff[0]]) else None))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--workloads", default="extractive,free", help="extractive, summary, "
                    "free, agentic")
    ap.add_argument("--context", type=int, default=None, help="prompts of about this many "
                    "tokens (see the module docstring)")
    ap.add_argument("--keep-prefix-cache", action="store_true", help="time decoding alone: "
                    "timed runs hit the prefix cache the compiling run filled")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--ks", default="2,4,8", help="fixed draft lengths (no speculation is "
                    "always measured)")
    ap.add_argument("--adaptive", default="8", help="maximum draft lengths of adaptive rows")
    ap.add_argument("--proposer", default="ngram", help="ngram, suffix, both as ngram,suffix "
                    "(rows of each, round robin in one run), or draft")
    ap.add_argument("--fresh-prompts", action="store_true", help="every timed run sends "
                    "prompts no earlier run sent (other passages and story topics; the same "
                    "for every variant of a round): what a proposer that learns across "
                    "requests (suffix) may use is then earlier requests, never the same one")
    ap.add_argument("--drafts", default="self:4,first8:2,skip12-18:3,skip12-18:a4",
                    help="draft proposer rows NAME:K or NAME:aK (see the module docstring)")
    ap.add_argument("--draft-dir", default=str(Path.home() / ".cache" / "jaxkv" / "drafts"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", action="store_true", help="compile every step bucket of each "
                    "engine (and its draft's) at start: a draft's catch-up chunks of new "
                    "lengths otherwise compile inside the timed runs")
    ap.add_argument("--shared-baseline", action="store_true", help="the runs without "
                    "speculation use the first speculating variant's engine with its "
                    "speculator switched off: one engine, one prefill, no spread between "
                    "engines (see the module docstring)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "speculative.json"))
    ap.add_argument("--agreement", default=None, metavar="HF_DIR", help="instead: the "
                    "teacher-forced agreement of the --agreement-subsets layer subsets of the HF "
                    "model in HF_DIR with the full model")
    ap.add_argument("--agreement-subsets", default="first8,first20,first24,skip20-30,"
                    "skip10-20,skip12-18")
    args = ap.parse_args()
    if args.agreement:
        print(json.dumps(layer_subset_agreement(args.agreement,
                                                args.agreement_subsets.split(",")), indent=2))
        return
    variants = [BASELINE]
    if args.fresh_prompts and args.keep_prefix_cache:
        ap.error("--fresh-prompts sends prompts the prefix cache does not hold: drop "
                 "--keep-prefix-cache")
    if args.proposer == "draft":
        for entry in args.drafts.split(","):
            name, k = entry.rsplit(":", 1)
            variants.append((name, int(k.lstrip("a")), k.startswith("a")))
    elif set(args.proposer.split(",")) <= {"ngram", "suffix"}:
        for proposer in args.proposer.split(","):
            variants += [(proposer, int(k), False) for k in args.ks.split(",") if int(k)]
            variants += [(proposer, int(k), True) for k in args.adaptive.split(",") if k]
    else:
        ap.error(f"--proposer {args.proposer}: ngram, suffix, ngram,suffix or draft")
    rows, load = [], os.getloadavg()
    for workload in args.workloads.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            convs = conversations(workload, batch, args.context)
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
            shared = args.shared_baseline and len(variants) > 1
            engines = {v: engine(batch, v, args) for v in variants[shared:]}
            speculators = {v: llm.engine.speculator for v, llm in engines.items()}
            if shared:   # the first speculating engine with its speculator switched off
                engines = {BASELINE: engines[variants[1]]} | engines
                speculators[BASELINE] = Speculator(None, 0)
            warmup = {}
            for v in variants[shared:]:
                engines[v].chat(convs, params, use_tqdm=False)   # compiles every shape below
                if args.keep_prefix_cache:   # ... and those of decodes in lockstep
                    warmup[v] = timed_run(engines[v], convs, params, True)["tok_per_s"]
            runs = {v: [] for v in variants}
            timed = [conversations(workload, batch, args.context, start=batch * (rep + 1))
                     if args.fresh_prompts else convs for rep in range(args.reps)]
            order = list(engines.items())
            for rep, rep_convs in enumerate(timed):   # round robin, every other round reversed
                for v, llm in order if rep % 2 == 0 else order[::-1]:
                    llm.engine.speculator = speculators[v]
                    runs[v].append(timed_run(llm, rep_convs, params, args.keep_prefix_cache))
            engines[BASELINE].engine.speculator = speculators[BASELINE]
            margins = top2_margins(engines[BASELINE], timed[0], params)
            for v in variants[shared:]:   # each engine closes with its own speculator
                engines[v].engine.speculator = speculators[v]
            for v, llm in engines.items():
                llm.close()
                rows.append(summary(workload, batch, v, runs[v], runs[BASELINE], margins)
                            | {"warmup_tok_per_s": warmup.get(v), "shared_baseline": shared})
                print(rows[-1], file=sys.stderr)
    result = {"machine": platform.platform(), "processor": platform.processor(),
              "cpus": os.cpu_count(), "load_average_start_end": [load, os.getloadavg()],
              "date": time.strftime("%Y-%m-%d %H:%M"), "max_tokens": args.max_tokens,
              "context": args.context, "kv_cache_dtype": args.kv_cache_dtype,
              "keep_prefix_cache": args.keep_prefix_cache,
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
