"""Side by side: jaxkv against vLLM (CPU build) and llama.cpp on the same requests (issue 16).

One command runs the same token-id workloads through each engine configuration, one after
another (never two at once), each in its own subprocess: jaxkv from this repository
(``jaxkv.LLM``, fp32, a ``git archive`` snapshot of HEAD's ``jaxkv/`` so edits to the work tree
during the run do not leak in), vLLM from its own venv's python (``vllm.LLM``, fp32 and bf16, 1
and 2 threads through ``VLLM_CPU_OMP_THREADS_BIND``) and llama.cpp through llama-cpp-python's
low-level API (1 and 2 threads; the Q4_1 GGUF jaxkv loads, with llama.cpp's default f16 KV
cache; optionally an F32 GGUF with an f32 KV cache).

Every engine gets the same limits: 512 tokens per step, 256 sequences, max length 1024, a
65,536-token KV pool (jaxkv: 4,096 16-token blocks + the null block; vLLM:
``kv_cache_memory_bytes`` = 65,536 tokens × its bytes per token; llama.cpp: ``n_ctx`` 65,536 with
one unified KV buffer for all sequences). Greedy, ``ignore_eos``: every request generates exactly
its output length, so every engine produces the same number of tokens. Prefix caching stays on
(each engine's default) and is reset before every repeat (jaxkv and vLLM ``reset_prefix_cache``;
llama.cpp's KV is cleared, it has no cross-request cache in this loop), so no repeat hits the
previous one's prompts.

llama.cpp gets a small continuous-batching loop of its own (llama-cpp-python has none): each step
feeds one token per decoding sequence, then prompt chunks of waiting sequences up to the same
512-token budget and 256 sequences, in one multi-sequence ``llama_decode``; argmax over the
returned logits on the host.

Workloads (prompts cut from the Austen novel by ``bench/throughput.py``'s generator, token ids
sent to every engine):

* ``A``: 8 requests, prompts 32–64 tokens, outputs 16–32 (seed 0: 199 output tokens);
* ``B``: 8 requests, prompts 32–512, outputs 16–64 (340 output tokens);
* ``T``: bench/throughput.py's 128 requests, prompts 32–512, outputs 16–256 (18,395 tokens);
* ``L``: 64 requests of 512 prompt tokens and 128 output tokens each;
* ``S``: batch-1 decode: 1 request, prompt 32–64 tokens, 200 output tokens;
* ``S8``: batch-8 decode: 8 requests, prompts 32–64, 200 output tokens each.

``jaxkv-f32`` is jaxkv with the GGUF's weights dequantized to fp32 (``quantization="none"``):
its greedy agreement with ``jaxkv`` checks that keeping the blocks changes no token.

llama.cpp runs with ``OMP_WAIT_POLICY=PASSIVE`` (``--llama-omp-wait-policy``): its OpenMP threads
spin by default, and with anything else on the two cores a 2-thread run collapses (one 512-token
step took 4.3 s at load 3.6; passive: 49 tok/s on A).

Measured per run: output tokens / wall time of the whole workload (prefill included), from the
first request added to the last token; median and min–max over the repeats. Start-up (process
spawn → model loaded, compiled and one warm-up request done) is reported separately and never
counted in tok/s. The load average (``/proc/loadavg``) is recorded before and after each engine
process and each run. Greedy outputs of every engine are compared with jaxkv's, token by token:
identical requests, and the share of tokens before each request's first differing token.

``--interleave`` keeps every engine's process alive and alternates them run by run (repeat r of
a workload on each engine in turn, the order reversed on odd r, each run after the others have
gone quiet), so both sides of a ratio share the machine's window; it adds the ratios paired by
repeat and the idle engines' CPU seconds during each run.

    python3 bench/peers.py                      # everything, writes bench/results/peers.json
    python3 bench/peers.py --quick              # A only, 1 repeat, jaxkv + vLLM fp32 1t + llama.cpp 1t
    python3 bench/peers.py --engines jaxkv,vllm-fp32-t2 --workloads A,B --repeats 3
    python3 bench/peers.py --engines jaxkv,vllm-fp32-t2 --workloads A,T,L --interleave

Set-up of the vLLM venv, the HF directory and llama-cpp-python: shared/notes/peers-cpu.md;
``python3 bench/peers_setup.py`` does the first two.
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
AUSTEN_BOOK = "pride_and_prejudice"
GGUF = REPO / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
KV_TOKENS = 65_536
LIMITS = dict(max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=256)
KV_BYTES_PER_TOKEN_ELEM = 30 * 3 * 64 * 2          # layers * kv heads * head_dim * (K, V)

# name: (num_prompts, seed, min_prompt, max_prompt, min_out, max_out)
WORKLOADS = {
    "A": (8, 0, 32, 64, 16, 32),
    "B": (8, 0, 32, 512, 16, 64),
    "T": (128, 0, 32, 512, 16, 256),
    "L": (64, 0, 512, 512, 128, 128),
    "S": (1, 0, 32, 64, 200, 200),
    "S8": (8, 0, 32, 64, 200, 200),
}
BIG = ("T", "L")

ENGINES = {
    "jaxkv": dict(kind="jaxkv", precision="Q4_1/Q8_0 weights kept, fp32 KV", threads="XLA (2 cores)"),
    "jaxkv-f32": dict(kind="jaxkv", precision="weights dequantized to fp32 (quantization='none')",
                      threads="XLA (2 cores)", quantization="none"),
    "vllm-fp32-t1": dict(kind="vllm", precision="fp32", dtype="float32", threads=1),
    "vllm-fp32-t2": dict(kind="vllm", precision="fp32", dtype="float32", threads=2),
    "vllm-bf16-t1": dict(kind="vllm", precision="bf16", dtype="bfloat16", threads=1),
    "vllm-bf16-t2": dict(kind="vllm", precision="bf16", dtype="bfloat16", threads=2),
    "llama-q4_1-t1": dict(kind="llama", precision="Q4_1 weights, f16 KV", threads=1),
    "llama-q4_1-t2": dict(kind="llama", precision="Q4_1 weights, f16 KV", threads=2),
    "llama-f32-t1": dict(kind="llama", precision="fp32", threads=1, f32=True),
    "llama-f32-t2": dict(kind="llama", precision="fp32", threads=2, f32=True),
}
DEFAULT_ENGINES = [e for e in ENGINES if not e.startswith(("llama-f32", "jaxkv-f32"))]

def git(*a) -> str:
    return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


# ---------------------------------------------------------------------- workers (subprocesses)


def timed_run(job, name: str, r: int, generate, reset) -> tuple[dict, list]:
    """Repeat ``r`` of workload ``name`` of ``job`` through ``generate(prompts, olens,
    deadline)`` (returns token lists; an engine that honours ``deadline`` stops there and returns
    what it has), after ``reset()``: the run's timing and load, and the outputs. A run cut off by
    the deadline is marked ``incomplete`` (its tok/s counts the tokens it made)."""
    w = job["workloads"][name]
    reset()
    before = loadavg()
    t = time.perf_counter()
    outs = generate(w["prompts"], w["olens"], time.perf_counter() + job["run_timeout"])
    elapsed = time.perf_counter() - t
    n_out = sum(map(len, outs))
    incomplete = n_out != sum(w["olens"])
    assert not incomplete or elapsed >= job["run_timeout"], (name, n_out)
    log(f"  {job['engine']} {name} repeat {r}: {n_out / elapsed:.1f} out tok/s "
        f"({elapsed:.1f} s{', CUT OFF at the run timeout' if incomplete else ''})")
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tokens_per_s": n_out / elapsed,
            "incomplete": incomplete, "load_before": before, "load_after": loadavg()}, outs


def add_run(res: dict, run: dict, outs: list) -> None:
    """Appends ``run`` to one workload's record ``res`` (``runs``, ``outputs`` of the first
    repeat, ``incomplete``), marking whether its outputs equal the first repeat's."""
    res.setdefault("outputs", outs)
    run["outputs_equal_first_repeat"] = outs == res["outputs"]
    res.setdefault("runs", []).append(run)
    res["incomplete"] = res.get("incomplete", False) or run["incomplete"]


def timed_runs(job, generate, reset) -> dict:
    """Every workload of ``job``, ``repeats`` times each (``timed_run``); a cut-off run ends
    that workload's repeats."""
    results = {}
    for name, w in job["workloads"].items():
        results[name] = {}
        for r in range(w["repeats"]):
            add_run(results[name], *timed_run(job, name, r, generate, reset))
            if results[name]["incomplete"]:
                break
    return results


def warm_request(generate) -> None:
    """One small untimed request batch after start-up (lazy compiles, allocator, threads)."""
    text_ids = list(range(1000, 1040))
    generate([text_ids[:24], text_ids[5:40]], [8, 8], float("inf"))


def jaxkv_worker(job) -> dict:
    from jaxkv import LLM, SamplingParams

    llm = LLM(str(GGUF), dtype="float32", seed=0, num_kv_blocks=job["kv_tokens"] // 16 + 1,
              quantization=job["config"].get("quantization"), **LIMITS)
    t = time.perf_counter()
    compiled = llm.warmup()
    compile_s = time.perf_counter() - t

    def generate(prompts, olens, deadline):
        ids = [llm.add_request({"prompt_token_ids": p},
                               SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
               for p, o in zip(prompts, olens)]
        outs = {i: [] for i in ids}
        while llm.has_unfinished_requests():
            if time.perf_counter() > deadline:
                for i in ids:
                    if llm.engine.is_live(i):
                        llm.engine.abort_request(i)
                break
            for o in llm.step():
                outs[o.request_id] = list(o.outputs[0].token_ids)
        return [outs[i] for i in ids]

    info = {"warmup_compile_s": compile_s, "step_variants_compiled": compiled,
            "compilation_cache_dir": str(llm.engine.compilation_cache_dir)}
    return (generate, llm.reset_prefix_cache, info,
            lambda: {"compilations_after_runs": llm.num_compilations()})


def vllm_worker(job) -> dict:
    cfg = job["config"]
    elem = 4 if cfg["dtype"] == "float32" else 2
    llm, vllm_generate, info = vllm_llm(
        job["hf_model"], cfg["dtype"], job["kv_tokens"] * KV_BYTES_PER_TOKEN_ELEM * elem,
        job["vllm_eager"], LIMITS)

    def generate(prompts, olens, deadline):       # vLLM: no cut-off (it is the fast one)
        return vllm_generate(prompts, olens)

    info["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    return generate, llm.reset_prefix_cache, info, dict


def llama_worker(job) -> dict:
    import ctypes
    from collections import deque

    import llama_cpp as L
    import numpy as np

    cfg = job["config"]
    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda *a: None)      # kept alive: llama.cpp calls it later
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    model = L.llama_model_load_from_file(job["gguf"].encode(), L.llama_model_default_params())
    assert model, job["gguf"]
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx = job["kv_tokens"]
    cp.n_batch = cp.n_ubatch = LIMITS["max_num_batched_tokens"]
    split = job["llama_kv"] == "split"
    # unified: one 65,536-token buffer shared by all 256 sequences (attention of every token
    # then spans every used cell of the buffer, masked); split: one 1,024-token stream per
    # sequence, so 64 sequences fill the same 65,536 tokens
    cp.n_seq_max = job["kv_tokens"] // LIMITS["max_model_len"] if split else LIMITS["max_num_seqs"]
    cp.n_threads = cp.n_threads_batch = cfg["threads"]
    cp.kv_unified = not split
    cp.no_perf = True
    if cfg.get("f32"):
        cp.type_k = cp.type_v = L.GGML_TYPE_F32
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "llama_init_from_model failed"
    mem = L.llama_get_memory(ctx)
    budget, max_seqs = LIMITS["max_num_batched_tokens"], cp.n_seq_max
    batch = L.llama_batch_init(budget, 0, 1)

    def generate(prompts, olens, deadline):
        outs = [[] for _ in prompts]
        fed = [0] * len(prompts)                  # prompt tokens already in the KV
        waiting, running = deque(range(len(prompts))), []
        free = list(range(max_seqs - 1, -1, -1))
        slot, reserved = {}, 0
        while (waiting or running) and time.perf_counter() < deadline:
            rows = []                                             # (request, token, pos, logits)
            for i in running:                                     # decodes first
                if fed[i] == len(prompts[i]):
                    rows.append((i, outs[i][-1], len(prompts[i]) + len(outs[i]) - 1, True))
            for i in running:                                     # then unfinished prompts
                if len(rows) >= budget:
                    break
                if fed[i] < len(prompts[i]):
                    n = min(budget - len(rows), len(prompts[i]) - fed[i])
                    rows += [(i, prompts[i][fed[i] + k], fed[i] + k,
                              fed[i] + k == len(prompts[i]) - 1) for k in range(n)]
                    fed[i] += n
            while (waiting and len(rows) < budget and free and
                   reserved + len(prompts[waiting[0]]) + olens[waiting[0]] <= job["kv_tokens"]):
                i = waiting.popleft()
                slot[i] = free.pop()
                reserved += len(prompts[i]) + olens[i]
                running.append(i)
                n = min(budget - len(rows), len(prompts[i]))
                rows += [(i, prompts[i][k], k, k == len(prompts[i]) - 1) for k in range(n)]
                fed[i] = n
            batch.n_tokens = len(rows)
            for j, (i, tok, pos, want) in enumerate(rows):
                batch.token[j], batch.pos[j] = tok, pos
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = slot[i]
                batch.logits[j] = want
            rc = L.llama_decode(ctx, batch)
            assert rc == 0, f"llama_decode returned {rc}"
            for j, (i, _, _, want) in enumerate(rows):
                if want:
                    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, j),
                                                   shape=(n_vocab,))
                    outs[i].append(int(logits.argmax()))
            for i in [i for i in running if len(outs[i]) == olens[i]]:
                running.remove(i)
                L.llama_memory_seq_rm(mem, slot[i], -1, -1)
                free.append(slot.pop(i))
                reserved -= len(prompts[i]) + olens[i]
        return outs

    def reset():                                  # also drops what a cut-off run left
        L.llama_memory_clear(mem, True)

    info = {"llama_cpp_python": L.__version__, "gguf": job["gguf"], "n_ctx": cp.n_ctx,
            "n_threads": cfg["threads"], "n_seq_max": cp.n_seq_max, "kv": job["llama_kv"],
            "kv_type": "f32" if cfg.get("f32") else "f16 (default)",
            "system_info": L.llama_print_system_info().decode()}
    return generate, reset, info, dict


def worker_main(job_file: str, out_file: str) -> None:
    """One engine's process: start it (``*_worker`` returns ``generate``, ``reset``, its
    ``info`` and a callable for what to add to the info at the end), one warm request, then
    either every run of the job (written to ``out_file``), or, with ``job["interleave"]``, the
    runs the parent asks for one by one: JSON lines on stdin (``{"workload", "repeat"}``, then
    ``{"quit": true}``), answered on the process's original stdout (``{"ready"}``, each run
    with its outputs, the final info); the engine's own prints go to stderr (the log)."""
    job = json.loads(Path(job_file).read_text())
    proto = None
    if job["interleave"]:
        proto = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
    kind = ENGINES[job["engine"]]["kind"]
    generate, reset, info, after = {"jaxkv": jaxkv_worker, "vllm": vllm_worker,
                                    "llama": llama_worker}[kind](job)
    warm_request(generate)
    startup_s = time.time() - job["spawn_time"]
    if proto is None:
        res = {"workloads": timed_runs(job, generate, reset)}
        Path(out_file).write_text(json.dumps(dict(res, info=dict(info, **after()),
                                                  startup_s=startup_s)))
        return
    proto.write(json.dumps({"ready": True, "startup_s": startup_s}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        run, outs = timed_run(job, cmd["workload"], cmd["repeat"], generate, reset)
        proto.write(json.dumps({"run": run, "outputs": outs}) + "\n")
    proto.write(json.dumps({"info": dict(info, **after())}) + "\n")


# ---------------------------------------------------------------------- the parent


def make_workloads(names: list[str]) -> dict:
    # imported here: the peers' workers import this module with only their own venv's paths
    from jaxkv.data import austen
    from jaxkv.model.gguf import open_gguf
    from jaxkv.model.tokenizer import Tokenizer
    import numpy as np

    tok = Tokenizer.from_gguf_metadata(open_gguf(GGUF))
    ids = tok.encode(austen(AUSTEN_BOOK))
    out = {}
    for name in names:
        n, seed, pmin, pmax, omin, omax = WORKLOADS[name]
        # bench/throughput.py's generator (same draws, same order)
        rng = np.random.default_rng(seed)
        plens = rng.integers(pmin, pmax + 1, size=n)
        starts = rng.integers(0, len(ids) - pmax, size=n)
        olens = rng.integers(omin, omax + 1, size=n)
        out[name] = {"prompts": [[int(t) for t in ids[s:s + p]] for s, p in zip(starts, plens)],
                     "olens": [int(o) for o in olens]}
    return out


def jaxkv_snapshot(work: Path) -> Path:
    """HEAD's ``jaxkv/`` extracted under ``work`` (``models/`` linked to the repo's)."""
    snap = work / "jaxkv-src"
    snap.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "HEAD", "jaxkv"], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(snap)], input=archive, check=True)
    return snap


def engine_job(a, engine: str, workloads: dict, work: Path, snap: Path) -> tuple:
    """Writes ``engine``'s job file under ``work``: the worker's command line, environment and
    log path."""
    cfg = ENGINES[engine]
    job = {"engine": engine, "config": cfg, "hf_model": a.hf_model, "vllm_eager": a.vllm_eager,
           "run_timeout": a.run_timeout, "llama_kv": a.llama_kv, "kv_tokens": a.kv_tokens,
           "gguf": a.llama_f32_gguf if cfg.get("f32") else str(GGUF), "workloads": {},
           "interleave": a.interleave}
    for name, w in workloads.items():
        job["workloads"][name] = dict(w, repeats=repeats(a, name))
    env = peer_env(a.peer_cache)
    if cfg["kind"] == "jaxkv":
        python = sys.executable
        env["PYTHONPATH"] = str(snap)
    elif cfg["kind"] == "vllm":
        python = a.vllm_python
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if cfg["threads"] == 1 else f"0-{cfg['threads'] - 1}"
        env.pop("PYTHONPATH", None)
    else:
        python = a.llama_python
        env.pop("PYTHONPATH", None)
        if a.llama_omp_wait_policy:
            env["OMP_WAIT_POLICY"] = a.llama_omp_wait_policy
    jf, of, lf = work / f"{engine}.job.json", work / f"{engine}.out.json", work / f"{engine}.log"
    job["spawn_time"] = time.time()
    jf.write_text(json.dumps(job))
    log(f"{engine}: starting ({python})")
    cmd = [python, str(Path(__file__).resolve()), "--_worker", str(jf), str(of)]
    return cmd, env, lf, of


def repeats(a, workload: str) -> int:
    return a.big_repeats if workload in BIG else a.repeats


def engine_record(cfg: dict, python: str, env: dict, log_file: Path, before, res: dict) -> dict:
    """An engine's entry in the result: its worker's ``res`` with the configuration, the load
    before and after its process, and the interesting lines of its log."""
    res.update(config=cfg, load_before=before, load_after=loadavg(), python=python,
               env={k: v for k, v in env.items() if k.startswith(("VLLM_CPU", "OMP_", "XLA"))},
               log_tail=[l[:300] for l in log_file.read_text().splitlines()
                         if any(w in l for w in ("KV cache", "core ids", "OMP", "Compilation",
                                                 "WARNING", "Error"))][-10:])
    return res


def engine_error(cfg: dict, rc, log_file: Path, before) -> dict:
    tail = log_file.read_text().splitlines()[-25:]
    return {"error": f"exit {rc}", "log_tail": tail, "load_before": before,
            "load_after": loadavg(), "config": cfg}


def run_engine(a, engine: str, workloads: dict, work: Path, snap: Path) -> dict:
    """Every run of ``engine`` in one worker process, started and ended here."""
    cmd, env, lf, of = engine_job(a, engine, workloads, work, snap)
    before = loadavg()
    with open(lf, "w") as logf:
        rc = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not of.exists():
        log(f"{engine}: FAILED (exit {rc}); last lines of its log:\n" +
            "\n".join(lf.read_text().splitlines()[-25:]))
        return engine_error(ENGINES[engine], rc, lf, before)
    for line in lf.read_text().splitlines():
        if " repeat " in line:
            print(line, file=sys.stderr)
    res = engine_record(ENGINES[engine], cmd[0], env, lf, before, json.loads(of.read_text()))
    log(f"{engine}: done, start-up {res['startup_s']:.1f} s")
    return res


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants."""
    children, cpu = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:                              # gone meanwhile
            continue
        children.setdefault(int(f[1]), []).append(int(d.name))
        cpu[int(d.name)] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo += children.get(p, [])
    return total


def settle(pids: list[int], quiet_s: float = 0.02, every_s: float = 0.25,
           limit_s: float = 10.0) -> float:
    """Waits until the process trees of ``pids`` use less than ``quiet_s`` CPU seconds per
    ``every_s`` (an engine that just finished a run may still spin its OpenMP threads or tidy
    up), at most ``limit_s``; returns the seconds waited."""
    t = time.perf_counter()
    last = sum(map(tree_cpu_s, pids))
    while time.perf_counter() - t < limit_s:
        time.sleep(every_s)
        now = sum(map(tree_cpu_s, pids))
        if now - last < quiet_s:
            break
        last = now
    return time.perf_counter() - t


class Worker:
    """One engine's worker process kept alive between runs (``--interleave``): it starts the
    engine and answers one JSON line per request (``ask``)."""

    def __init__(self, a, engine: str, workloads: dict, work: Path, snap: Path):
        self.engine, self.cfg = engine, ENGINES[engine]
        self.cmd, self.env, self.log_file, _ = engine_job(a, engine, workloads, work, snap)
        self.before = loadavg()
        self.logf = open(self.log_file, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.logf, text=True)

    def ask(self, cmd: dict | None = None) -> dict | None:
        """Sends ``cmd`` (none: just read) and returns the worker's answer; None if it died."""
        try:
            if cmd is not None:
                self.proc.stdin.write(json.dumps(cmd) + "\n")
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        return json.loads(line) if line else None

    def close(self) -> int:
        self.proc.stdin.close()
        rc = self.proc.wait()
        self.logf.close()
        return rc


def run_interleaved(a, engines: list, workloads: dict, work: Path, snap: Path,
                    result: dict) -> None:
    """``--interleave``: every engine started (one after another, each alone), then each
    workload's repeat ``r`` run by every engine in turn, in the list's order for even ``r`` and
    reversed for odd (A B, B A, ...), so that each pair of runs shares one window of the
    machine's drift. Before each run every engine is left to go quiet (``settle``), and the
    idle engines' CPU seconds during the run are recorded. Fills ``result["engines"]``."""
    live = {}
    for e in engines:
        w = Worker(a, e, workloads, work, snap)
        ready = w.ask()
        if ready is None:
            rc = w.close()
            log(f"{e}: FAILED at start-up (exit {rc}); last lines of its log:\n" +
                "\n".join(w.log_file.read_text().splitlines()[-25:]))
            result["engines"][e] = engine_error(w.cfg, rc, w.log_file, w.before)
            continue
        live[e] = w
        result["engines"][e] = {"startup_s": ready["startup_s"], "workloads": {},
                                "config": w.cfg, "load_before": w.before,
                                "load_after": loadavg()}
        log(f"{e}: ready, start-up {ready['startup_s']:.1f} s")
    for name in workloads:
        for r in range(repeats(a, name)):
            order = engines if r % 2 == 0 else engines[::-1]
            for e in order:
                if e not in live:
                    continue
                rec = result["engines"][e]["workloads"].setdefault(name, {})
                if rec.get("incomplete"):                  # cut off: its repeats end there
                    continue
                waited = settle([w.proc.pid for w in live.values()])
                idle = {o: tree_cpu_s(w.proc.pid) for o, w in live.items() if o != e}
                answer = live[e].ask({"workload": name, "repeat": r})
                if answer is None:
                    w = live.pop(e)
                    rc = w.close()
                    log(f"{e}: FAILED in {name} repeat {r} (exit {rc})")
                    result["engines"][e] = engine_error(w.cfg, rc, w.log_file, w.before)
                    continue
                run = dict(answer["run"], round=r, order=order.index(e), settle_s=waited)
                run["idle_engines_cpu_s"] = {o: round(tree_cpu_s(live[o].proc.pid) - c, 2)
                                             for o, c in idle.items()}
                add_run(rec, run, answer["outputs"])
                log(f"  {e} {name} repeat {r}: {run['output_tokens_per_s']:.1f} out tok/s "
                    f"({run['elapsed_s']:.1f} s; idle engines' CPU {run['idle_engines_cpu_s']})")
            finish(result, a.out, final=False)     # what is done so far survives a kill
    for e, w in live.items():
        end = w.ask({"quit": True})
        rc = w.close()
        rec = result["engines"][e]
        rec["info"] = end["info"] if end else {}
        if end is None or rc != 0:                 # its runs above stand
            rec["shutdown"] = f"exit {rc}"
            log(f"{e}: exit {rc} at shutdown")
        engine_record(w.cfg, w.cmd[0], w.env, w.log_file, w.before, rec)


def agreement(outs, ref) -> dict:
    same = sum(x == y for x, y in zip(outs, ref))
    prefix = 0
    for x, y in zip(outs, ref):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix += k
    total = sum(map(len, ref))
    return {"identical_requests": same, "requests": len(ref),
            "tokens_before_first_difference": prefix, "tokens": total,
            "identical_requests_pct": 100 * same / len(ref), "identical_tokens_pct":
            100 * prefix / total}


def summarize(result: dict) -> str:
    engines, wls = result["engines"], result["workload_names"]
    lines = ["| engine | precision | threads | start-up s | " +
             " | ".join(f"{w} out tok/s" for w in wls) + " | load before→after |",
             "|---|---|---|---|" + "---|" * len(wls) + "---|"]
    for name, e in engines.items():
        if "error" in e:
            lines.append(f"| {name} | failed: {e['error']} |")
            continue
        cells = []
        for w in wls:
            if w not in e["workloads"]:
                cells.append("–")
                continue
            r = e["workloads"][w]["summary"]
            cut = " (cut off at the run timeout)" if e["workloads"][w]["incomplete"] else ""
            cells.append(f"{r['median']:.1f} ({r['min']:.1f}–{r['max']:.1f}, n={r['n']}){cut}")
        lines.append(f"| {name} | {e['config']['precision']} | {e['config']['threads']} | "
                     f"{e['startup_s']:.1f} | " + " | ".join(cells) +
                     f" | {e['load_before'][0]:.2f}→{e['load_after'][0]:.2f} |")
    lines += ["", "Greedy agreement with jaxkv (identical requests; tokens before the first "
              "difference):", "",
              "| engine | " + " | ".join(wls) + " |", "|---|" + "---|" * len(wls)]
    for name, e in engines.items():
        if "error" in e or name == "jaxkv":
            continue
        cells = []
        for w in wls:
            g = e["workloads"].get(w, {}).get("agreement_vs_jaxkv")
            cells.append("–" if g is None else
                         f"{g['identical_requests']}/{g['requests']} req, "
                         f"{g['identical_tokens_pct']:.1f}% tok")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for w, r in result["ratios"].items():
        if "fp32" in r:
            v = r["fp32"]
            paired = v.get("paired")
            lines.append(f"{w}: jaxkv / vLLM best = {v['ratio']:.2f} (fp32 vs fp32: best "
                         f"{v['best']}, {v['best_tok_s']:.1f} tok/s)" + (
                             f"; paired by repeat: {paired['median']:.2f} "
                             f"({paired['min']:.2f}–{paired['max']:.2f}, n={paired['n']})"
                             if paired else ""))
        if "bf16" in r:
            v = r["bf16"]
            lines.append(f"{w}: jaxkv fp32 / vLLM bf16 best = {v['ratio']:.2f} (not the same "
                         f"precision class: {v['best']}, {v['best_tok_s']:.1f} tok/s)")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default=None,
                    help=f"comma list of {', '.join(ENGINES)} (default: all but llama-f32-* "
                         "and jaxkv-f32)")
    ap.add_argument("--workloads", default=None,
                    help="comma list of A,B,T,L,S,S8 (default: A,B,T,L)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of A, B, S and S8")
    ap.add_argument("--big-repeats", type=int, default=3, help="repeats of T and L")
    ap.add_argument("--quick", action="store_true",
                    help="1 repeat; default engines jaxkv,vllm-fp32-t1,llama-q4_1-t1, workload A")
    ap.add_argument("--run-timeout", type=float, default=600,
                    help="jaxkv and llama.cpp stop a run after this many seconds and report "
                         "it as incomplete (llama.cpp on 2 threads collapses under load)")
    ap.add_argument("--kv-tokens", type=int, default=KV_TOKENS,
                    help="every engine's KV pool in tokens (a smaller pool when the machine's "
                         "memory is taken by other work: jaxkv refuses a pool that does not fit)")
    ap.add_argument("--vllm-venv", default="/work/peers/vllm-venv")
    ap.add_argument("--llama-venv", default="/work/peers/llama-venv")
    ap.add_argument("--hf-model", default="/work/peers/SmolLM2-135M-Instruct-hf")
    ap.add_argument("--llama-f32-gguf", default="/work/peers/SmolLM2-135M-Instruct-f32.gguf",
                    help="F32 GGUF for the llama-f32-* engines")
    ap.add_argument("--vllm-eager", action="store_true",
                    help="enforce_eager=True (default: vLLM's own default, torch.compile)")
    ap.add_argument("--llama-omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY for llama.cpp ('' keeps the default, spinning): with "
                         "other load on the cores, spinning OpenMP threads make its 2-thread "
                         "runs collapse (0.2 vs 49 tok/s measured at load 3.5)")
    ap.add_argument("--llama-kv", choices=("unified", "split"), default="unified",
                    help="llama.cpp KV: split: 64 sequences x 1,024 tokens; unified (default): "
                         "one 65,536-token buffer for 256 sequences (every token's attention then "
                         "spans the whole used buffer: 7 tok/s on T)")
    ap.add_argument("--peer-cache", default="/work/peers/cache")
    ap.add_argument("--interleave", action="store_true",
                    help="keep every engine's process alive and alternate them run by run "
                         "(repeat r of a workload on each engine in turn, the order reversed "
                         "every other repeat), so the machine's drift falls on both sides of "
                         "each ratio; also reports the per-repeat (paired) ratios")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "peers.json"))
    a = ap.parse_args()
    if a.quick:
        a.repeats = a.big_repeats = 1
        a.engines = a.engines or "jaxkv,vllm-fp32-t1,llama-q4_1-t1"
        a.workloads = a.workloads or "A"
    a.engines = a.engines or ",".join(DEFAULT_ENGINES)
    a.workloads = a.workloads or "A,B,T,L"
    a.vllm_python = str(Path(a.vllm_venv) / "bin" / "python")
    a.llama_python = str(Path(a.llama_venv) / "bin" / "python")
    engines = a.engines.split(",")
    wls = a.workloads.split(",")
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r}")
    for w in wls:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}")
    if "jaxkv" not in engines:
        log("jaxkv not selected: no agreement columns, no ratios")

    workloads = make_workloads(wls)
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "jaxkv")
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    mem = next(int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines()
               if l.startswith("MemTotal"))
    result = {
        "command": "python3 bench/peers.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**20, 1),
                    "node": platform.node()},
        "jaxkv_commit": commit, "jaxkv_worktree_dirty_ignored": bool(dirty),
        "limits": dict(LIMITS, kv_pool_tokens=a.kv_tokens),
        "prefix_cache": "on, reset before every repeat (llama.cpp: KV cleared)",
        "vllm_mode": "eager" if a.vllm_eager else "vLLM default (torch.compile)",
        "schedule": ("interleaved: all engines alive, repeat r of each workload on every engine "
                     "in turn, order reversed on odd r" if a.interleave else
                     "sequential: one engine process after another"),
        "workload_names": wls,
        "workloads": {w: {"spec": dict(zip(("num_prompts", "seed", "min_prompt", "max_prompt",
                                            "min_out", "max_out"), WORKLOADS[w])),
                          "prompt_tokens": sum(map(len, workloads[w]["prompts"])),
                          "output_tokens": sum(workloads[w]["olens"])} for w in wls},
        "load_start": loadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "engines": {},
    }
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        work = Path(tmp)
        snap = (jaxkv_snapshot(work) if any(ENGINES[e]["kind"] == "jaxkv" for e in engines)
                else None)
        if a.interleave:
            run_interleaved(a, engines, workloads, work, snap, result)
        else:
            for e in engines:
                result["engines"][e] = run_engine(a, e, workloads, work, snap)
                finish(result, a.out, final=False)     # what is done so far survives a kill
    result["load_end"] = loadavg()
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    table = finish(result, a.out, final=True)
    print(table)
    print(f"\nload: start {result['load_start']}, end {result['load_end']}; "
          f"jaxkv {commit[:10]}; written {a.out}")


def finish(raw: dict, out: str, final: bool) -> str:
    """Summaries, agreement with jaxkv and the ratios of ``raw`` (left as it is), written to
    ``out`` without the token lists; returns the markdown table."""
    result = json.loads(json.dumps(raw))
    result["complete"] = final
    ref = result["engines"].get("jaxkv")
    for name, e in result["engines"].items():
        if "error" in e:
            continue
        for w, r in e["workloads"].items():
            v = [x["output_tokens_per_s"] for x in r["runs"]]
            r["summary"] = {"median": statistics.median(v), "min": min(v), "max": max(v),
                            "n": len(v)}
            if (ref and "error" not in ref and name != "jaxkv" and not r["incomplete"]
                    and w in ref["workloads"] and not ref["workloads"][w]["incomplete"]):
                r["agreement_vs_jaxkv"] = agreement(r["outputs"], ref["workloads"][w]["outputs"])
    result["ratios"] = {}
    if ref and "error" not in ref:
        for w, jr in ref["workloads"].items():
            jx = jr["summary"]["median"]
            for cls in ("fp32", "bf16"):
                cands = {n: e["workloads"][w] for n, e in result["engines"].items()
                         if "error" not in e and e["config"]["kind"] == "vllm"
                         and e["config"]["precision"] == cls and w in e["workloads"]}
                if not cands:
                    continue
                best = max(cands, key=lambda n: cands[n]["summary"]["median"])
                v = cands[best]["summary"]["median"]
                ratio = result["ratios"].setdefault(w, {})[cls] = {
                    "ratio": jx / v, "best": best, "best_tok_s": v}
                pairs = [x["output_tokens_per_s"] / y["output_tokens_per_s"]
                         for x in jr["runs"] for y in cands[best]["runs"]
                         if "round" in x and x.get("round") == y.get("round")]
                if pairs:                          # --interleave: repeat r against repeat r
                    ratio["paired"] = {"median": statistics.median(pairs), "min": min(pairs),
                                       "max": max(pairs), "n": len(pairs)}
    for e in result["engines"].values():       # token lists: compared above, not stored
        for r in e.get("workloads", {}).values():
            r.pop("outputs", None)
    table = summarize(result)
    result["markdown"] = table
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    return table


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--_worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        main()
