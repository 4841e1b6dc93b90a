"""The connector with fenced commits (`kv_connector_extra_config` commit = "fenced", docs/protocol.md "Fenced
commits") inside a real vLLM engine: the stores of cold requests are published through their fence words, and
warm requests resumed from them continue exactly as the cold ones did. On this CPU the fence is written once the
copies are done (on CUDA the GPU writes it after them); the protocol and the connector's path are the same."""

from __future__ import annotations

from enginekit import BLOCK, close_llm, forget_local, generate, make_llm, prompt
from hybridkv import protocol as P
from hybridkv.engine.client import CacheClient


def test_fenced_commits_store_what_warm_requests_resume_exactly(model_dir, serve):
    server = serve(name="fenced")
    llm = make_llm(model_dir, server.endpoint, commit="fenced")
    try:
        prompts = [prompt(n, seed=900 + i) for i, n in enumerate((300, 777, 1300))]
        cold = generate(llm, prompts)
        forget_local(llm)  # waits for the stores; vLLM's own cache dropped and zeroed
        with CacheClient(server.endpoint, timeout_s=10) as c:
            st = c.call(P.Stats())[0].counters
        assert st["commits_fenced"] > 0 and st["fence_timeouts"] == 0, st
        assert st["objects_committed"] > 0
        warm = generate(llm, prompts)
        assert [g.cached for g in warm] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
        assert [g.tokens for g in warm] == [g.tokens for g in cold]
    finally:
        close_llm(llm)
