"""The ``jaxkv`` command line; engine flags are generated from ``jaxkv.config.EngineConfig``
(named like vLLM's)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from jaxkv.config import EngineConfig
from jaxkv.config.args import QUANTIZATION_MODES
from jaxkv.config.options import parse_bytes
from jaxkv.model.quantization import DEFAULT_GROUP
from jaxkv.server.tool_calls import PARSERS

BENCH_MIN_PROMPT_LEN = 32   # bench's default shortest prompt and output, in tokens
BENCH_MIN_OUTPUT_LEN = 16
DEFAULT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
]


def _engine_args(p: argparse.ArgumentParser, *, serving: bool = False, **defaults) -> None:
    """Every engine flag (generated from ``EngineConfig``) and the multi-host launch flags."""
    EngineConfig.add_cli_args(p, **defaults)
    add_launch_args(p, serving=serving)


def add_launch_args(p: argparse.ArgumentParser, *, serving: bool = False) -> None:
    """The multi-host launch flags; ``serving``: with ``--peer-timeout`` (a server's and a
    Dynamo worker's)."""
    g = p.add_argument_group("multi-host launch (jax.distributed)")
    g.add_argument("--coordinator-address", default=None,
                   help="multi-host: host:port of process 0, for jax.distributed.initialize "
                        "(default: the JAX_COORDINATOR_ADDRESS env var); every process runs the "
                        "same command")
    g.add_argument("--num-processes", type=int, default=None, help="multi-host: process count")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process's rank")
    if serving:
        g.add_argument("--peer-timeout", type=float, default=10.0,
                       help="multi-host: process 0 serves, the others follow it (no port); "
                            "seconds of a process's silence after which the others give up "
                            "(the leader fails its requests with 503 and exits)")


def launch_kwargs(a: argparse.Namespace) -> dict | None:
    """``jaxkv.engine.multihost.launch``'s keywords from a serving command's launch flags;
    None when they ask for one process."""
    if not (a.coordinator_address or a.num_processes):
        return None
    return dict(coordinator_address=a.coordinator_address, num_processes=a.num_processes,
                process_id=a.process_id, peer_timeout=a.peer_timeout)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def _make_llm(a):
    """The engine of the parsed flags: an ``LLM``, or a ``DataParallelLLM`` for ``-dp > 1``."""
    if a.coordinator_address or a.num_processes:
        from jaxkv.runner.sharding import initialize_distributed

        initialize_distributed(a.coordinator_address, a.num_processes, a.process_id)
    config = EngineConfig.from_cli(a)
    if config.parallel.data_parallel_size > 1:
        from jaxkv.engine.data_parallel import DataParallelLLM

        return DataParallelLLM(**config.to_kwargs())
    from jaxkv.engine.llm import LLM

    return LLM.from_config(config)


def _sampling(a):
    from jaxkv.sample.sampler import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          seed=a.sampling_seed)


def _print_stats(llm) -> None:
    s = llm.stats()
    print(f"\nKV cache: {s['kv_blocks_total']} usable blocks x {llm.cache_config.block_size} "
          f"tokens ({llm.memory_plan.kv_cache_bytes / 2**20:.1f} MiB, "
          f"{llm.memory_plan.kv_cache_dtype}); peak usage {s['kv_usage_peak']:.2%}")
    print(json.dumps(s, indent=2))


def cmd_generate(a) -> int:
    prompts = a.prompt or DEFAULT_PROMPTS
    with _make_llm(a) as llm:
        print(llm.memory_plan.summary())
        params = _sampling(a)
        if a.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(prompts, params)
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            print(f"\n### {p!r}\n{c.text}\n[{len(c.token_ids)} tokens, {c.finish_reason}, "
                  f"TTFT {o.metrics.ttft:.3f}s"
                  + (f", TPOT {o.metrics.tpot * 1000:.1f}ms]" if o.metrics.tpot else "]"))
        _print_stats(llm)
    return 0


def cmd_chat(a) -> int:
    with _make_llm(a) as llm:
        messages = []
        lines = [a.message] if a.message else sys.stdin
        if not a.message:
            print("chat: type a message, Ctrl-D to quit", file=sys.stderr)
        for line in lines:
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.strip()})
            reply = llm.chat(messages, _sampling(a), use_tqdm=False)[0].outputs[0].text
            messages.append({"role": "assistant", "content": reply})
            print(f"assistant: {reply}", flush=True)
    return 0


def _length_range(kind: str, low: int | None, high: int, default_low: int) -> int:
    """The shortest ``kind`` (prompt, output) length of ``[low, high]``: ``low``, or
    ``default_low`` capped at ``high`` when unset; a ValueError names the bad flag."""
    if high < 1:
        raise ValueError(f"--max-{kind}-len={high} must be >= 1")
    if low is None:
        return min(default_low, high)
    if not 1 <= low <= high:
        raise ValueError(f"--min-{kind}-len={low} must be in [1, --max-{kind}-len={high}]")
    return low


def _check_bench_counts(a) -> None:
    """Checks bench's prompt count and lengths before anything loads, filling in the shortest
    lengths left unset; a ValueError names the flag."""
    if a.num_prompts < 1:
        raise ValueError(f"--num-prompts={a.num_prompts} must be >= 1")
    a.min_prompt_len = _length_range("prompt", a.min_prompt_len, a.max_prompt_len,
                                     BENCH_MIN_PROMPT_LEN)
    a.min_output_len = _length_range("output", a.min_output_len, a.max_output_len,
                                     BENCH_MIN_OUTPUT_LEN)


def _size_engine_to(a, plens, olens) -> None:
    """Sizes bench's engine to the requests it sends: no more sequences than prompts, and
    their longest prompt + output as ``max_model_len`` unless one is given (a smaller block
    table to compile, a smaller pool to hold)."""
    a.max_num_seqs = min(a.max_num_seqs, len(plens))
    a.max_model_len = a.max_model_len or int((plens + olens).max())


def _bench_shapes(llm, requests, replicas: int) -> set[tuple[int, int]]:
    """The padded step shapes ``requests`` step through, on each replica's share of them."""
    from jaxkv.sched import dry_run

    return set().union(*(dry_run.step_shapes(llm.cache_config, llm.sched_config,
                                              requests[r::replicas]) for r in range(replicas)))


def cmd_bench(a) -> int:
    import numpy as np

    from jaxkv.data import read_text
    from jaxkv.sample.sampler import SamplingParams

    _check_bench_counts(a)
    text = read_text(a.dataset)
    rng = np.random.default_rng(a.seed)
    plens = rng.integers(a.min_prompt_len, a.max_prompt_len + 1, size=a.num_prompts)
    olens = rng.integers(a.min_output_len, a.max_output_len + 1, size=a.num_prompts)
    _size_engine_to(a, plens, olens)
    with _make_llm(a) as llm:
        ids = llm.tokenizer.encode(text[:200_000])
        if len(ids) <= a.max_prompt_len:
            raise ValueError(f"--dataset {a.dataset} has {len(ids)} tokens: too few for "
                             f"--max-prompt-len={a.max_prompt_len}")
        starts = rng.integers(0, len(ids) - a.max_prompt_len, size=a.num_prompts)
        requests = [(ids[s:s + n], int(m)) for s, n, m in zip(starts, plens, olens)]
        t = time.perf_counter()
        variants = llm.warmup(_bench_shapes(llm, requests, a.data_parallel_size))
        warm = time.perf_counter() - t
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                            [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                             for _, m in requests])
        elapsed = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        result = {"num_prompts": a.num_prompts, "prompt_tokens": n_in, "output_tokens": n_out,
                  "elapsed_s": elapsed, "output_tokens_per_s": n_out / elapsed,
                  "total_tokens_per_s": (n_in + n_out) / elapsed, "warmup_s": warm,
                  "warmup_step_variants": variants, "max_num_seqs": a.max_num_seqs,
                  "max_model_len": a.max_model_len, **llm.stats()}
        print(json.dumps(result, indent=2))
    return 0


def cmd_serve(a) -> int:
    from jaxkv.server.app import serve

    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    config, feed, launch = EngineConfig.from_cli(a), None, launch_kwargs(a)
    if launch is not None:   # process 0 serves, the others follow
        from jaxkv.engine import multihost

        if not multihost.launch(config, **launch):
            return 0
        feed = multihost.open_leader_feed(a.peer_timeout)
    return serve(config, host=a.host, port=a.port,
                 served_model_name=a.served_model_name, api_key=a.api_key,
                 shutdown_timeout=a.shutdown_timeout, max_request_bytes=a.max_request_bytes,
                 log_level=a.log_level, tool_call_parser=a.tool_call_parser, step_feed=feed)


def cmd_plan(a) -> int:
    from jaxkv.config.resolve import resolve
    from jaxkv.kvcache.spec import KV_FORMATS
    from jaxkv.model.weights import load_config
    from jaxkv.runner import memory_plan
    from jaxkv.runner.model_runner import plan_memory

    engine = EngineConfig.from_cli(a)
    config = load_config(engine.model.model)
    print(f"model: {engine.model.model} ({config.architecture}, {config.num_layers} layers, "
          f"{config.num_heads} q heads / {config.num_kv_heads} kv heads x {config.head_dim})")
    groups = memory_plan.kv_groups(config)
    if groups.hybrid:      # the plan's summary has each group's bytes and blocks per sequence
        print(f"hybrid KV cache: {groups.num_groups} layer groups over "
              f"{groups.num_slots(config.num_layers)} pool slots")
        print("\n".join(f"  {line}" for line in groups.describe().splitlines()))
    print("KV bytes per token" + (" (every layer, a full cache):" if groups.hybrid else ":"))
    for kv in KV_FORMATS:
        print(f"  {kv:<10} {memory_plan.kv_bytes_per_token(config, kv):>10,} B")
    print(f"resolved: {resolve(engine, config)}")
    p = plan_memory(engine, config, device_memory_bytes=a.device_memory)
    print(p.summary())
    return 0 if p.runs else 1


def cmd_eval_ppl(a) -> int:
    from jaxkv.data import read_text
    from jaxkv.entrypoints.eval import perplexity

    text = read_text(a.text)
    a.max_model_len = a.max_model_len or a.context
    # the engine's own pool only has to hold one window (eval allocates its own cache)
    a.num_gpu_blocks_override = (a.num_gpu_blocks_override
                                 or -(-a.max_model_len // a.block_size) + 1)
    with _make_llm(a) as llm:
        runner = llm.engine.runner
        ids = llm.tokenizer.encode(text)[:a.max_text_tokens]
        r = perplexity(runner, ids, kv_cache_dtype=runner.kv_cache_dtype, context=a.context,
                       stride=a.stride, chunk=a.chunk, residual_blocks=runner.kv_residual_blocks,
                       group_size=runner.kv_group_size, progress=True)
    print(json.dumps({"text": a.text, "model": a.model, **dataclasses.asdict(r)}, indent=2))
    return 0


def cmd_convert(a) -> int:
    from jaxkv.model import checkpoint

    if checkpoint.is_checkpoint(a.out) and not a.overwrite:
        raise ValueError(f"{a.out} already holds a checkpoint; pass --overwrite to replace it")
    quantization = None if a.quantization == checkpoint.AS_STORED else a.quantization
    path = checkpoint.convert(a.model, a.out, dtype=a.dtype, quantization=quantization,
                              group=a.quantization_group_size, overwrite=a.overwrite)
    print(f"wrote {path} (orbax params + config + tokenizer); load it sharded with "
          f"jaxkv generate --model {path} --tensor-parallel-size N")
    return 0


COMMANDS = (
    ("generate", "generate text for prompts and print KV-cache statistics"),
    ("chat", "chat with the model (stdin lines, or one --message)"),
    ("bench", "offline throughput on prompts cut from a text file"),
    ("serve", "an OpenAI-compatible HTTP server (completions, chat, metrics)"),
    ("plan", "memory plan: what fits, how many blocks, why it OOMs"),
    ("convert", "convert a GGUF / HF model once into an orbax checkpoint"),
    ("eval", "model quality with a chosen KV cache (eval ppl)"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxkv", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="jaxkv: a JAX/Pallas LLM inference engine over a paged KV cache.\n\n"
                    "commands:\n" + "\n".join(f"  {name:<10} {text}" for name, text in COMMANDS)
                    + "\n\n`jaxkv COMMAND --help` lists a command's flags.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts and print KV-cache statistics")
    _engine_args(g, max_num_seqs=4)
    _sampling_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: 3 examples")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat with the model (stdin lines, or one --message)")
    _engine_args(c, max_num_seqs=1)
    _sampling_args(c)
    c.add_argument("--message", default=None)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="offline throughput on prompts cut from a text file",
                       description="Offline throughput on prompts cut from a text file. The "
                       "engine is sized to them: --max-num-seqs at most --num-prompts, "
                       "--max-model-len their longest prompt + output unless given, and only "
                       "the step shapes the run steps through are compiled (a scheduler dry run, "
                       "jaxkv/sched/dry_run.py).")
    _engine_args(b)
    b.add_argument("--dataset", default="austen:emma",
                   help="a UTF-8 text file, or a bundled novel: austen:emma (default), "
                        "austen:mansfield_park, austen:pride_and_prejudice, "
                        "austen:sense_and_sensibility")
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--min-prompt-len", type=int, default=None,
                   help=f"default: {BENCH_MIN_PROMPT_LEN}, or --max-prompt-len if smaller")
    b.add_argument("--max-prompt-len", type=int, default=256)
    b.add_argument("--min-output-len", type=int, default=None,
                   help=f"default: {BENCH_MIN_OUTPUT_LEN}, or --max-output-len if smaller")
    b.add_argument("--max-output-len", type=int, default=256)
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    _engine_args(s, serving=True)
    g = s.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: --model)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="after SIGTERM: seconds in-flight requests may take to finish, while "
                        "new ones get 503")
    g.add_argument("--max-request-bytes", type=parse_bytes, default="4MiB",
                   help="largest request body (default 4MiB; e.g. 1e6, 16MiB): a larger one "
                        "gets 413, refused from its Content-Length before it is read")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--tool-call-parser", default=None, choices=list(PARSERS),
                   help="the format the model writes tool calls in, read for "
                        "tool_choice=\"auto\" (smollm2: the default model's)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag, accepted: tool_choice=\"auto\" works whenever "
                        "--tool-call-parser is given")
    s.set_defaults(func=cmd_serve)

    p = sub.add_parser("plan", help="memory plan: what fits, how many blocks, why it OOMs")
    EngineConfig.add_cli_args(p)
    p.add_argument("--device-memory", type=parse_bytes, default=None,
                   help="device memory (e.g. 80GiB); default: this machine's (CPU: the host "
                        "budget)")
    p.set_defaults(func=cmd_plan)

    v = sub.add_parser("convert", help="convert a GGUF / HF model once into an orbax checkpoint "
                                       "that tensor-parallel engines restore shard by shard")
    v.add_argument("--model", default="SmolLM2-135M-Instruct",
                   help="store name, .gguf file or HF directory")
    v.add_argument("--out", required=True, help="checkpoint directory to write")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    v.add_argument("--quantization", default="as stored",
                   choices=["as stored", *QUANTIZATION_MODES],
                   help="weights as saved: as stored (a GGUF's kept blocks, a compressed-tensors "
                        "checkpoint's codes), none (every weight in --dtype), or the dense "
                        "projections and experts quantized as LLM(quantization=...) does")
    v.add_argument("--quantization-group-size", type=int, default=DEFAULT_GROUP,
                   help="values per scale of --quantization int4 (a multiple of 32)")
    v.add_argument("--overwrite", action="store_true")
    v.set_defaults(func=cmd_convert)

    e = sub.add_parser("eval", help="model quality with a chosen KV cache")
    esub = e.add_subparsers(dest="metric", required=True)
    ppl = esub.add_parser("ppl", help="perplexity on a text file through the engine's paged "
                                      "(possibly quantized) KV cache (jaxkv.entrypoints.eval)")
    _engine_args(ppl, max_num_seqs=1, max_num_batched_tokens=256)
    ppl.add_argument("--text", default="austen:emma",
                     help="a UTF-8 text file, or a bundled novel (austen:emma, the default; "
                          "see bench --help)")
    ppl.add_argument("--context", type=int, default=2048, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=None, help="window advance (default: context)")
    ppl.add_argument("--chunk", type=int, default=256, help="tokens per forward (chunked prefill)")
    ppl.add_argument("--max-text-tokens", type=int, default=None,
                     help="evaluate only the first N tokens of the text")
    ppl.set_defaults(func=cmd_eval_ppl)
    return parser


def _show_logs(level: str) -> None:
    """Shows the library's log (logger "jaxkv": memory plan, kernel builds, compiles) on
    stderr at ``level``; other libraries' at WARNING. The library itself only logs."""
    logging.basicConfig(format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("jaxkv").setLevel(level.upper())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    _show_logs(getattr(args, "log_level", "info"))
    try:
        return args.func(args)
    except (TypeError, ValueError) as e:
        print(f"jaxkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
