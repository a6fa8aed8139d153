"""What JSON-schema constraints cost (issue 54): 128 chat requests, 0%, 50% or 100% constrained.

One engine (or, with ``--peer vllm``, jaxkv and vLLM's CPU build), the same 128 chat requests
with 0%, 50% and 100% of them JSON-schema constrained, side by side in one run (alternating
rounds); the host time of filling the grammar bitmasks for a batch of 64 rows; grammar compile
time, cold and cached.

    python3 bench/structured_overhead.py [--model SmolLM2-135M-Instruct] [--rounds 2]
        [--out bench/results/structured_overhead.md]
    python3 bench/structured_overhead.py --head --peer vllm [--vllm-threads 1] [--vllm-eager]

Throughput is output tokens / wall second of ``LLM.chat`` over the 128 requests (temperature
0.7, seeded), each generating exactly the tokens its JSON took under the constraint (64 at
most), constrained or not, after one untimed pass of each mix that compiles the step's
variants. Prints a markdown table; ``--out`` writes it
with the command, the machine's load and the date.

``--peer vllm``: vLLM's offline ``vllm.LLM`` (its venv's python, a worker process kept alive;
bench/lib/vllm_peer.py) runs the same mixes: the same chat messages (its HF tokenizer's template
renders the same prompt token ids; the table says how many matched), the same schema through
``SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`` (its xgrammar backend),
the same seeds, the same limits (max length 1024, 64 sequences, 2048 tokens per step, a 2 GiB
fp32 KV pool as jaxkv's CPU default, prefix caching on in both; vLLM's chunked prefill off: its
CPU build dies on a seeded request whose prompt is split, VLLM_SCHEDULING). Its per-request
lengths are its own constrained pass's (vLLM's sampler draws other tokens from the same seed),
and ``min_tokens`` = ``max_tokens`` with ``ignore_eos`` make its unconstrained requests as long,
as jaxkv's are. Each mix runs on both engines in turn (the order alternating), after both have
gone quiet; the idle engine's CPU during the other's run is reported. vLLM computes on
``--vllm-threads`` cores (default 1, vLLM's own default: core 0 computes, its scheduler process,
which fills the grammar bitmasks, has core 1); jaxkv's XLA uses both. ``--head`` runs jaxkv from
a ``git archive`` of HEAD's jaxkv/ so that edits to the work tree during the run do not leak in.
The vLLM venv and HF directory: ``python3 bench/peers_setup.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.step_timing import loadavg, log  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FRACTIONS = (0.0, 0.5, 1.0)
LIMITS = dict(max_model_len=1024, max_num_seqs=64)      # both engines
VLLM_BATCHED_TOKENS = 2048                              # jaxkv's default max_num_batched_tokens
# vLLM 0.32's CPU build dies when a seeded request's prompt is split across steps ("CPU
# Generator does not use offset": it rewinds the discarded sample's generator by an offset CPU
# generators lack), so its prompts go whole into a step: no chunked prefill.
VLLM_SCHEDULING = dict(max_num_batched_tokens=VLLM_BATCHED_TOKENS, enable_chunked_prefill=False)

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False,
               "required": ["name", "age", "city"],
               "properties": {"name": {"type": "string", "maxLength": 24},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "city": {"enum": ["London", "Paris", "Bath", "Highbury"]}}},
    "items": {"type": "object", "required": ["items"], "additionalProperties": False,
              "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                  "type": "object", "required": ["title", "tags"], "additionalProperties": False,
                  "properties": {"title": {"type": "string", "maxLength": 30},
                                 "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}}}},
    "choice-like": {"anyOf": [{"type": "null"}, {"enum": ["yes", "no"]},
                              {"type": "integer", "minimum": 0}]},
}


def _messages(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe person {i} of Emma by Jane Austen."}]
            for i in range(n)]


def _jaxkv_api() -> tuple:
    """jaxkv's ``(SamplingParams, StructuredOutputsParams)``; vLLM's worker passes its own (the
    same names and fields)."""
    from jaxkv import SamplingParams
    from jaxkv.sample.structured import StructuredOutputsParams

    return SamplingParams, StructuredOutputsParams


def throughput(llm, fraction: float, lengths: list[int], api: tuple | None = None
               ) -> tuple[float, int]:
    """(output tokens / s, tokens) of ``len(lengths)`` chat requests, ``fraction`` of them
    constrained; request ``i`` generates exactly ``lengths[i]`` tokens either way (its length
    under the constraint), so every mix does the same work but for the grammar's. ``llm`` is
    jaxkv's ``LLM`` or, with ``api`` = vLLM's classes, vLLM's."""
    SamplingParams, StructuredOutputsParams = api or _jaxkv_api()
    spec = StructuredOutputsParams(json=SCHEMAS["person"])
    n, k = len(lengths), round(len(lengths) * fraction)
    params = [SamplingParams(temperature=0.7, max_tokens=m, seed=i, **(
        dict(structured_outputs=spec) if i < k else dict(min_tokens=m, ignore_eos=True)))
        for i, m in enumerate(lengths)]
    start = time.perf_counter()
    outs = llm.chat(_messages(n), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, tokens


def constrained_outputs(llm, n: int, api: tuple | None = None) -> list:
    """The ``n`` requests constrained (64 tokens at most): the engine's outputs."""
    SamplingParams, StructuredOutputsParams = api or _jaxkv_api()
    spec = StructuredOutputsParams(json=SCHEMAS["person"])
    return llm.chat(_messages(n), [SamplingParams(temperature=0.7, max_tokens=64, seed=i,
                                                  structured_outputs=spec) for i in range(n)],
                    use_tqdm=False)


def constrained_lengths(llm, n: int) -> list[int]:
    """Each request's output length under the constraint (64 tokens at most)."""
    return [len(o.outputs[0].token_ids) for o in constrained_outputs(llm, n)]


def bitmask_fill_ms(llm, rows: int = 64, repeats: int = 20) -> tuple[float, float]:
    """(ms to fill ``rows`` grammar bitmasks, ms to build the step's mask arrays from them):
    the host work a batch of ``rows`` constrained decode rows adds to a step."""
    from jaxkv import SamplingParams
    from jaxkv.sample import logit_controls
    from jaxkv.sample.structured import StructuredOutputsParams

    table = llm.engine._table
    spec = StructuredOutputsParams(json=SCHEMAS["person"])
    matchers = [table.grammars().matcher(spec) for _ in range(rows)]
    prefix = llm.tokenizer.encode('{"name": "Emma', add_special_tokens=False)
    for m in matchers:
        for t in prefix:
            m.accept(t)
    v, params = table.vocab_size, [SamplingParams()] * rows
    fills, builds = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        masks = [m.bitmasks(())[0] for m in matchers]
        t1 = time.perf_counter()
        logit_controls.host_arrays(params, [()] * rows, v, rows, masks)
        fills.append(t1 - t0)
        builds.append(time.perf_counter() - t1)
    return statistics.median(fills) * 1e3, statistics.median(builds) * 1e3


def compile_ms(llm) -> list[tuple[str, float, float]]:
    """Per schema: (name, cold ms in a fresh compiler, cached ms)."""
    from jaxkv.sample.structured import GrammarCompiler, StructuredOutputsParams

    compiler = GrammarCompiler(llm.tokenizer, llm.engine._table.vocab_size)
    out = []
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        compiler.compile(spec)
        t1 = time.perf_counter()
        compiler.compile(spec)
        out.append((name, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    return out


def json_validity(outs) -> dict:
    """How many of the constrained outputs ``outs`` ended by themselves (finish ``stop``) and
    how many parse as JSON valid under the person schema."""
    import jsonschema

    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["person"])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"requests": len(outs), "valid": valid,
            "stopped": sum(o.outputs[0].finish_reason == "stop" for o in outs)}


# ---------------------------------------------------------------------- vLLM as the peer


def vllm_worker(job_file: str) -> None:
    """vLLM's side, in its venv's python: ``vllm.LLM`` on the HF directory, the constrained
    pass that fixes each request's length, an untimed pass of each mix, then one timed mix per
    JSON line on stdin (``{"fraction"}``, then ``{"quit": true}``), answered on the original
    stdout; vLLM's own prints go to stderr (the log)."""
    job = json.loads(Path(job_file).read_text())
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from bench.lib.vllm_peer import vllm_llm

    llm, _, info = vllm_llm(job["hf_model"], "float32", job["kv_bytes"], job["eager"],
                            dict(LIMITS, **VLLM_SCHEDULING))
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    api = (SamplingParams, StructuredOutputsParams)
    outs = constrained_outputs(llm, job["requests"], api)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    probe = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["person"]))
    llm.generate(["{"], probe, use_tqdm=False)
    info.update(structured_outputs_backend=probe.structured_outputs._backend,
                VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
    for f in FRACTIONS:                                     # warm-up, as jaxkv's
        throughput(llm, f, lengths, api)
    proto.write(json.dumps({"startup_s": time.time() - job["spawn_time"], "lengths": lengths,
                            "prompts": [list(o.prompt_token_ids) for o in outs],
                            "validity": json_validity(outs),
                            "info": json.loads(json.dumps(info, default=str))}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        rate, tokens = throughput(llm, cmd["fraction"], lengths, api)
        proto.write(json.dumps({"rate": rate, "tokens": tokens}) + "\n")


class VllmPeer:
    """vLLM's worker process (``vllm_worker``), kept alive between the timed mixes."""

    def __init__(self, a, work: Path):
        from bench.lib.vllm_peer import peer_env

        kv_bytes = a.vllm_kv_gib * 2**30
        job = {"hf_model": a.hf_model, "eager": a.vllm_eager, "requests": a.requests,
               "kv_bytes": kv_bytes, "spawn_time": time.time()}
        (work / "vllm.job.json").write_text(json.dumps(job))
        env = peer_env(a.peer_cache)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if a.vllm_threads == 1 else f"0-{a.vllm_threads - 1}"
        env.pop("PYTHONPATH", None)
        self.log_file = a.vllm_log or work / "vllm.log"
        self.logf = open(self.log_file, "w")
        python = str(Path(a.vllm_venv) / "bin" / "python")
        log(f"vLLM: starting ({python}, log {self.log_file})")
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--_vllm-worker", str(work / "vllm.job.json")],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.logf, text=True)

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
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        rc = self.proc.wait()
        self.logf.close()
        return rc

    def failure(self) -> str:
        rc = self.close()
        tail = Path(self.log_file).read_text().splitlines()[-25:]
        log(f"vLLM: FAILED (exit {rc}); last lines of its log:\n" + "\n".join(tail))
        return f"exit {rc}: " + " / ".join(l.strip() for l in tail[-3:])


def head_snapshot(work: Path) -> Path:
    """HEAD's ``jaxkv/`` extracted under ``work`` and put first on ``sys.path`` (bench/peers.py
    runs jaxkv the same way), ``models/`` linked to the repository's, so edits to the work tree
    during the run do not leak in."""
    snap = work / "jaxkv-src"
    snap.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD", "jaxkv"], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(snap)], input=archive, check=True)
    (snap / "models").symlink_to(REPO / "models")
    sys.path.insert(0, str(snap))
    return snap


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cells(v: list[float]) -> str:
    return f"{statistics.median(v):.1f} ({', '.join(f'{x:.1f}' for x in v)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--head", action="store_true",
                    help="jaxkv from a snapshot of HEAD's jaxkv/ (git archive), not the work tree")
    ap.add_argument("--peer", choices=("vllm",),
                    help="the same mixes on vLLM's CPU build too, alternating with jaxkv's")
    ap.add_argument("--vllm-venv", default="/work/peers/vllm-venv")
    ap.add_argument("--hf-model", default="/work/peers/SmolLM2-135M-Instruct-hf",
                    help="vLLM's model: jaxkv's GGUF as an fp32 HF directory "
                         "(bench/peers_setup.py)")
    ap.add_argument("--vllm-threads", type=int, default=1,
                    help="vLLM's compute threads (VLLM_CPU_OMP_THREADS_BIND=0-(n-1))")
    ap.add_argument("--vllm-eager", action="store_true",
                    help="enforce_eager=True (default: vLLM's own default, torch.compile)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2,
                    help="vLLM's KV pool (jaxkv's CPU default: 2 GiB)")
    ap.add_argument("--vllm-log", type=Path, help="vLLM worker's log (default: a temp file)")
    ap.add_argument("--peer-cache", default="/work/peers/cache")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="structured-") as tmp:
        run(args, Path(tmp))


def run(args, work: Path) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    if args.head:
        head_snapshot(work)
    from jaxkv import LLM
    import jaxkv

    log(f"jaxkv from {Path(jaxkv.__file__).parent}")
    loads = [loadavg()[0]]
    peer, ready, peer_error = None, None, None
    if args.peer:
        sys.path.insert(0, str(REPO / "bench"))
        from peers import settle, tree_cpu_s     # after the snapshot: peers imports jaxkv

        peer = VllmPeer(args, work)
        ready = peer.ask()
        if ready is None:
            peer_error, peer = peer.failure(), None
        else:
            log(f"vLLM: ready in {ready['startup_s']:.1f} s, {sum(ready['lengths'])} tokens "
                f"per pass")
    engines = ("jaxkv", "vllm") if peer else ("jaxkv",)
    rates = {e: {f: [] for f in FRACTIONS} for e in engines}
    idle_cpu = {e: [] for e in engines}
    with LLM(args.model, **LIMITS) as llm:
        outs = constrained_outputs(llm, args.requests)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        validity = {"jaxkv": json_validity(outs)}
        same_prompts = None
        if peer:
            validity["vllm"] = ready["validity"]
            same_prompts = sum(list(o.prompt_token_ids) == p
                               for o, p in zip(outs, ready["prompts"]))
        for f in FRACTIONS:   # warm-up: compiles every step variant (with and without masks)
            throughput(llm, f, lengths)
        for r in range(args.rounds):
            for k, f in enumerate(FRACTIONS if r % 2 == 0 else FRACTIONS[::-1]):
                for e in engines if (r + k) % 2 == 0 else engines[::-1]:
                    if peer:
                        settle([os.getpid()])
                    if e == "jaxkv":
                        cpu0 = tree_cpu_s(peer.proc.pid) if peer else 0.0
                        rate, tokens = throughput(llm, f, lengths)
                        if peer:
                            idle_cpu["vllm"].append(tree_cpu_s(peer.proc.pid) - cpu0)
                    else:
                        cpu0 = own_cpu_s()
                        answer = peer.ask({"fraction": f})
                        idle_cpu["jaxkv"].append(own_cpu_s() - cpu0)
                        if answer is None:
                            raise SystemExit(f"vLLM died: {peer.failure()}")
                        rate, tokens = answer["rate"], answer["tokens"]
                    rates[e][f].append(rate)
                    loads.append(loadavg()[0])
                    log(f"round {r}: {e} {f:.0%} constrained: {rate:.1f} tok/s "
                        f"({tokens} tokens)")
        fill, build = bitmask_fill_ms(llm)
        compiled = compile_ms(llm)
    if peer:
        rc = peer.close()
        if rc != 0:
            log(f"vLLM: exit {rc} at shutdown (its runs stand)")
    base = {e: statistics.median(rates[e][0.0]) for e in engines}
    if peer:
        lines = ["| constrained | jaxkv tok/s (median; rounds) | jaxkv vs 0% | "
                 "vLLM tok/s (median; rounds) | vLLM vs 0% | jaxkv / vLLM (median; rounds) |",
                 "|---|---|---|---|---|---|"]
        for f in FRACTIONS:
            j, v = rates["jaxkv"][f], rates["vllm"][f]
            paired = [x / y for x, y in zip(j, v)]
            lines.append(f"| {f:.0%} | {_cells(j)} | {statistics.median(j) / base['jaxkv']:.2f} "
                         f"| {_cells(v)} | {statistics.median(v) / base['vllm']:.2f} | "
                         f"{statistics.median(paired):.2f} "
                         f"({', '.join(f'{x:.2f}' for x in paired)}) |")
        info = ready["info"]
        lines += ["", f"Tokens per pass: jaxkv {sum(lengths)}, vLLM {sum(ready['lengths'])} "
                  f"(each engine's own constrained lengths). Prompts identical token for token: "
                  f"{same_prompts}/{len(lengths)}. Constrained pass (64 tokens at most): "
                  + "; ".join(f"{e} {v['stopped']}/{v['requests']} ended by themselves, "
                              f"{v['valid']}/{v['requests']} valid JSON"
                              for e, v in validity.items()) + ".",
                  f"vLLM {info.get('vllm_version')}, fp32, "
                  f"{'eager' if args.vllm_eager else 'torch.compile'}, "
                  f"VLLM_CPU_OMP_THREADS_BIND={info.get('VLLM_CPU_OMP_THREADS_BIND')}, "
                  f"structured outputs backend {info.get('structured_outputs_backend')}, "
                  f"KV pool {args.vllm_kv_gib} GiB, max_num_batched_tokens "
                  f"{VLLM_BATCHED_TOKENS}, chunked prefill off; start-up "
                  f"{ready['startup_s']:.0f} s. Idle engine's CPU seconds during the other's "
                  f"runs: jaxkv "
                  f"{max(idle_cpu['jaxkv']):.2f} at most, vLLM {max(idle_cpu['vllm']):.2f} "
                  f"at most."]
    else:
        lines = ["| constrained | output tok/s (median of rounds) | vs 0% |", "|---|---|---|"]
        lines += [f"| {f:.0%} | {_cells(v)} | {statistics.median(v) / base['jaxkv']:.2f} |"
                  for f, v in rates["jaxkv"].items()]
        if peer_error:
            lines += ["", f"vLLM peer failed: {peer_error}"]
    lines += ["", f"Host time per step at 64 constrained rows: {fill:.2f} ms filling the "
              f"bitmasks, {build:.2f} ms building the step's arrays.", "",
              "| schema | compile, cold ms | cached ms |", "|---|---|---|"]
    lines += [f"| {n} | {cold:.1f} | {hot:.3f} |" for n, cold, hot in compiled]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(
            f"`python3 {' '.join(['bench/structured_overhead.py'] + sys.argv[1:])}` on "
            f"{args.model}, jaxkv {commit}{' (HEAD snapshot)' if args.head else ''}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 1-min load "
            f"{min(loads):.2f}-{max(loads):.2f}\n\n{text}\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_vllm-worker":
        vllm_worker(sys.argv[2])
    else:
        main()
