"""The package surface: import hygiene and the ``jaxkv`` command line."""

import json
import logging
import subprocess
import sys

import pytest

from jaxkv.entrypoints import cli


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
    assert imported_after("import jaxkv.attention.pallas, jaxkv.attention.reference, jaxkv.attention.dispatch",
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


def test_engine_flag_errors_name_the_flag_typed(capsys):
    assert cli.main(["plan", "--num-kv-blocks", "1"]) == 2
    assert "error: --num-kv-blocks=1 must be >= 2" in capsys.readouterr().err
    assert cli.main(["plan", "--memory-utilization", "2"]) == 2
    assert "error: --memory-utilization=2.0 must be in" in capsys.readouterr().err


def test_choice_flags_list_their_values(capsys):
    import dataclasses

    from jaxkv.config import EngineConfig

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = capsys.readouterr().out
    assert "--kv-cache-dtype {auto,fp32,bf16,fp16,fp8_e4m3,fp8_e5m2,int8,int4,int2," in text
    for t in EngineConfig.groups().values():
        for f in dataclasses.fields(t):
            if f.metadata.get("choices") and f.metadata["cli"]:
                values = ",".join(map(str, f.metadata["choices"]))
                assert f"--{f.name.replace('_', '-')} {{{values}" in text, f.name
    for flag in ("prefix-caching {hash,radix,none}", "speculative {ngram,suffix,draft,none}",
                 "sparse-attention {quest,none}"):
        assert flag in text


@pytest.mark.parametrize("argv, error", [
    (["--max-output-len", "0"], "--max-output-len=0 must be >= 1"),
    (["--min-output-len", "9", "--max-output-len", "4"],
     "--min-output-len=9 must be in [1, --max-output-len=4]"),
    (["--min-prompt-len", "0"], "--min-prompt-len=0 must be in [1, --max-prompt-len=256]"),
    (["--num-prompts", "0"], "--num-prompts=0 must be >= 1"),
])
def test_bench_lengths_are_checked_before_the_model_loads(argv, error, capsys):
    assert cli.main(["bench", *argv]) == 2
    assert f"jaxkv bench: error: {error}" in capsys.readouterr().err


def test_bench_shortest_lengths_default_to_at_most_the_longest():
    assert cli._length_range("output", None, 4, cli.BENCH_MIN_OUTPUT_LEN) == 4
    assert cli._length_range("output", None, 256, cli.BENCH_MIN_OUTPUT_LEN) == 16
    assert cli._length_range("prompt", 7, 7, cli.BENCH_MIN_PROMPT_LEN) == 7


def test_convert_over_a_checkpoint_names_the_flag(tmp_path, capsys):
    from jaxkv.model import checkpoint

    (tmp_path / checkpoint.PARAMS_DIR).mkdir()
    (tmp_path / checkpoint.METADATA_FILE).write_text("{}")
    assert cli.main(["convert", "--out", str(tmp_path)]) == 2
    assert "pass --overwrite to replace it" in capsys.readouterr().err


def test_the_library_leaves_logging_to_the_application():
    code = ("import logging, jaxkv.runner.model_runner, jaxkv.cpu_kernels, jaxkv.entrypoints.eval; "
            "log = logging.getLogger('jaxkv'); "
            "print(log.level, len(log.handlers), log.getEffectiveLevel())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["0", "0", str(logging.WARNING)]   # INFO stays quiet


def test_bench_sizes_the_engine_to_its_prompts_and_logs_by_default(request):
    pytest.importorskip("transformers")
    tiny = request.getfixturevalue("tiny")
    run = subprocess.run([sys.executable, "-m", "jaxkv", "bench", "--model", str(tiny[0]),
                          "--num-prompts", "3", "--max-prompt-len", "40", "--max-output-len", "6",
                          "--block-size", "8", "--max-num-batched-tokens", "64"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["max_num_seqs"] == 3 and result["max_model_len"] <= 46
    assert result["num_prompts"] == 3 and result["output_tokens"] >= 3
    log = run.stderr
    assert "INFO" in log and "KV pool:" in log      # the CLI shows the library's log
    assert f"compiling {result['warmup_step_variants']} step variants (" in log
    assert 1 <= result["warmup_step_variants"] <= 3
    assert "compiled on demand" not in log          # the dry run found every shape it ran
