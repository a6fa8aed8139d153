"""Multi-device checks run in a subprocess (tests/test_sharding.py launches it).

The fake CPU devices (``--xla_force_host_platform_device_count``) must be set before jax is
imported, so the parent passes ``XLA_FLAGS`` in the environment; this script asserts it got
the devices it needs and prints one JSON object (the results) as its last stdout line.

    python tests/tp_worker.py parity  MODEL_DIR --tp 1 2 4 8 --dp-tp 2 4 [--attention-impl pallas]
    python tests/tp_worker.py forks   MODEL_DIR --tp 1 4
    python tests/tp_worker.py offload MODEL_DIR --tp 1 2 4 --tokens 40
    python tests/tp_worker.py inspect MODEL_DIR --tp 4
    python tests/tp_worker.py errors  MODEL_DIR
    python tests/tp_worker.py kv_parity MODEL_DIR --tp 1 2 4 --kv int8 int4
    python tests/tp_worker.py checkpoint MODEL_DIR CKPT_DIR --tp 4
    python tests/tp_worker.py distributed MODEL_DIR --tp 4 --coordinator 127.0.0.1:PORT \
        --num-processes 2 --process-id 0
    python tests/tp_worker.py requests MODEL_DIR SPEC_JSON --tp 4
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from unittest import mock

import jax
import numpy as np

from jaxkv import DataParallelLLM
from jaxkv import LLM
from jaxkv.attention import ATTENTION_IMPLS
from jaxkv.model import checkpoint
from jaxkv.model.llama import param_shapes, params_from_hf
from jaxkv.model.weights import load_model_files
from jaxkv.runner import sharding
from jaxkv.runner import model_runner as engine
from jaxkv.sample.sampler import SamplingParams
from paged_runner import PagedRunner

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=48,
              block_size=8, token_buckets=(32,), seq_buckets=(4,), dtype="float32")
PROMPTS = ["Emma Woodhouse, handsome, clever,", "and rich, with a comfortable home",
           "seemed to unite some of the best blessings of existence;"]


def greedy(llm, max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def cmd_parity(a) -> dict:
    out = {}
    for tp in a.tp:
        with LLM(a.model, tensor_parallel_size=tp, attention_impl=a.attention_impl,
                 interpret=a.attention_impl == "pallas", **ENGINE) as llm:
            out[f"tp{tp}"] = greedy(llm, a.tokens)
            out[f"tp{tp}_plan"] = [llm.memory_plan.kv_bytes_per_token,
                                   llm.memory_plan.kv_head_replication]
    if a.dp_tp:
        dp, tp = a.dp_tp
        llm = DataParallelLLM(a.model, tensor_parallel_size=tp, data_parallel_size=dp, **ENGINE)
        with llm:
            out[f"dp{dp}xtp{tp}"] = greedy(llm, a.tokens)
            out["dp_devices"] = [[d.id for d in r.engine.runner.mesh.devices.flat]
                                  for r in llm.replicas]
    return out


def cmd_kv_parity(a) -> dict:
    """Greedy tokens of the model over a quantized paged cache at each tp degree (tests/
    paged_runner.py: the engine step's sharded params, cache and shard_map attention), and the
    per-device shard shape of every array of the first K pool."""
    loaded = load_model_files(a.model)
    params = params_from_hf(loaded.config, loaded.tensors, np.float32)
    prompt = loaded.tokenizer.encode(PROMPTS[2])
    out = {}
    for kv in a.kv:
        for tp in a.tp:
            mesh = None if tp == 1 else sharding.make_mesh(tp)
            runner = PagedRunner(params, loaded.config, block_size=8, max_len=64,
                                 kv_cache_dtype=kv, mesh=mesh)
            out[f"{kv}_tp{tp}"] = runner.greedy(prompt, a.tokens, chunk=5)[0]
            leaves = jax.tree_util.tree_flatten_with_path(runner.cache.k[0])[0]
            out[f"{kv}_tp{tp}_shards"] = {jax.tree_util.keystr(path) or "pages": list(
                x.addressable_shards[0].data.shape) for path, x in leaves}
        for tp in a.tp[:2]:   # the engine end to end: the cache in the KV dtype on every device
            with LLM(a.model, tensor_parallel_size=tp, kv_cache_dtype=kv, **ENGINE) as llm:
                out[f"{kv}_engine_tp{tp}"] = greedy(llm, a.tokens)
                pool = llm.engine.runner.cache.k[0]
                out[f"{kv}_engine_tp{tp}_dtype"] = str(pool.data.dtype)
    return out


def cmd_streaming(a) -> dict:
    """StreamingLLM retention (sinks 2 + window 12, positions within the cache: the sink queries
    go through shard_map split over heads like q) at each tp degree."""
    out = {}
    for tp in a.tp:
        with LLM(a.model, tensor_parallel_size=tp, attention_impl=a.attention_impl,
                 kv_retention="streaming", kv_sink_tokens=2, kv_window_tokens=12,
                 **ENGINE) as llm:
            out[f"tp{tp}"] = greedy(llm, a.tokens)
    return out


def cmd_scored(a) -> dict:
    """H2O and SnapKV (blocks ranked by the attention mass every head's queries put on them: the
    lse comes out of shard_map split over heads, the mass is summed over all of them) at each
    tp degree, past a 16-token (SnapKV: 24) budget; also the most blocks any table had dropped."""
    out = {}
    for tp in a.tp:
        for policy in ("h2o", "snapkv"):
            kw = dict(kv_observation_tokens=4) if policy == "snapkv" else {}
            budget = 24 if policy == "snapkv" else 16
            with LLM(a.model, tensor_parallel_size=tp, attention_impl=a.attention_impl,
                     kv_retention=policy, kv_sink_tokens=0, kv_budget_tokens=budget, **kw,
                     **ENGINE) as llm:
                engine = llm.engine
                prompts = PROMPTS if policy == "h2o" else [" ".join(PROMPTS)] * 2
                sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
                ids = [engine.add_request(p, sp) for p in prompts]
                done, dropped = {}, 0
                while engine.has_unfinished_requests():
                    done.update({k: v for k, v in engine.step().items() if v.finished})
                    state = engine.scheduler_state
                    dropped = max([dropped] + [state.block_manager.block_table(i).count(0)
                                               for i in state.running])
                out[f"{policy}_tp{tp}"] = [done[i].outputs[0].token_ids for i in ids]
                out[f"{policy}_tp{tp}_dropped"] = dropped
    return out


def cmd_offload(a) -> dict:
    """The host KV tier at each tp degree (each device's shard of a block moves with it): a
    pool of 23 usable blocks forces swap preemption, and a second round of the prompts after
    other ones finds their evicted blocks on the host."""
    other = [p[::-1] for p in PROMPTS]
    out = {}
    # the last degree again with the blocks staged through pinned_host buffers (a GPU's default)
    runs = [(tp, "auto") for tp in a.tp] + [(a.tp[-1], "pinned_host")]
    for tp, staging in runs:
        key = f"tp{tp}" + ("_pinned" if staging == "pinned_host" else "")
        pool = functools.partial(engine.HostKVPool, staging=staging)
        with mock.patch.object(engine, "HostKVPool", pool), \
                LLM(a.model, tensor_parallel_size=tp, attention_impl=a.attention_impl,
                    kv_offload_bytes=1 << 20, preemption_mode="swap",
                    **dict(ENGINE, num_kv_blocks=24, max_model_len=88)) as llm:
            assert llm.engine.runner.offload.pool.staging == ("none" if staging == "auto" else staging)
            out[key] = greedy(llm, a.tokens)
            sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
            llm.generate(other, sp, use_tqdm=False)
            out[f"{key}_again"] = greedy(llm, a.tokens)
            stats = llm.stats()
            out[f"{key}_stats"] = [stats["num_swap_preemptions"],
                                   stats["prefix_cache_hits_host"]]
    return out


def cmd_forks(a) -> dict:
    """Seeded n=3 sampling (copy-on-write forks) over prompts sharing a prefix (prefix hits)."""
    prompts = [PROMPTS[0] + " and rich", PROMPTS[0] + " and poor"]
    sp = SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=8, ignore_eos=True)
    out = {}
    for tp in a.tp:
        with LLM(a.model, tensor_parallel_size=tp, **ENGINE) as llm:
            outs = llm.generate(prompts, sp, use_tqdm=False)
            out[f"tp{tp}"] = [[c.token_ids for c in o.outputs] for o in outs]
            out[f"tp{tp}_prefix_hits"] = llm.stats()["prefix_cache_hits"]
            pool = llm.engine.runner.cache.k[0].data      # HNDPages: [blocks, heads, tokens, dim]
            out[f"tp{tp}_cache_spec"] = list(getattr(pool.sharding, "spec", ()))
    return out


def _specs(tree) -> dict:
    return jax.tree.map(lambda x: list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec)),
                        tree)


def cmd_inspect(a) -> dict:
    with LLM(a.model, tensor_parallel_size=a.tp[0], **ENGINE) as llm:
        hlo = llm.compiled_step_text(32, 4)
        cache = llm.engine.runner.cache
        k, v = cache.k[0].data, cache.v[-1].data         # the CPU default: HNDPages
        return {"param_specs": _specs(llm.engine.runner.params),
                "kv_layout": llm.engine.runner.kv_spec.layout,
                "cache_specs": [_specs(k), _specs(v)],
                "cache_shard_shape": list(k.addressable_shards[0].data.shape),
                "mesh": dict(llm.engine.runner.mesh.shape),
                "num_layers": llm.model_config.num_layers,
                "all_reduces": sharding.count_all_reduces(hlo)}


def cmd_errors(a) -> dict:
    """Each bad layout must raise ValueError before any weight is read."""
    n = len(jax.devices())
    mesh2 = sharding.make_mesh(2)
    cases = {"tp_too_large": dict(tensor_parallel_size=n * 2),
             "dp_times_tp_too_large": dict(tensor_parallel_size=4, data_parallel_size=4),
             "tp_not_dividing": dict(tensor_parallel_size=3),
             "tp_zero": dict(tensor_parallel_size=0),
             "mesh_mismatch": dict(tensor_parallel_size=4, mesh=mesh2)}
    out = {}
    forbidden = AssertionError("weights were loaded")
    with mock.patch.object(engine, "load_model_files", side_effect=forbidden), \
            mock.patch.object(checkpoint, "restore_params", side_effect=forbidden):
        for name, kw in cases.items():
            try:
                (DataParallelLLM if "data_parallel_size" in kw else LLM)(a.model, **ENGINE, **kw)
                out[name] = "no error"
            except ValueError as e:
                out[name] = str(e)
    return out


def cmd_checkpoint(a) -> dict:
    """Sharded orbax round trip: convert, restore into shardings, compare bit for bit."""
    checkpoint.convert(a.model, a.ckpt, dtype="float32")
    tp = a.tp[0]
    loaded = load_model_files(a.model)
    want = params_from_hf(loaded.config, loaded.tensors, np.float32)
    mesh = sharding.make_mesh(tp)
    shardings = sharding.stored_param_shardings(loaded.config, mesh)
    got = checkpoint.restore_params(a.ckpt, param_shapes(loaded.config, np.float32), shardings)
    same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))
                                          and x.dtype == y.dtype), got, want)
    placed = jax.tree.map(lambda x, s: x.sharding == s, got, shardings)
    with LLM(a.model, **ENGINE) as ref:
        tokens_ref = greedy(ref, a.tokens)
    with LLM(a.ckpt, tensor_parallel_size=tp, **ENGINE) as llm:
        tokens_ckpt = greedy(llm, a.tokens)
    return {"bit_exact": all(jax.tree.leaves(same)), "in_shardings": all(jax.tree.leaves(placed)),
            "tokens_equal": tokens_ref == tokens_ckpt, "tokens": tokens_ckpt}


def cmd_distributed(a) -> dict:
    sharding.initialize_distributed(a.coordinator, a.num_processes, a.process_id)
    with LLM(a.model, tensor_parallel_size=a.tp[0], **ENGINE) as llm:
        tokens = greedy(llm, a.tokens)
        return {"tokens": tokens, "process_index": jax.process_index(),
                "global_devices": len(jax.devices()), "local_devices": len(jax.local_devices()),
                "processes_in_mesh": sorted({d.process_index for d in llm.engine.runner.mesh.devices.flat})}


def cmd_requests(a) -> dict:
    """SPEC_JSON: {"engine": LLM kwargs, "requests": [{"prompt", "params": SamplingParams
    kwargs}]} -> each request's completions' tokens as a server's logprobs name them
    (generated together)."""
    with open(a.ckpt) as f:
        spec = json.load(f)
    with LLM(a.model, tensor_parallel_size=a.tp[0], **spec["engine"]) as llm:
        outs = llm.generate([r["prompt"] for r in spec["requests"]],
                            [SamplingParams(**r["params"]) for r in spec["requests"]],
                            use_tqdm=False)
        return {"token_texts": [[[llm.tokenizer.token_bytes(t).decode("utf-8", errors="replace")
                                  for t in c.token_ids] for c in o.outputs] for o in outs]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["parity", "kv_parity", "forks", "inspect", "errors",
                                       "checkpoint", "distributed", "streaming",
                                       "offload", "scored", "requests"])
    p.add_argument("model")
    p.add_argument("ckpt", nargs="?")
    p.add_argument("--tp", type=int, nargs="+", default=[1])
    p.add_argument("--dp-tp", type=int, nargs=2, default=None)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--kv", nargs="+", default=["int8"], help="kv_parity: the KV cache dtypes")
    p.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="reference",
                   help="parity: pallas runs the kernels in interpret mode under shard_map")
    p.add_argument("--coordinator", default=None)
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    a = p.parse_args()
    result = globals()[f"cmd_{a.command}"](a)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
