"""Tensor parallelism over quantized weights, made at load (int8 per channel, int4 in groups
of 32) or a GGUF's blocks kept: the tokens and logprobs of one device, each device holding its
share of the codes and scales.

The multi-device checks run this file as a script in a subprocess with 4 fake CPU devices
(``tp_runner.worker_env``, as tests/test_sharding.py runs tests/tp_worker.py), which prints one
JSON line.
"""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from test_gguf import Q, austen, bpe, write_tiny_gguf  # noqa: F401  (fixtures)

ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=24,
              block_size=8, token_buckets=(16,), seq_buckets=(2,), dtype="float32")
PROMPTS = ["Emma Woodhouse, handsome, clever,", "and rich, with a comfortable home"]
# hidden 128 = 4 heads x 32, 2 kv heads (repeated at tp 4), intermediate 384: a device's share
# of o_proj's K (64, 32) and down_proj's (192, 96) is whole groups of 32
TINY = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
RUNS = (("int8", 128, (1, 2)), ("int4", 32, (1, 2, 4)))
CHECKPOINTS = {"gguf": ("tiny.gguf", None, 32), "int4": ("", "int4", 32)}   # model, convert's args
# K-quants (K = E = 256, split by rows) beside write_tiny_gguf's Q8_0 k, Q4_1 o / down, Q4_0 up
GGUF_K_QUANTS = {"attn_q": Q.Q4_K, "ffn_gate": Q.Q6_K}
GGUF_TPS = (1, 2, 4)   # FFN 128: tp 2 keeps the blocks; tp 4 (o_proj's K 64 / 4) dequantizes
# a compressed-tensors checkpoint (test_compressed_tensors' tiny Llama: o_proj's K 128, down's
# 256) in asymmetric int4 groups of 64: whole at tp 2, cut at tp 4 (o_proj 32 values a device)
CT_PRESET, CT_TPS = "W4A16_ASYM", (1, 2, 4)
# a float [N, K] (or [N, K / 32, 32]) of a whole weight (q, o: [128, 128]; gate, up [384, 128];
# down [128, 384]): the dequantized weight one device would hold after a gather
WHOLE = re.compile(r"\bf32\[(128,128|384,128|128,384|128,4,32|384,4,32|128,12,32)\]")


@pytest.fixture(scope="module")
def result(tmp_path_factory, bpe):  # noqa: F811
    pytest.importorskip("torch")
    import test_gguf
    from tiny_models import save_tiny_model, save_tokenizer
    from tp_runner import run_script

    path = tmp_path_factory.mktemp("tiny_qtp")
    save_tokenizer(path)
    save_tiny_model(path, "llama", **TINY)
    with pytest.MonkeyPatch.context() as mp:      # test_gguf's FFN 96 splits into 48-value K
        mp.setattr(test_gguf, "F", 128)
        write_tiny_gguf(path / "tiny.gguf", bpe, tied=True, qtypes=GGUF_K_QUANTS)
    if importlib.util.find_spec("compressed_tensors"):
        from test_compressed_tensors import write_compressed
        write_compressed(path / "ct", CT_PRESET)
    return run_script(__file__, path, devices=4, timeout=300)


@pytest.mark.parametrize("method", [m for m, _, _ in RUNS])
def test_tp_gives_the_tokens_and_logprobs_of_one_device(result, method):
    tps = dict((m, t) for m, _, t in RUNS)[method]
    ref = result[f"{method}_tp1"]
    assert all(len(t) == 6 for t in ref["tokens"])
    for tp in tps[1:]:
        run = result[f"{method}_tp{tp}"]
        assert run["tokens"] == ref["tokens"], tp
        assert max(abs(a - b) for x, y in zip(run["logprobs"], ref["logprobs"])
                   for a, b in zip(x, y)) < 1e-4, tp


@pytest.mark.parametrize("method", [m for m, _, _ in RUNS])
def test_each_device_holds_its_share_of_codes_and_scales(result, method):
    """Column-parallel rows split, row-parallel K split (int4's groups with it, int8's one
    scale a row replicated); at tp 4 the 2 kv heads' rows repeated to 4, one per device."""
    shards = result[f"{method}_tp2"]["shards"]
    int4 = method == "int4"
    codes = 64 if int4 else 128                          # K = 128 as stored: packed by 2
    assert shards["q_proj"] == [[64, codes], [64, 4 if int4 else 1]]
    assert shards["k_proj"] == [[32, codes], [32, 4 if int4 else 1]]
    assert shards["gate_proj"] == [[192, codes], [192, 4 if int4 else 1]]
    assert shards["o_proj"] == [[128, codes // 2], [128, 2 if int4 else 1]]
    assert shards["down_proj"] == [[128, 96 if int4 else 192], [128, 6 if int4 else 1]]
    if int4:
        assert result["int4_tp4"]["shards"]["k_proj"] == [[32, 64], [32, 4]]
        assert result["int4_tp4"]["shards"]["o_proj"] == [[128, 16], [128, 1]]


@pytest.mark.parametrize("method", [m for m, _, _ in RUNS])
def test_the_product_stays_split_and_the_plan_counts_one_device(result, method):
    """No float copy of a whole quantized weight and no gather of codes in the compiled step;
    the planner's weights are the bytes device 0 holds."""
    run = result[f"{method}_tp2"]
    assert run["whole_weights"] == [] and run["gathered_codes"] == 0
    for tp in dict((m, t) for m, _, t in RUNS)[method]:
        r = result[f"{method}_tp{tp}"]
        assert r["plan_weights"] == r["device0_bytes"], tp


def test_a_gguf_keeps_its_blocks_where_they_split_whole(result):
    """Q8_0 / Q4_0 / Q4_1 blocks and repacked Q4_K / Q6_K (2 x 2 of them) kept at tp 2 (whole
    32-value blocks a device), dequantized at tp 4 (o_proj's K = 64 over 4 devices cuts them):
    one device's tokens, the plan's weights the bytes device 0 holds."""
    runs = [result[f"gguf_tp{tp}"] for tp in GGUF_TPS]
    assert [r["kept"] for r in runs] == [13, 13, 0]
    for r in runs:
        assert r["tokens"] == runs[0]["tokens"]
        assert max(abs(a - b) for x, y in zip(r["logprobs"], runs[0]["logprobs"])
                   for a, b in zip(x, y)) < 1e-3      # logits of std ~16 (N(0, 1) weights)
        assert r["plan_weights"] == r["device0_bytes"]


def test_a_compressed_tensors_checkpoint_keeps_its_codes_where_its_groups_split_whole(result):
    """Asymmetric int4 in groups of 64 (14 projections) kept at tp 2, dequantized at tp 4 where
    o_proj's K of 128 over 4 devices would cut its groups (a GGUF's rule with the checkpoint's
    group, not the 32-value blocks): one device's tokens, the plan's weights device 0's bytes."""
    if "ct_tp1" not in result:
        pytest.skip("compressed-tensors is not installed (pip install compressed-tensors)")
    runs = [result[f"ct_tp{tp}"] for tp in CT_TPS]
    assert [r["kept"] for r in runs] == [14, 14, 0]
    for r in runs[1:]:
        assert r["tokens"] == runs[0]["tokens"]
        assert max(abs(a - b) for x, y in zip(r["logprobs"], runs[0]["logprobs"])
                   for a, b in zip(x, y)) < 1e-3
    for r in runs:
        assert r["plan_weights"] == r["device0_bytes"]


def test_a_checkpoint_restores_each_devices_share_as_the_source_load_places_it(result):
    """``jaxkv convert``'s checkpoints of the GGUF's blocks and of int4 (groups of 32) restored
    at tp 2: the tokens and logprobs of one device loading the source, each device's shards of
    codes and scales those of loading the source at tp 2, the plan's weights device 0's bytes;
    at tp 4 the GGUF's blocks would be cut (o_proj's K 64 / 4): refused naming the field."""
    for name, source in (("gguf", "gguf"), ("int4", "int4")):
        run, ref = result[f"ckpt_{name}_tp2"], result[f"{source}_tp1"]
        assert run["tokens"] == ref["tokens"], name
        assert max(abs(a - b) for x, y in zip(run["logprobs"], ref["logprobs"])
                   for a, b in zip(x, y)) < 1e-3, name
        assert run["shards"] == result[f"{source}_tp2"]["shards"], name
        assert run["kept"] == result[f"{source}_tp2"]["kept"] > 0, name
        assert run["plan_weights"] == run["device0_bytes"], name
    assert re.search(r"tensor 'o_proj' \[256, 64\] split over tensor_parallel_size=4 .*"
                     r"quantization_group_size", result["ckpt_gguf_tp4_error"])


def test_a_split_that_cuts_a_group_is_refused_naming_the_field(tmp_path):
    """int4 in groups of 128 over 2 devices: down_proj's K = 384 gives 192 values each (o_proj's
    K = 128 is one group a row, its scales replicated: no cut)."""
    from jaxkv.config import EngineConfig
    from jaxkv.runner.model_runner import check_quantization
    pytest.importorskip("torch")
    from tiny_models import save_tiny_model

    save_tiny_model(tmp_path, "llama", **TINY)
    ok = EngineConfig.from_kwargs(model=str(tmp_path), quantization="int4",
                                  quantization_group_size=32, tensor_parallel_size=2)
    check_quantization(ok, from_checkpoint=False)
    bad = EngineConfig.from_kwargs(model=str(tmp_path), quantization="int4",
                                   quantization_group_size=128, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"quantization='int4': tensor 'down_proj' \[128, 384\] "
                                         r"split over tensor_parallel_size=2 .* groups of 128 "
                                         r"\(quantization_group_size"):
        check_quantization(bad, from_checkpoint=False)


def _run(model: str, tp: int, *, hlo: bool = False, **kw) -> dict:
    """Greedy tokens and logprobs, the planned weights, device 0's bytes, layer 0's quantized
    weights' shard shapes there and how many weights are kept quantized, of one engine; with
    ``hlo`` the compiled step's whole weights and gathered codes."""
    import jax

    from jaxkv import LLM, SamplingParams
    from jaxkv.model.quantized import QuantizedWeight
    from tp_runner import quantized_run

    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    with LLM(model, tensor_parallel_size=tp, **kw, **ENGINE) as llm:
        done = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        runner = llm.engine.runner
        ws = {k: w for part in runner.params["layers"][0].values() if isinstance(part, dict)
              for k, w in part.items() if isinstance(w, QuantizedWeight)}
        kept = [w for w in jax.tree.leaves(runner.params, is_leaf=lambda w: isinstance(
            w, QuantizedWeight)) if isinstance(w, QuantizedWeight)]
        out = quantized_run(done, runner, ws) | dict(kept=len(kept))
        if hlo:
            text = runner.compiled_step_text(16, 2)
            out["whole_weights"] = WHOLE.findall(text)
            out["gathered_codes"] = len(re.findall(r"[su]8\[[\d,]*\][^\n]*all-gather\(", text))
    return out


def _worker(path: str) -> dict:
    """Each run of ``RUNS`` (at tp 2 with the compiled step's checks) and of the GGUF at
    ``GGUF_TPS``."""
    import jax

    assert jax.device_count() == 4
    out = {f"{method}_tp{tp}": _run(path, tp, hlo=tp == 2, quantization=method,
                                    quantization_group_size=group)
           for method, group, tps in RUNS for tp in tps}
    out |= {f"gguf_tp{tp}": _run(f"{path}/tiny.gguf", tp) for tp in GGUF_TPS}
    if Path(path, "ct").is_dir():
        out |= {f"ct_tp{tp}": _run(f"{path}/ct", tp) for tp in CT_TPS}
    return out | _checkpoint_runs(path)


def _checkpoint_runs(path: str) -> dict:
    """Orbax checkpoints of the GGUF's kept blocks and of int4 in groups of 32 (``CHECKPOINTS``)
    restored at tp 2; the GGUF's at tp 4 (whose o_proj split cuts its blocks): the error."""
    from jaxkv.model import checkpoint

    out = {}
    for name, (model, method, group) in CHECKPOINTS.items():
        ckpt = f"{path}/ckpt_{name}"
        checkpoint.convert(Path(path, model), ckpt, quantization=method, group=group,
                           overwrite=True)
        out[f"ckpt_{name}_tp2"] = _run(ckpt, 2)
    try:
        _run(f"{path}/ckpt_gguf", 4)
        out["ckpt_gguf_tp4_error"] = "no error"
    except ValueError as e:
        out["ckpt_gguf_tp4_error"] = str(e)
    return out


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1])))
