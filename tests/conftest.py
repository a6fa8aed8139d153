import os
import sys
from pathlib import Path

import pytest

# tests import their small helpers (paged_runner) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))

# One fresh JAX compilation cache per test session, shared with its subprocesses (TP workers,
# the live server) through the environment: a run never deserializes executables that other
# processes on the machine (benchmarks, other sessions) wrote, possibly while it reads them
# (a shared cache segfaulted the suite once inside jax's cache read).
if "JAXKV_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAXKV_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxkv-test-jit-")

# ../shared beside the repository (the session's checkout and CI's clone both have it there)
SHARED = Path(__file__).resolve().parents[2] / "shared"
AUSTEN_DIR = SHARED / "data" / "austen"


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    """One ``jaxkv.LLM`` on the tiny model with ``tiny_models.TINY_ENGINE`` limits, per module."""
    from jaxkv import LLM
    from tiny_models import TINY_ENGINE

    with LLM(str(tiny[0]), **TINY_ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, torch model) of a tiny random Llama written by transformers, with a tokenizer."""
    from tiny_models import save_tiny_model, save_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    save_tokenizer(path)
    return path, save_tiny_model(path, "llama")
