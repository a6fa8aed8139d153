"""The package surface: import hygiene and the ``jaxkv`` command line."""

import json
import subprocess
import sys

import pytest

from jaxkv import cli


def imported_after(statement, modules):
    """Which of ``modules`` a fresh interpreter has imported after running ``statement``."""
    code = (f"import json, sys; {statement}; "
            f"print(json.dumps(sorted(m for m in {modules!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_import_jaxkv_does_not_import_torch_or_transformers():
    assert imported_after("import jaxkv; from jaxkv import LLM, SamplingParams, plan",
                          ("torch", "transformers")) == []


def test_import_pallas_needs_only_jax():
    assert imported_after("import jaxkv.pallas, jaxkv.attention, jaxkv.attention_impl",
                          ("flax", "tqdm", "tokenizers")) == []


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for sub in ("generate", "chat", "bench", "plan"):
        assert sub in text


def test_plan_from_config_json(tmp_path, capsys):
    cfg = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=8192)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = cli.main(["plan", "--model", str(tmp_path / "config.json"), "--device-memory", "80GiB",
                   "--dtype", "bfloat16", "--max-model-len", "8192", "--max-num-seqs", "16"])
    out = capsys.readouterr().out
    # Llama-3-8B shape: 2 x 32 layers x 8 kv heads x 128 x 2 B = 131072 B per token in bf16
    assert "131,072 B" in out
    assert rc == 0 and "runs / fits" in out


def test_plan_that_cannot_run_exits_nonzero_with_reasons(tmp_path, capsys):
    cfg = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = cli.main(["plan", "--model", str(tmp_path), "--device-memory", "8GiB",
                   "--dtype", "float32"])
    assert rc == 1
    assert "weights" in capsys.readouterr().out


def test_bad_size_and_unknown_model_are_clear(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--device-memory", "lots"])
    assert "not a size" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err
