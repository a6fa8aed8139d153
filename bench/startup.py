"""Cold and warm start-to-first-token of ``python3 -m jaxkv generate`` on the default model.

Each repeat gives JAX's persistent compilation cache (jaxkv/runner/compile_cache.py) a fresh, empty
directory through ``JAXKV_COMPILATION_CACHE_DIR`` and starts the command twice:

* cold: the first process, which compiles every executable and writes it to the directory;
* warm: a second process on the same directory, which loads them instead.

Start-to-first-token is the wall time from just before the process is spawned (so interpreter
start, imports, model load, pool allocation, compilation and the first step all count) to the
moment the first generated text reaches its stdout: the CLI's ``### '<prompt>'`` line, which it
prints once the request has its token (``--max-tokens 1``: the first token is the only one).
Also recorded per run: the process's exit time, the TTFT the CLI prints (request arrival to
first token, inside the engine), the cache entries in the directory after the run (the cold run's
count is the number of executables compiled; a warm run that adds none compiled nothing) and the
1-minute load average before the run. The model file stays in the page cache between runs:
"cold" means a cold compilation cache, not a cold disk. The model is fetched before the first
repeat so no run includes a download.

    python3 bench/startup.py --repeats 3 --out bench/results/startup.json
    python3 bench/startup.py -- generate --prompt hi --max-tokens 1 --max-num-seqs 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from jaxkv.model import store
from jaxkv.runner.compile_cache import ENV_VAR

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ARGS = ["generate", "--prompt", "hi", "--max-tokens", "1"]
FIRST_TOKEN_LINE = re.compile(r"^### ")
CLI_TTFT = re.compile(r"TTFT ([\d.]+)s")


def run_once(args: list[str], cache_dir: Path) -> dict:
    """Starts ``python3 -m jaxkv <args>`` on ``cache_dir``; its timings (seconds from spawn)."""
    env = {**os.environ, ENV_VAR: str(cache_dir), "PYTHONUNBUFFERED": "1"}
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "jaxkv", *args], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        first_token, out = None, []
        for line in proc.stdout:
            if first_token is None and FIRST_TOKEN_LINE.match(line):
                first_token = time.perf_counter() - start
            out.append(line)
        rc = proc.wait()
        exit_s = time.perf_counter() - start
        err.seek(0)
        stderr = err.read()
    text = "".join(out)
    if rc != 0 or first_token is None:
        raise RuntimeError(f"`jaxkv {' '.join(args)}` exited {rc} "
                           f"{'' if first_token else 'without printing a first token '}"
                           f"after {exit_s:.1f}s:\n{stderr[-3000:]}\n{text[-2000:]}")
    ttft = CLI_TTFT.search(text)
    return dict(first_token_s=round(first_token, 3), exit_s=round(exit_s, 3),
                cli_ttft_s=float(ttft[1]) if ttft else None,
                cache_entries=len(list(cache_dir.iterdir())), loadavg_1min_before=load)


def summarize(values: list[float]) -> dict:
    """Median and spread of one kind's start-to-first-token times."""
    return dict(median_s=round(statistics.median(values), 3), min_s=min(values),
                max_s=max(values), values_s=values)


def git_commit() -> str:
    """``git describe --always --dirty`` of the repository ("" outside a git checkout)."""
    return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "startup.json"))
    p.add_argument("jaxkv_args", nargs=argparse.REMAINDER,
                   help="after --: the jaxkv command (default: %s)" % " ".join(DEFAULT_ARGS))
    a = p.parse_args(argv)
    args = [x for x in a.jaxkv_args if x != "--"] or DEFAULT_ARGS
    store.fetch(store.DEFAULT_MODEL)
    runs = []
    for r in range(a.repeats):
        with tempfile.TemporaryDirectory(prefix="jaxkv-startup-") as cache_dir:
            for kind in ("cold", "warm"):
                run = dict(kind=kind, repeat=r, **run_once(args, Path(cache_dir)))
                print(json.dumps(run), file=sys.stderr)
                runs.append(run)
    times = {k: [x["first_token_s"] for x in runs if x["kind"] == k] for k in ("cold", "warm")}
    result = dict(
        command=["python3", "-m", "jaxkv", *args], repeats=a.repeats,
        summary={k: summarize(v) for k, v in times.items()},
        compilations_cold=[x["cache_entries"] for x in runs if x["kind"] == "cold"],
        new_entries_warm=[w["cache_entries"] - c["cache_entries"]
                          for c, w in zip(runs[::2], runs[1::2])],
        runs=runs,
        machine=dict(platform=platform.platform(), cpus=os.cpu_count(),
                     python=platform.python_version(), jax=jax.__version__,
                     backend=jax.default_backend()),
        commit=git_commit(), date=time.strftime("%Y-%m-%d %H:%M:%S %z"))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
