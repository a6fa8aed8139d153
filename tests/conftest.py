import os
import sys

import pytest

# tests import their small helpers (paged_runner) as top-level modules, and what they share with
# the benchmarks from bench/lib (the ragged batch builder) through the repository root
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One fresh JAX compilation cache per test session, shared with its subprocesses (TP workers,
# the live server) through the environment: a run never deserializes executables that other
# processes on the machine (benchmarks, other sessions) wrote.
if "JAXKV_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAXKV_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxkv-test-jit-")

# Every CPU executable XLA loads holds its own memory mappings until it is freed, and one
# process may hold at most vm.max_map_count (65,530) of them: a full run that keeps every
# executable of every module alive died there (a segfault or an abort inside compile or cache
# load, ~1,000 tests in). So each module's executables are dropped when the module ends, and
# a module that alone piles up too many drops them between its tests.
MAX_MAPS = 40_000


def _num_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _drop_executables() -> None:
    if "jax" in sys.modules:
        import gc

        sys.modules["jax"].clear_caches()
        gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _free_executables_per_module():
    """After each module (its module fixtures, torn down first, included): drop its executables."""
    yield
    _drop_executables()


@pytest.fixture(autouse=True)
def _bound_executables_per_test():
    """After a test that leaves more than ``MAX_MAPS`` mappings: drop the cached executables."""
    yield
    if sys.platform == "linux" and _num_maps() > MAX_MAPS:
        _drop_executables()



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
