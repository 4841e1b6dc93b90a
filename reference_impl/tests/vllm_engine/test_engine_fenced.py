"""The connector with fenced commits (`kv_connector_extra_config` commit = "fenced", docs/protocol.md "Fenced
commits") inside a real vLLM engine: the stores of cold requests are published through their fence words, and
warm requests resumed from them continue exactly as the cold ones did. On this CPU the fence is written once the
copies are done (on CUDA the GPU writes it after them); the protocol and the connector's path are the same."""

from __future__ import annotations

from enginekit import (
    BLOCK,
    close_llm,
    departures,
    forget_local,
    generate,
    make_llm,
    prefix_reads,
    prompt,
    unlike_stored,
    watch_prefix_reads,
)
from hybridkv.engine.client import CacheClient
from hybridkv.wire import protocol as P


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
        watch_prefix_reads(llm)
        warm = generate(llm, prompts)
        assert [g.cached for g in warm] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
        # the bytes each warm forward read its prefix from are the server's objects, page for page; the tokens
        # continue the cold runs (up to a near-tie of the random-weight model, under another step layout)
        reads = prefix_reads(llm)
        assert sorted(len(r.tokens) for r in reads) == sorted(g.cached for g in warm)
        assert not (bad := [why for r in reads if (why := unlike_stored(llm, server.endpoint, r))]), bad
        assert not (bad := departures(warm, cold)), bad
    finally:
        close_llm(llm)
