"""vLLM's reset of the external cache (`LLM.reset_prefix_cache(reset_connector=True)`, the OpenAI server's
`POST /reset_prefix_cache?reset_external=true`) drops what the deployment stored in hybridkv: the next request
is no hit and recomputes the same tokens, and later stores are hits again."""

from __future__ import annotations

from enginekit import BLOCK, external_hits, forget_local, generate, prompt


def test_reset_connector_drops_the_deployment_s_objects(llm, server):
    prompts = [prompt(n, seed=300 + i) for i, n in enumerate([300, 700, 1100])]
    cold = generate(llm, prompts)
    forget_local(llm)
    assert llm.reset_prefix_cache(reset_connector=True)  # the connector confirmed the server's drop
    forget_local(llm)
    hits = external_hits(llm)
    after = generate(llm, prompts)
    assert [g.tokens for g in after] == [g.tokens for g in cold]
    assert [g.cached for g in after] == [0, 0, 0] and external_hits(llm) == hits
    # the cache works on after a reset: what was just recomputed is stored and hit again
    forget_local(llm)
    warm = generate(llm, prompts)
    assert [g.tokens for g in warm] == [g.tokens for g in cold]
    assert [g.cached for g in warm] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]


def test_reset_with_the_server_down_says_so(llm, server):
    import time

    server.stop()
    t0 = time.monotonic()
    assert llm.reset_prefix_cache(reset_connector=True) is False
    assert time.monotonic() - t0 < 10  # the connector's bound (5 s), not the transfer timeout
