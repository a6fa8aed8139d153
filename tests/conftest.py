import os
import sys
from pathlib import Path

import pytest

# tests import their small helpers (paged_runner) as top-level modules
sys.path.insert(0, os.path.dirname(__file__))

# ../shared beside the repository (the session's checkout and CI's clone both have it there)
SHARED = Path(__file__).resolve().parents[2] / "shared"
AUSTEN_DIR = SHARED / "data" / "austen"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, torch model) of a tiny random Llama written by transformers, with a tokenizer."""
    from tiny_models import save_tiny_model, save_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    save_tokenizer(path)
    return path, save_tiny_model(path, "llama")
