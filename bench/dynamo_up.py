"""Brings up NVIDIA Dynamo's frontend and N jaxkv workers on this machine (file discovery, no
etcd or NATS), sends one chat request through the ``openai`` client, prints the URLs and waits
for Ctrl-C, then stops every process it started. The deployment tests/test_dynamo.py checks.

    python bench/dynamo_up.py --workers 2 [--router-mode kv] [-- engine flags for the workers]

Run it with the Python that has Dynamo (``pip install 'jaxkv[dynamo]'``; docs/dynamo.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository, for bench.lib

from bench.lib.dynamo_cluster import WORKER_ARGS, DynamoCluster  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--router-mode", default="kv",
                   help="the frontend's --router-mode: kv, round-robin, random ...")
    p.add_argument("--migration-limit", type=int, default=3)
    p.add_argument("--no-wait", action="store_true", help="stop after the smoke request")
    p.add_argument("engine_args", nargs="*", help=f"worker flags (default: {WORKER_ARGS})")
    a = p.parse_args()
    cluster = DynamoCluster(workers=a.workers, router_mode=a.router_mode,
                            worker_args=a.engine_args or WORKER_ARGS,
                            frontend_args=["--migration-limit", str(a.migration_limit)])
    try:
        t0 = time.monotonic()
        cluster.start()
        print(f"up in {time.monotonic() - t0:.0f} s: {cluster.base_url} (logs: {cluster.root})")
        for i, port in enumerate(cluster.system_ports):
            print(f"  worker {i}: http://127.0.0.1:{port}/metrics")
        smoke(cluster)
        if not a.no_wait:
            print("Ctrl-C stops everything")
            while all(proc.poll() is None for proc in cluster.processes()):
                time.sleep(1)
            print("a process exited:\n" + cluster.logs())
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()
    return 0


def smoke(cluster: DynamoCluster) -> None:
    import openai

    client = openai.OpenAI(base_url=cluster.base_url, api_key="-", max_retries=0)
    model = cluster.models()[0]
    r = client.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    print(f"{model}: {r.choices[0].message.content!r} ({r.usage.completion_tokens} tokens)")


if __name__ == "__main__":
    sys.exit(main())
