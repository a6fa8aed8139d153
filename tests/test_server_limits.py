"""``jaxkv serve``'s limits (issue 48): a port already in use fails before the engine is built,
``--max-request-bytes`` sets the body limit, and a SIGTERM drain that outlasts
``--shutdown-timeout`` aborts what is left and still exits 0. Live servers as in test_server.py.
"""

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from test_server import MAX_MODEL_LEN, NAME, LiveServer

LIMIT = 64 * 2**10


@pytest.fixture(scope="module")
def limited(tiny, tmp_path_factory):
    """A server with a 64 KiB body limit and a 0.2 s shutdown timeout; the last test SIGTERMs
    it."""
    live = LiveServer(tiny[0], tmp_path_factory.mktemp("serve") / "limited.log",
                      "--max-request-bytes", "64KiB", "--shutdown-timeout", "0.2")
    yield live
    live.stop()


def test_port_in_use_fails_fast_naming_the_port(tmp_path):
    """The address is bound before the engine is built: with a model that does not exist, the
    error is still the port's."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "jaxkv", "serve", "--model",
                            str(tmp_path / "no-such-model"), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
        took = time.monotonic() - start
    print(f"jaxkv serve on a taken port failed in {took:.1f} s")
    assert r.returncode == 2, r.stderr
    assert f"--port {port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert took < 30, took                      # Python and jax imports, no engine


def _post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=body, timeout=60,
                      headers={"content-type": "application/json"})


def test_max_request_bytes_sets_the_limit(limited):
    def body(size: int) -> bytes:
        head = {"model": NAME, "max_tokens": 2, "prompt": ""}
        return json.dumps({**head, "prompt": "x" * (size - len(json.dumps(head)))}).encode()

    assert len(body(LIMIT)) == LIMIT
    fits = _post(limited.url, body(LIMIT))
    assert fits.status_code == 400                  # read, then too long for max_model_len
    assert "max_model_len" in fits.json()["error"]["message"]
    over = _post(limited.url, body(LIMIT + 1))
    assert over.status_code == 413 and f"limit of {LIMIT} bytes" in over.json()["error"]["message"]


def test_sigterm_past_the_timeout_aborts_the_rest_and_exits_0(limited):
    """Last: a stream far longer than the 0.2 s drain (3 x 500 tokens) ends with an error
    event and [DONE]."""
    body = {"model": NAME, "prompt": "Emma", "max_tokens": MAX_MODEL_LEN - 12, "n": 3,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", limited.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        limited.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and error["message"] == (
        "the engine was shut down before this request finished"), error
    assert limited.proc.wait(30) == 0, limited.log()
    assert time.monotonic() - signalled < 20
    assert "Traceback" not in limited.log()
