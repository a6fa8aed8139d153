"""Multi-host and kernels under tensor parallelism, on fake CPU devices (see tests/tp_runner.py).

* Two CPU processes joined by ``jax.distributed`` on 127.0.0.1 (2 devices each, one TP 4 mesh
  across both) run the identical host scheduler and produce the tokens of one process.
* The Pallas kernels (interpret mode) under ``shard_map`` give the tokens of the reference.
* Copy-on-write forks (seeded ``n = 3`` sampling) and prefix-cache hits give the same tokens
  under TP 4 as on one device, and the cache keeps its kv-head sharding through block copies.
"""

import json
import subprocess

import pytest

pytest.importorskip("torch")
from tp_runner import REPO, free_port, run_worker, worker_cmd, worker_env, write_tiny  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("llama"), "llama")


@pytest.mark.slow
def test_two_process_jax_distributed_matches_one_process(llama):
    ref = run_worker("parity", llama, "--tp", 1, devices=1)["tp1"]
    port = free_port()
    procs = [subprocess.Popen(
        worker_cmd("distributed", llama, "--tp", 4, "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", 2, "--process-id", i),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(2), cwd=REPO)
        for i in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for i, res in enumerate(results):
        assert res["process_index"] == i
        assert (res["global_devices"], res["local_devices"]) == (4, 2)
        assert res["processes_in_mesh"] == [0, 1]
        assert res["tokens"] == ref


def test_pallas_kernels_under_shard_map_match_the_reference(llama):
    ref = run_worker("parity", llama, "--tp", 1, "--tokens", 4)["tp1"]
    r = run_worker("parity", llama, "--tp", 2, 4, "--tokens", 4, "--attention-impl", "pallas",
                   devices=4)
    assert r["tp2"] == ref and r["tp4"] == ref     # TP 4 repeats each of the 2 kv heads


def test_forks_and_prefix_hits_under_tp_match_one_device(llama):
    r = run_worker("forks", llama, "--tp", 1, 4, devices=4)
    assert r["tp4"] == r["tp1"]
    assert r["tp4_prefix_hits"] == r["tp1_prefix_hits"] > 0
    assert r["tp4_cache_spec"] == [None, "tp"]
