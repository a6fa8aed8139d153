"""DeepSeek MLA under tensor parallelism (issue 53): the query heads, W_UK / W_UV and o_proj
split over the devices, the latent pool whole on each; tp 2 and 4 give tp 1's greedy tokens
and logprobs (fp32; the fp8 latent: tp 1's fp8) through chunked prefill (the expanded form),
prefix hits and batched decode (absorbed), on tiny V2 (no q LoRA) and V3 (q LoRA) checkpoints.

The multi-device runs are this file as a script in a subprocess with 4 fake CPU devices
(``tp_runner.worker_env``), which prints one JSON line.
"""

import json
import re
import sys
from unittest import mock

import jax
import numpy as np
import pytest

ENGINE = dict(max_model_len=96, max_num_seqs=3, max_num_batched_tokens=32, block_size=8,
              token_buckets=(32,), seq_buckets=(4,), num_kv_blocks=24,
              prefix_caching="hash", dtype="float32")
NEW_TOKENS = 5
# the engine's variants: the CPU path; the Pallas MLA decode kernel (interpreted); swap
# preemption (a 10-block pool: the host tier takes each device's copy of the latent blocks)
VARIANTS = {"grouped": dict(attention_impl="grouped"),
            "pallas": dict(attention_impl="pallas", interpret=True, kv_layout="nhd"),
            "swap": dict(num_kv_blocks=10, max_model_len=64, kv_offload_bytes=1 << 20,
                         preemption_mode="swap")}
# (checkpoint, tp, kv_cache_dtype, variant) -> its run; SLOW's compare with RUNS' tp 1 grouped
RUNS = [("deepseek_v2", 1, "auto", "grouped"), ("deepseek_v2", 2, "auto", "grouped"),
        ("deepseek_v3", 1, "auto", "grouped"), ("deepseek_v3", 4, "auto", "grouped"),
        ("deepseek_v3", 1, "fp8", "grouped"), ("deepseek_v3", 2, "fp8", "grouped")]
# "pallas": tests/test_pallas_mla.py's checkpoint (rotary 16, as the MLA decode kernel needs)
SLOW = [("deepseek_v2", 4, "auto", "grouped"), ("deepseek_v3", 2, "auto", "grouped"),
        ("pallas", 1, "auto", "grouped"), ("pallas", 2, "auto", "pallas"),
        ("deepseek_v3", 2, "auto", "swap")]
N, P, V, LATENT, E = 4, 16, 12, 32 + 8, 64          # heads, nope, value, latent + rope, hidden


def _key(arch, tp, kv, variant) -> str:
    return f"{arch}_tp{tp}_{kv}_{variant}"


def _heads_seen(module, name: str, seen: set):
    """A patch of ``module.name`` recording the heads (axis 1) of its first argument, a query,
    each time it is traced (under ``shard_map``: one device's)."""
    fn = getattr(module, name)

    def traced(*args, **kw):
        seen.add(args[0].shape[1])
        return fn(*args, **kw)

    return mock.patch.object(module, name, traced)


def _run(path: str, tp: int, kv: str, variant: str) -> dict:
    """The workload's tokens and logprobs, the prefix hits, the shard shapes one device holds
    of layer 0's latent pool and projections, and the query heads the expanded prefill and the
    Pallas decode kernel were traced with."""
    import jaxkv.attention.pallas.mla_decode as kernel
    import jaxkv.model.mla as layer

    expanded, decoded = set(), set()
    with _heads_seen(layer, "mla_prefill_attention", expanded), \
            _heads_seen(kernel, "mla_decode_step", decoded):
        out = _generate(path, tp, kv, variant)
    return out | {"expanded_heads": sorted(expanded), "kernel_heads": sorted(decoded)}


def _generate(path: str, tp: int, kv: str, variant: str) -> dict:
    """Three requests, the first alone, then two together, one sharing its 3-block prefix
    (prefix hits); the first two prompts of 40+ tokens (a 32-token chunk: expanded, the rest
    absorbed)."""
    from jaxkv import LLM, SamplingParams
    from jaxkv.runner import sharding

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(path, tensor_parallel_size=tp, kv_cache_dtype=kv,
             **(ENGINE | VARIANTS[variant])) as llm:
        ids = llm.tokenizer.encode(" ".join(["Emma Woodhouse, handsome, clever, and rich,"] * 30))
        shared = ids[:24]                          # 3 blocks a later request finds cached
        prompts = [shared + ids[30:50], ids[60:100], shared + ids[110:115]]   # 44 / 40: chunked
        outs = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params,
                             use_tqdm=False)
        runner = llm.engine.runner
        attn = runner.params["layers"][0]["self_attn"]
        shard = {name: list(x.addressable_shards[0].data.shape) for name, x in attn.items()
                 if isinstance(x, jax.Array)}
        pool = jax.tree.leaves(runner.cache.k[0])
        plain = tp > 1 and (kv, variant) == ("auto", "grouped")
        hlo = llm.compiled_step_text(32, 4) if plain else ""
        return {"tokens": [o.outputs[0].token_ids for o in outs],
                "logprobs": [[lp[t] for lp, t in zip(o.outputs[0].logprobs,
                                                     o.outputs[0].token_ids)] for o in outs],
                "hits": llm.stats()["prefix_cache_hits"], "shards": shard,
                "swapped": llm.stats().get("num_swap_preemptions", 0),
                "pool": [[list(a.shape), list(a.addressable_shards[0].data.shape),
                          len(a.sharding.device_set)] for a in pool],
                "plan": [runner.memory_plan.kv_bytes_per_block, runner.memory_plan.num_blocks],
                "collectives": [sharding.count_all_reduces(hlo),
                                len(re.findall(r"all-gather(?:-start)?\(", hlo))]}


def _refusal(path: str) -> str:
    from jaxkv import LLM

    try:
        LLM(path, tensor_parallel_size=3, **ENGINE)
    except ValueError as e:
        return str(e)
    return "no error"


def main(root: str, runs: str) -> None:
    out = {_key(*r): _run(f"{root}/{r[0]}", *r[1:]) for r in globals()[runs]}
    if runs == "RUNS":
        out["refusal"] = _refusal(f"{root}/deepseek_v2")
    print(json.dumps(out), flush=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny random V2 and V3 checkpoints (tests/test_mla.py's shapes) and SLOW's "pallas"
    one: their folder."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_mla import ARCHITECTURES, MLA_SHAPES
    from test_pallas_mla import TINY_MLA
    from tiny_models import save_tiny_model, save_tokenizer

    root = tmp_path_factory.mktemp("mla_tp")
    models = {a: (a, MLA_SHAPES | ARCHITECTURES[a]) for a in ARCHITECTURES}
    models["pallas"] = ("deepseek_v2", TINY_MLA)
    for name, (kind, fields) in models.items():
        save_tokenizer(root / name)
        save_tiny_model(root / name, kind, **fields)
    return root


def _launch(root, runs: str) -> dict:
    from tp_runner import run_script

    return run_script(__file__, root, runs, devices=4, timeout=600)


@pytest.fixture(scope="module")
def result(checkpoints):
    return _launch(checkpoints, "RUNS")


@pytest.fixture(scope="module")
def slow_result(checkpoints):
    return _launch(checkpoints, "SLOW")


def _assert_same_run(run, ref):
    """Greedy tokens of tp 1 and logprobs within 1e-4 (fp32), the shared prefix hit."""
    assert all(len(t) == NEW_TOKENS for t in ref["tokens"])
    assert run["tokens"] == ref["tokens"]
    for got, want in zip(run["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert run["hits"] == ref["hits"] >= 16


@pytest.mark.parametrize("run", [r for r in RUNS if r[1] > 1], ids=lambda r: _key(*r))
def test_tp_gives_one_devices_tokens_and_logprobs(result, run):
    """tp 1's tokens and logprobs; the expanded prefill ran on each device's N / tp heads."""
    _assert_same_run(result[_key(*run)], result[_key(run[0], 1, *run[2:])])
    assert result[_key(*run)]["expanded_heads"] == [N // run[1]]


@pytest.mark.slow
@pytest.mark.parametrize("run", SLOW, ids=lambda r: _key(*r))
def test_more_tp_sizes_the_pallas_kernel_and_swapping(result, slow_result, run):
    """The other tp sizes; the Pallas path (decode-only steps in its MLA kernel, traced on
    each device's N / tp heads) and swap preemption, against tp 1's grouped path."""
    runs = result | slow_result
    _assert_same_run(runs[_key(*run)], runs[_key(run[0], 1, run[2], "grouped")])
    assert runs[_key(*run)]["kernel_heads"] == ([N // run[1]] if run[3] == "pallas" else [])
    assert (runs[_key(*run)]["swapped"] > 0) == (run[3] == "swap")


@pytest.mark.parametrize("arch,tp", [("deepseek_v2", 2), ("deepseek_v3", 4)])
def test_each_device_holds_its_heads_and_the_whole_latent(result, arch, tp):
    """q / q_b, W_UK, W_UV and o_proj hold N / tp heads; the latent's down-projections and
    every latent pool row [.., 1, Lkv + R] are whole on each of the tp devices, so the plan's
    KV bytes per block and block count are tp 1's; the compiled step's collectives are the
    row-parallel products' all-reduces (none gathers the heads or the latent)."""
    run, ref = result[_key(arch, tp, "auto", "grouped")], result[_key(arch, 1, "auto", "grouped")]
    s, h = run["shards"], N // tp
    q = s["q_b_proj"] if arch == "deepseek_v3" else s["q_proj"]
    assert q[1:] == [h, P + 8] and s["k_up"] == [32, h, P] and s["v_up"] == [32, h, V]
    assert s["o_proj"] == [h, V, E] and s["kv_a_proj"] == [E, LATENT]
    if arch == "deepseek_v3":
        assert s["q_a_proj"] == [E, 24]
    (shape, device_shape, devices), = run["pool"]
    assert shape == device_shape == [24, 1, 8, LATENT] and devices == tp      # HND on CPU
    assert run["plan"] == ref["plan"]
    # the embedding's, o_proj's (x2), the dense, shared and routed experts' down: no collective
    # for the attention; one all-gather, of the vocab-split logits
    assert run["collectives"] == [6, 1]


def test_fp8_latent_pool_is_whole_on_each_device(result):
    """fp8 codes and their per-token scales, both replicated."""
    pool = result[_key("deepseek_v3", 2, "fp8", "grouped")]["pool"]
    assert [p[0] for p in pool] == [[24, 8, 1, LATENT], [24, 8, 1, 1]]
    assert all(shape == device_shape and devices == 2 for shape, device_shape, devices in pool)


def test_a_tp_that_does_not_divide_the_heads_is_refused(result):
    assert "tensor_parallel_size=3 cannot split this model: num_heads=4 is not divisible by 3" \
        in result["refusal"]


def test_planner_counts_the_replicated_latent_and_projections():
    """A V3-shaped plan at tp 8: each device's KV is the whole latent (tp 1's bytes a token);
    its weights are tp 1's / 8 plus 7/8 of what stays whole (norms, the latent
    down-projections, routers), as the device's share of every checkpoint tensor sums; a
    quantized o_proj's split is checked on its K = N x V."""
    from jaxkv.model.config import ModelConfig
    from jaxkv.model.deepseek_names import expected_shapes, replicated
    from jaxkv.runner import device_shares, memory_plan, sharding
    from test_mla import V3

    c = ModelConfig.from_hf_dict(V3)
    assert memory_plan.kv_bytes_per_token(c, "bf16", 8) == memory_plan.kv_bytes_per_token(
        c, "bf16")
    whole = sum(np.prod(s) for n, s in expected_shapes(c).items() if replicated(n))
    split = memory_plan.num_parameters(c) - whole
    assert memory_plan.weights_bytes(c, "bfloat16", 8) == 2 * (whole + split // 8)
    shapes = device_shares.device_tensor_shapes(c, 8)
    assert shapes["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shapes["model.layers.3.self_attn.kv_b_proj.weight"] == (128 * 256 // 8, 512)
    assert sharding.valid_tensor_parallel_sizes(c, 8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match=r"'o_proj' \[7168, 16384\]"):   # K = N x V, not N x 576
        sharding.check_quantized_split(c, 4096, 8)


if __name__ == "__main__":
    main(*sys.argv[1:])
