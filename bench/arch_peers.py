"""Other architectures on CPU against vLLM's CPU build: a Qwen3-style and a Gemma 3-style tiny model
(issue 52, "Speed on CPU").

bench/peers.py compares jaxkv with vLLM and llama.cpp on SmolLM2 (a Llama); this runs the same
kind of side-by-side on two random tiny HF checkpoints of other families, written here by
transformers:

* ``qwen3``: ``Qwen3Config``, hidden 256, 4 layers, 8 q / 2 kv heads, head_dim 64, MLP 768
  (q/k RMSNorm);
* ``gemma3``: ``Gemma3TextConfig``, hidden 256, 6 layers (5 sliding : 1 full), sliding window
  128, 4 q / 1 kv heads, head_dim 64, MLP 768, ``query_pre_attn_scalar`` 64 (jaxkv runs it
  with its hybrid KV cache: the sliding layers keep only their window).

Both untied, initializer_range 0.1 (``INIT_RANGE``), ~29 M parameters (25 M of them the
embedding and LM head).

Both use SmolLM2's tokenizer (49,152 ids, from jaxkv's GGUF, saved beside the weights) and are
saved in fp32; each engine casts to the dtype of the run (``dtype=`` on both sides), so fp32
against fp32 and bf16 against bf16 read the very same numbers. Every engine gets token ids, not
text: 8 prompts of 256 random ids (seed 0, ids 17.. (past SmolLM2's special tokens)), 128
greedy output tokens each (``ignore_eos``), the same limits (max length 1024, 512 tokens per
step, 256 sequences, a 1 GiB KV pool), prefix caching reset before every timed run.

Each engine configuration runs in its own process (jaxkv from a ``git archive`` snapshot of
HEAD's ``jaxkv/``; vLLM from its venv, ``VLLM_CPU_OMP_THREADS_BIND=0-1``: both cores, as
XLA uses), one after another. Before each process the parent waits (polling every minute, at
most ``--max-wait`` seconds, ``--max-total-wait`` in all) for the 1-minute load average to
fall below ``--quiet-load``; ``--resume`` reuses the processes an interrupted run completed.
Untimed warm-up first: the whole batch once and the single request once (compilation,
lazy initialisation). Then, ``--repeats`` times each:

* batch: the 8 requests together, output tokens / wall time (prefill included);
* single: one request alone, once with 1 output token (prefill) and once with 128:
  single-request decode tok/s = 127 / (t128 - t1); also 128 / t128 end to end.

Medians are reported; the load average before and after every timed run is recorded. Greedy
tokens of every vLLM run are compared with jaxkv's of the same model and dtype: requests
identical, and where the first difference falls; every bf16 run also with jaxkv's fp32 run of
the same model (how far each engine's bf16 greedy path follows the fp32 one).

    python3 bench/peers_setup.py                 # the vLLM venv (shared/notes/peers-cpu.md)
    python3 bench/arch_peers.py                  # both models, fp32 and bf16, jaxkv and vLLM
    python3 bench/arch_peers.py --models gemma3 --dtypes float32 --repeats 1
    python3 bench/arch_peers.py --report bench/results/arch_peers.json   # its .md again

Writes ``--out`` (JSON, default bench/results/arch_peers.json) and the same name in ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lib.step_timing import loadavg, log   # bench/ is the script's directory
from lib.vllm_peer import peer_env, vllm_llm

REPO = Path(__file__).resolve().parents[1]
GGUF = REPO / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152
FIRST_ID = 17                                   # SmolLM2's special tokens are ids 0..16
LIMITS = {"max_model_len": 1024, "max_num_batched_tokens": 512, "max_num_seqs": 256}
KV_BYTES = 1 << 30
# Random weights at HF's default init (0.02) with tied embeddings make greedy decoding repeat
# one token (the last token's embedding dominates the logits): a token comparison would then
# prove little. Untied, at 0.1, 128 greedy tokens hold ~90-125 distinct ids (measured with
# transformers), top-2 logit gaps down to ~1e-3 (fp32).
INIT_RANGE = 0.1

MODELS = {
    "qwen3": ("Qwen3Config", {
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}),
    "gemma3": ("Gemma3TextConfig", {
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
        "sliding_window": 128, "query_pre_attn_scalar": 64}),
}
# vLLM's names for the same dtype
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


# ---------------------------------------------------------------------- the checkpoints


def build(name: str, out: Path) -> Path:
    """Writes the random tiny ``name`` model (fp32 safetensors, config) and SmolLM2's tokenizer
    to ``out``, unless it is there already."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    import transformers

    cls, fields = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(
        vocab_size=VOCAB, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
        initializer_range=INIT_RANGE, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    tok.save_pretrained(str(out))
    log(f"wrote {name} to {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
        f"params, {config.architectures}")
    return out


def workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(FIRST_ID, VOCAB, size=prompt_len)] for _ in range(n)]


# ---------------------------------------------------------------------- workers (subprocesses)


def jaxkv_engine(job):
    from jaxkv import LLM, SamplingParams

    llm = LLM(job["model_dir"], dtype=job["dtype"], seed=0, kv_cache_memory_bytes=KV_BYTES,
              **LIMITS)

    def generate(prompts, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    info = {"kv_cache_dtype": str(llm.kv_cache_dtype),
            "kv_groups": repr(getattr(llm.cache_config, "kv_groups", None))[:300]}
    return generate, llm.reset_prefix_cache, info


def vllm_engine(job):
    llm, vllm_generate, info = vllm_llm(job["model_dir"], job["dtype"], KV_BYTES,
                                        job["vllm_eager"], LIMITS)

    def generate(prompts, max_tokens):
        return vllm_generate(prompts, [max_tokens] * len(prompts))

    return generate, llm.reset_prefix_cache, info


def worker_main(job_file: str, out_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    t0 = time.perf_counter()
    generate, reset, info = {"jaxkv": jaxkv_engine, "vllm": vllm_engine}[job["engine"]](job)
    prompts, olen = job["prompts"], job["output_len"]
    reset()
    generate(prompts, olen)                       # warm-up: the batch's shapes
    reset()
    generate(prompts[:1], olen)                   # and the single request's
    reset()
    generate(prompts[:1], 1)
    startup_s = time.perf_counter() - t0
    log(f"{job['engine']} {job['dtype']}: started and warmed up in {startup_s:.1f} s")

    def timed(ps, n):
        reset()
        before = loadavg()
        t = time.perf_counter()
        outs = generate(ps, n)
        s = time.perf_counter() - t
        assert all(len(o) == n for o in outs), [len(o) for o in outs]
        return outs, {"s": s, "load_before": before, "load_after": loadavg()}

    runs = {"batch": [], "single_1": [], "single_n": []}
    batch_outs = single_outs = None
    for r in range(job["repeats"]):
        outs, run = timed(prompts, olen)
        run["tok_s"] = len(prompts) * olen / run["s"]
        run["outputs_equal_first_repeat"] = batch_outs is None or outs == batch_outs
        batch_outs = batch_outs or outs
        runs["batch"].append(run)
        _, run1 = timed(prompts[:1], 1)
        runs["single_1"].append(run1)
        outs, run = timed(prompts[:1], olen)
        run["tok_s"] = olen / run["s"]
        run["decode_tok_s"] = (olen - 1) / (run["s"] - run1["s"])
        single_outs = single_outs or outs
        runs["single_n"].append(run)
        log(f"{job['engine']} {job['dtype']} repeat {r}: batch {runs['batch'][-1]['tok_s']:.1f} "
            f"tok/s, single decode {run['decode_tok_s']:.1f} tok/s (prefill {run1['s']:.3f} s)")
    Path(out_file).write_text(json.dumps({
        "startup_s": startup_s, "info": info, "runs": runs, "batch_outputs": batch_outs,
        "single_outputs": single_outs}))


# ---------------------------------------------------------------------- the parent


def wait_quiet(threshold: float, max_wait: float) -> dict:
    """Polls the 1-minute load every minute until it is below ``threshold``, at most
    ``max_wait`` seconds; returns the load at the start, the seconds waited and the load then."""
    start, t = loadavg(), time.time()
    while loadavg()[0] > threshold and time.time() - t < max_wait:
        log(f"load {loadavg()[0]:.2f} > {threshold}: waiting (up to {max_wait - (time.time() - t):.0f} s more)")
        time.sleep(60)
    return {"load_at_start": start, "waited_s": round(time.time() - t), "load_then": loadavg()}


def first_differences(outs, ref) -> dict:
    same, firsts = 0, []
    for x, y in zip(outs, ref):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        same += x == y
        if x != y:
            firsts.append(k)
    return {"identical": same, "requests": len(ref), "first_difference_at": firsts}


def agreement(rec: dict, ref: dict) -> dict:
    return {"batch": first_differences(rec["batch_outputs"], ref["batch_outputs"]),
            "single": first_differences(rec["single_outputs"], ref["single_outputs"])}


def run_one(a, engine: str, model: str, dtype: str, model_dir: Path, prompts, work: Path,
            snap: Path | None) -> dict:
    """One engine process on one model and dtype; its record (with the full token lists) is
    also kept under ``<checkpoints>/raw/``, which ``--resume`` reuses for the same job."""
    name = f"{engine}-{model}-{dtype}"
    job = {"engine": engine, "model_dir": str(model_dir), "dtype": dtype, "prompts": prompts,
           "output_len": a.output_len, "repeats": a.repeats, "vllm_eager": a.vllm_eager}
    raw = Path(a.checkpoints) / "raw" / f"{name}.json"
    if a.resume and raw.exists():
        old = json.loads(raw.read_text())
        if old.get("job") == job and "error" not in old:
            log(f"{name}: reusing {raw} (--resume)")
            return dict(old, resumed=True)
    budget = max(0.0, min(a.max_wait, a.max_total_wait - a.waited))
    quiet = wait_quiet(a.quiet_load, budget)
    a.waited += quiet["waited_s"]
    jf, of, lf = work / f"{name}.job.json", work / f"{name}.out.json", work / f"{name}.log"
    jf.write_text(json.dumps(job))
    env = peer_env(a.peer_cache)
    if engine == "jaxkv":
        python = sys.executable
        env["PYTHONPATH"] = str(snap)
    else:
        python = str(Path(a.vllm_venv) / "bin" / "python")
        env["VLLM_CPU_OMP_THREADS_BIND"] = a.vllm_threads_bind
        env.pop("PYTHONPATH", None)
    log(f"{name}: starting")
    t = time.time()
    with open(lf, "w") as f:
        rc = subprocess.run([python, str(Path(__file__).resolve()), "--_worker", str(jf),
                             str(of)], env=env, stdout=f, stderr=subprocess.STDOUT,
                            check=False).returncode
    wall = time.time() - t
    tail = lf.read_text().splitlines()
    rec = {"engine": engine, "model": model, "dtype": dtype, "quiet_wait": quiet,
           "process_wall_s": wall, "load_after_process": loadavg(), "jaxkv_commit": a.commit,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))}
    if rc != 0 or not of.exists():
        errs = [l for l in tail if "Error" in l or "error" in l]
        rec.update(error=f"exit {rc}", error_lines=errs[-8:], log_tail=tail[-40:])
        log(f"{name}: FAILED (exit {rc}):\n" + "\n".join(tail[-30:]))
        return rec
    rec.update(json.loads(of.read_text()))
    rec["log_repeats"] = [l for l in tail if " repeat " in l or "warmed up" in l]
    rec["log_notes"] = [l[:300] for l in tail if any(k in l for k in (
        "backend", "Backend", "KV cache", "sliding", "dtype", "WARNING"))][-15:]
    log(f"{name}: done in {wall:.0f} s")
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(dict(rec, job=job)))
    return rec


def summary(rec: dict) -> dict:
    runs = rec["runs"]

    def med(k, xs):
        return statistics.median(x[k] for x in xs)

    loads = [x["load_before"][0] for v in runs.values() for x in v] + \
            [x["load_after"][0] for v in runs.values() for x in v]
    return {"batch_tok_s": med("tok_s", runs["batch"]),
            "batch_tok_s_range": [min(x["tok_s"] for x in runs["batch"]),
                                  max(x["tok_s"] for x in runs["batch"])],
            "single_decode_tok_s": med("decode_tok_s", runs["single_n"]),
            "single_e2e_tok_s": med("tok_s", runs["single_n"]),
            "single_prefill_s": med("s", runs["single_1"]),
            "load_1min_min_max": [min(loads), max(loads)], "n": len(runs["batch"])}


def agree_cell(g: dict | None) -> str:
    if g is None:
        return "–"
    b, sg = g["batch"], g["single"]
    cell = f"{b['identical']}/{b['requests']} batch, {sg['identical']}/1 single"
    if b["first_difference_at"]:
        cell += f" (equal tokens before the first difference: {b['first_difference_at']})"
    return cell


def markdown(result: dict) -> str:
    w = result["workload"]
    lines = [(f"| engine | model | dtype | batch tok/s ({w['prompts']}×{w['output_len']}) | "
              "single decode tok/s | "
              f"single {w['output_len']}-token tok/s | greedy tokens vs jaxkv | start-up s | "
              "load (1 min) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for rec in result["runs"]:
        head = f"| {rec['engine']} | {rec['model']} | {rec['dtype']} |"
        if "error" in rec:
            lines.append(head + f" refused: {rec['error_summary']} | | | | | |")
            continue
        s = rec["summary"]
        g = rec.get("agreement_vs_jaxkv")
        agree = "(reference)" if rec["engine"] == "jaxkv" else agree_cell(g)
        if "agreement_vs_jaxkv_float32" in rec:
            agree += ("; " if agree else "") + "vs jaxkv fp32: " + agree_cell(
                rec["agreement_vs_jaxkv_float32"])
        lo, hi = s["load_1min_min_max"]
        lines.append(head + f" {s['batch_tok_s']:.1f} ({s['batch_tok_s_range'][0]:.1f}–"
                     f"{s['batch_tok_s_range'][1]:.1f}) | {s['single_decode_tok_s']:.1f} | "
                     f"{s['single_e2e_tok_s']:.1f} | {agree} | {rec['startup_s']:.0f} | "
                     f"{lo:.2f}–{hi:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3,gemma3")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--engines", default="jaxkv,vllm")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--checkpoints", default="/work/peers/arch",
                    help="where the tiny HF checkpoints are written (and reused)")
    ap.add_argument("--vllm-venv", default="/work/peers/vllm-venv")
    ap.add_argument("--vllm-threads-bind", default="0-1")
    ap.add_argument("--vllm-eager", action="store_true",
                    help="enforce_eager=True (default: vLLM's own default, torch.compile)")
    ap.add_argument("--peer-cache", default="/work/peers/cache")
    ap.add_argument("--quiet-load", type=float, default=1.5)
    ap.add_argument("--max-wait", type=float, default=1200,
                    help="most seconds to wait for --quiet-load before one engine process")
    ap.add_argument("--max-total-wait", type=float, default=1800,
                    help="most seconds of such waiting in the whole run (then no more waits)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the records of engine processes that already ran the same job "
                         "(kept under <checkpoints>/raw/)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "arch_peers.json"))
    a = ap.parse_args()
    a.waited = 0.0
    sys.path[:0] = [str(REPO / "bench"), str(REPO)]   # peers.py imports jaxkv.data
    from peers import jaxkv_snapshot

    t_start = time.time()
    commit = a.commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                                       capture_output=True, text=True, check=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    prompts = workload(a.prompts, a.prompt_len)
    result = {"command": "python3 bench/arch_peers.py " + " ".join(sys.argv[1:]),
              "machine": {"cpu": cpu, "cores": os.cpu_count()}, "jaxkv_commit": commit,
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_start": loadavg(),
              "workload": {"prompts": a.prompts, "prompt_len": a.prompt_len,
                           "output_len": a.output_len, "ids": f"uniform {FIRST_ID}..{VOCAB - 1}, "
                           "seed 0", "greedy": True, "ignore_eos": True},
              "limits": dict(LIMITS, kv_cache_memory_bytes=KV_BYTES),
              "vllm": {"threads_bind": a.vllm_threads_bind,
                       "mode": "eager" if a.vllm_eager else "default (torch.compile)"},
              "models": {m: {"config_class": MODELS[m][0], **MODELS[m][1]}
                         for m in a.models.split(",")},
              "runs": []}
    done = {}                                   # (engine, model, dtype) -> record
    with tempfile.TemporaryDirectory(prefix="arch-peers-") as tmp:
        work = Path(tmp)
        snap = jaxkv_snapshot(work) if "jaxkv" in a.engines.split(",") else None
        for model in a.models.split(","):
            model_dir = build(model, Path(a.checkpoints) / f"{model}-tiny")
            for dtype in a.dtypes.split(","):
                for engine in a.engines.split(","):
                    rec = run_one(a, engine, model, dtype, model_dir, prompts, work, snap)
                    if "error" not in rec:
                        rec["summary"] = summary(rec)
                        done[engine, model, dtype] = rec
                        ref = done.get(("jaxkv", model, dtype))
                        if engine != "jaxkv" and ref is not None:
                            rec["agreement_vs_jaxkv"] = agreement(rec, ref)
                        fp32 = done.get(("jaxkv", model, "float32"))
                        if dtype != "float32" and fp32 is not None:
                            # how far each engine's bf16 greedy path follows the fp32 one
                            rec["agreement_vs_jaxkv_float32"] = agreement(rec, fp32)
                    else:
                        rec["error_summary"] = (rec["error_lines"][-1][:300] if rec["error_lines"]
                                                else rec["error"])
                    result["runs"].append(rec)
                    write(result, a.out)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    result["wall_s"] = round(time.time() - t_start)
    result["load_end"] = loadavg()
    print(write(result, a.out))


def write(result: dict, out: str) -> str:
    """Writes ``result`` without its token lists (those of the first jaxkv and vLLM requests of
    each model/dtype are kept, first 16 tokens) and returns the table."""
    res = json.loads(json.dumps(result))
    for rec in res["runs"]:
        rec.pop("job", None)                    # its prompts: the workload's seed names them
        for k in ("batch_outputs", "single_outputs"):
            if k in rec:
                rec[k] = [o[:16] for o in rec[k][:1]]
    table = markdown(res)
    res["markdown"] = table
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    Path(out).with_suffix(".md").write_text(report(res))
    return table


def report(res: dict) -> str:
    """The markdown page beside the JSON: command, machine, workload, the table, the waits."""
    w, m = res["workload"], res["machine"]
    lines = ["# Architectures on CPU against vLLM: Qwen3-style and Gemma 3-style tiny models", "",
             f"`{res['command']}` (jaxkv {res['jaxkv_commit'][:7]}, {m['cpu']}, "
             f"{m['cores']} cores; {res['started']} – {res.get('finished', 'unfinished')}"
             + (f", {res['wall_s'] / 60:.0f} min" if "wall_s" in res else "") + ")", "",
             (f"{w['prompts']} prompts × {w['prompt_len']} token ids ({w['ids']}), "
             f"{w['output_len']} greedy output tokens each (ignore_eos); limits {res['limits']}; "
             f"vLLM {res['vllm']['mode']}, VLLM_CPU_OMP_THREADS_BIND={res['vllm']['threads_bind']}"
             "; jaxkv: XLA on both cores. Median (min–max) of the repeats; single decode = "
             f"{w['output_len'] - 1} / (t({w['output_len']} tokens) − t(1 token)). Load: 1-min "
             "average before/after each timed run (the engine's own load included)."), "",
             res["markdown"], "", ("| process | jaxkv commit | started | waited for load < "
                                   "threshold (s) | load then (1/5/15 min) |"),
             "|---|---|---|---|---|"]
    for rec in res["runs"]:
        q = rec["quiet_wait"]
        lines.append(f"| {rec['engine']}-{rec['model']}-{rec['dtype']} | "
                     f"{rec.get('jaxkv_commit', '?')[:7]} | {rec.get('date', '?')} | "
                     f"{q['waited_s']} | "
                     + " / ".join(f"{x:.2f}" for x in q["load_then"]) + " |")
    if "history" in res:
        lines += ["", res["history"]]
    for rec in res["runs"]:
        if "error" in rec:
            lines += ["", f"{rec['engine']}-{rec['model']}-{rec['dtype']} failed:", "", "```",
                      *rec["error_lines"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_worker":
        worker_main(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "--report":     # the .md of a finished JSON
        Path(sys.argv[2]).with_suffix(".md").write_text(
            report(json.loads(Path(sys.argv[2]).read_text())))
    else:
        main()
