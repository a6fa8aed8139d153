import os
import sys
from pathlib import Path

import pytest

# tests import their small helpers (paged_runner) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))

# No persistent JAX compilation cache in the tests (their subprocesses inherit this): twice a
# full run died inside jax's cache read (deserializing a CPU executable the same run had
# written, in tests/test_speculative.py), with a machine-wide and with a fresh cache directory.
# tests/test_compile_cache.py turns it back on for the processes that test it.
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

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
