"""Orbax checkpoints of quantized weights (``jaxkv convert --quantization``): a GGUF's kept
blocks or weights quantized by ``convert`` restore as the same ``QuantizedWeight`` leaves bit
for bit, the restored engine generates the tokens of the engine that loads the source, the
planner counts the stored bytes, and a ``quantization`` other than the checkpoint holds is
refused naming the field before any weight is read.

The tensor-parallel restore (each device's share of codes and scales read from disk) runs in
tests/test_quantized_tp.py's 4-device worker."""

from unittest import mock

import jax
import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.entrypoints import cli
from jaxkv.model import checkpoint, quantize
from jaxkv.model.llama import param_shapes, params_from_hf
from jaxkv.model.quantized import QuantizedWeight
from jaxkv.model.weights import load_model_files
from test_gguf import austen, bpe, write_tiny_gguf  # noqa: F401  (fixtures)

# (convert's quantization, its group): a GGUF's Q8_0 / Q4_0 / Q4_1 blocks as stored, and the
# dense projections of the dequantized file quantized as LLM(quantization=...) does
RECIPES = ((None, 128), ("int8", 128), ("fp8", 128), ("int4", 32), ("none", 128))
ENGINE = dict(max_num_seqs=4, max_model_len=128)
PROMPTS = ["It is a truth universally", "Emma Woodhouse, handsome,", "Mr. Knightley", "She was"]


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bpe):  # noqa: F811
    path = tmp_path_factory.mktemp("ckpt_quantized") / "tiny.gguf"
    write_tiny_gguf(path, bpe, tied=True)
    return path


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """{(quantization, group): checkpoint dir} of ``RECIPES``, written by ``jaxkv convert``."""
    out = {}
    for q, group in RECIPES:
        path = tmp_path_factory.mktemp(f"ckpt_{q}")
        argv = ["convert", "--model", str(tiny), "--out", str(path), "--overwrite",
                "--quantization-group-size", str(group)]
        assert cli.main(argv + ([] if q is None else ["--quantization", q])) == 0
        out[q, group] = path
    return out


def source_params(tiny, q, group):
    """The params an engine builds from the GGUF with ``quantization=q``."""
    loaded = load_model_files(tiny, keep_quantized=q is None)
    tensors = loaded.tensors
    if q in quantize.METHODS:
        tensors = quantize.quantize_tensors(tensors, q, group, loaded.source)
    return params_from_hf(loaded.config, tensors, np.float32, source=loaded.source)


def bits(a) -> np.ndarray:
    """The array's bytes (fp8 compared bit for bit, not by value)."""
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r[0]}-g{r[1]}")
def test_every_leaf_restores_bit_for_bit(tiny, converted, recipe):
    """Codes, scales, minima, qtype, logical shape and group of each quantized weight, and
    each float leaf, equal the source's; the metadata records how the weights were made."""
    q, group = recipe
    want = source_params(tiny, q, group)
    shapes = param_shapes(checkpoint.read_config(converted[recipe]), np.float32)
    got = checkpoint.restore_params(converted[recipe], shapes)   # as the engine restores
    assert jax.tree.structure(got) == jax.tree.structure(want)   # static fields included
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))
    kept = [w for w in jax.tree.leaves(got, is_leaf=is_quantized) if is_quantized(w)]
    held, held_group, kinds = checkpoint.read_quantization(converted[recipe])
    if q is None:
        assert (held, held_group, set(kinds)) == (checkpoint.AS_STORED, None,
                                                  {"Q8_0", "Q4_0", "Q4_1"})
        assert len(kept) == 2 * 4 + 1                # k, o, up, down of 2 layers, the embedding
    elif q == "none":
        assert (held, kept) == ("none", [])
    else:
        assert (held, held_group) == (q, group if q == "int4" else None)
        assert len(kept) == 2 * 7                    # the dense projections of 2 layers


def test_restored_engine_generates_the_source_engines_tokens(tiny, converted):
    """Greedy tokens and logprobs of LLM(checkpoint) equal LLM(gguf) with the same
    quantization, and the planner counts the restored arrays' bytes as the source's."""
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    for q, group in ((None, 128), ("int4", 32)):
        path = converted[q, group]
        runs = []
        for model, kw in ((tiny, dict(quantization=q, quantization_group_size=group)),
                          (path, {})):
            with LLM(model=str(model), **kw, **ENGINE) as llm:
                outs = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
                runner = llm.engine.runner
                runs.append(([o.token_ids for o in outs],
                             [[lp[t] for t, lp in zip(o.token_ids, o.logprobs)] for o in outs],
                             runner.memory_plan.weights_bytes,
                             sum(x.nbytes for x in jax.tree.leaves(runner.params))))
        (src_tokens, src_lp, src_plan, src_bytes), (tokens, lp, plan, nbytes) = runs
        assert tokens == src_tokens, q
        np.testing.assert_array_equal(lp, src_lp, err_msg=str(q))
        assert nbytes == src_bytes and plan == nbytes, q


def test_other_quantization_than_held_is_refused_before_weights_load(converted):
    forbidden = AssertionError("weights were read")
    cases = [
        (converted[None, 128], dict(quantization="int8"),
         r"quantization='int8': .* holding its source's Q8_0/.* weights as stored; load it "
         r"with quantization=None \(as stored\) or convert the model again with jaxkv convert "
         r"--quantization int8"),
        (converted[None, 128], dict(quantization="none"), r"quantization='none': "),
        (converted["int8", 128], dict(quantization="fp8"),
         r"quantization='fp8': .* holding int8 weights;"),
        (converted["int4", 32], dict(quantization="int4"),           # the default group 128
         r"quantization_group_size=128: .* holding int4 weights in groups of 32;"),
        (converted["none", 128], dict(quantization="int4", quantization_group_size=32),
         r"quantization='int4': .* holding float weights;"),
    ]
    with mock.patch.object(checkpoint, "restore_params", side_effect=forbidden):
        for path, kw, error in cases:
            with pytest.raises(ValueError, match=error):
                LLM(model=str(path), **kw, **ENGINE)
    # what the checkpoint holds, asked by name, is read as stored
    with LLM(model=str(converted["int4", 32]), quantization="int4", quantization_group_size=32,
             **ENGINE) as llm:
        assert llm.engine.runner.params["layers"][0]["mlp"]["down_proj"].group == 32


def test_convert_checks_its_arguments_before_reading(tiny, tmp_path, capsys):
    with mock.patch.object(checkpoint, "load_model_files",
                           side_effect=AssertionError("weights were read")):
        with pytest.raises(ValueError, match=r"quantization='int5': one of None \(as stored\)"):
            checkpoint.convert(tiny, tmp_path, quantization="int5")
        with pytest.raises(ValueError, match=r"quantization_group_size=48: must be a positive "
                                             r"multiple of 32"):
            checkpoint.convert(tiny, tmp_path, quantization="int4", group=48)
        assert cli.main(["convert", "--model", str(tiny), "--out", str(tmp_path),
                         "--quantization", "int4", "--quantization-group-size", "40"]) == 2
    assert "quantization_group_size=40: must be a positive multiple of 32" in \
        capsys.readouterr().err
