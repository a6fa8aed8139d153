"""A local NVIDIA Dynamo deployment of jaxkv workers, for tests/test_dynamo.py and
bench/kv_routing.py: Dynamo's frontend (OpenAI HTTP, its router) and N jaxkv workers
(``python -m jaxkv.entrypoints.dynamo``), on one machine with file-based discovery (no etcd, no
NATS), every process this object starts stopped by ``close``.

    with DynamoCluster(workers=2, router_mode="kv") as c:
        client = openai.OpenAI(base_url=c.base_url, api_key="-")
        c.worker_metrics(0)["vllm:prefix_cache_hits_total"]
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
# small pools and buckets: two engines and the frontend share this machine
WORKER_ARGS = ("--max-model-len", "1024", "--max-num-seqs", "8")


def free_port(low: int = 20000, high: int = 32767) -> int:
    """A free TCP port in [low, high]: below 32768, as Dynamo 1.6 parses DYN_SYSTEM_PORT as
    an i16 ("invalid value unsigned int 57665, expected i16")."""
    for port in random.sample(range(low, high + 1), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}]")


class DynamoCluster:
    """Frontend + ``workers`` jaxkv workers (each ``worker_args``), logs under ``root``.

    Args:
      workers: how many jaxkv workers.
      router_mode: the frontend's ``--router-mode`` (``kv``, ``round-robin`` ...).
      worker_args: flags for every worker (engine flags; default ``WORKER_ARGS``).
      frontend_args: extra frontend flags (e.g. ``--migration-limit 3``).
      python: the interpreter with Dynamo installed (default: this one).
    """

    def __init__(self, workers: int = 2, router_mode: str = "kv",
                 worker_args=WORKER_ARGS, frontend_args=(), python: str = sys.executable,
                 root: str | None = None):
        self._own_root = root is None   # removed by close()
        self.root = Path(root or tempfile.mkdtemp(prefix="jaxkv-dynamo-cluster-"))
        self.python, self.router_mode = python, router_mode
        self.worker_args, self.frontend_args = list(worker_args), list(frontend_args)
        self.http_port = free_port()
        self.system_ports = [free_port() for _ in range(workers)]
        self.frontend: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = []
        (self.root / "kv").mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "DYN_FILE_KV": str(self.root / "kv"),
                    "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                    "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
                    "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def _spawn(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")
        return subprocess.Popen([self.python, "-m", *args], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout: float = 600) -> "DynamoCluster":
        """Starts everything and waits until the frontend routes to every worker.

        Raises:
          RuntimeError: a process exited or ``timeout`` passed (the logs' tails attached).
        """
        self.frontend = self._spawn("frontend", [
            "dynamo.frontend", "--discovery-backend", "file", "--router-mode",
            self.router_mode, "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            *self.frontend_args], self.env)
        for i, port in enumerate(self.system_ports):
            self.workers.append(self._spawn(f"worker{i}", [
                "jaxkv.entrypoints.dynamo", "--discovery-backend", "file",
                *self.worker_args], {**self.env, "DYN_SYSTEM_PORT": str(port)}))
        self.wait_for_workers(len(self.workers), timeout)
        return self

    def wait_for_workers(self, n: int, timeout: float) -> None:
        """Waits until ``n`` workers are registered and, with the KV router, the router knows
        exactly ``n``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.processes()):
                raise RuntimeError(f"a Dynamo process exited:\n{self.logs()}")
            if "Rejected incompatible workers" in (self.root / "frontend.log").read_text(
                    errors="replace"):   # their model cards differ: the router ignores them
                raise RuntimeError(f"the frontend rejected a worker:\n{self.logs()}")
            try:
                if self.registered() == n and self.models() and (
                        self.router_mode != "kv" or len(self.frontend_worker_ids()) == n):
                    time.sleep(2)   # the frontend's push router watches the same records
                    return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the frontend did not see {n} workers in {timeout} s:\n{self.logs()}")

    def processes(self) -> list[subprocess.Popen]:
        """The frontend and the workers not killed."""
        return [p for p in [self.frontend, *self.workers] if p is not None]

    def models(self) -> list[str]:
        import json

        with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as r:
            return [m["id"] for m in json.load(r)["data"]]

    def registered(self) -> int:
        """How many workers' model cards the file discovery store holds (SIGKILLed ones stay
        until their lease expires)."""
        mdc = self.root / "kv" / "v1" / "mdc"
        return len(list(mdc.iterdir())) if mdc.is_dir() else 0

    def frontend_worker_ids(self) -> set[str]:
        """The workers the frontend's router added and has not removed (from its log: its
        per-worker gauges appear only once a worker served a request)."""
        log = (self.root / "frontend.log").read_text(errors="replace")
        ids: set[str] = set()
        for verb, wid in re.findall(r"(Adding|Removing) worker WorkerWithDpRank \{ worker_id: "
                                    r"(\d+)", log):
            (ids.add if verb == "Adding" else ids.discard)(wid)
        return ids

    def worker_metrics(self, i: int) -> dict[str, float]:
        """Worker ``i``'s metrics (its system port's ``/metrics``), summed over labels other
        than the worker's own, by ``name`` and ``name{label=value}`` for ``finished_reason``."""
        out: dict[str, float] = {}
        for s in scrape(f"http://127.0.0.1:{self.system_ports[i]}/metrics"):
            key = s.name + (f'{{finished_reason="{s.labels["finished_reason"]}"}}'
                            if "finished_reason" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
        return out

    def kill_worker(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.workers[i]
        if p is not None and p.poll() is None:
            os.killpg(p.pid, sig)
            p.wait(timeout=30)
        self.workers[i] = None

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}"
                         for f in sorted(self.root.glob("*.log")))

    def close(self) -> None:
        """SIGTERM to every process group this cluster started, SIGKILL after 20 s; removes
        the logs' directory unless the caller gave it."""
        procs = self.processes()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.workers, self.frontend = [], None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "DynamoCluster":
        try:
            return self.start()
        except BaseException:   # __exit__ does not run when __enter__ raises
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


def scrape(url: str):
    """The samples of a Prometheus text endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        yield from family.samples
