"""A chunk longer than vLLM's block on a hybrid model: resumable only where vLLM kept a GDN state at the chunk's
end, so the connector starts only where vLLM keeps one at every chunk end (a retention interval that divides the
chunk), and refuses at start, saying why, where it would not (a 384-token chunk of 128-token blocks hit 8 of 35
prompts against 29 at the default)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from vllmkit import C, run, settle, tokens


@pytest.mark.parametrize("retention,refused", [(0, True), (2 * C, True), (C, False), (3 * C, False)])
def test_chunk_longer_than_the_block_needs_a_state_at_every_chunk_end(serve, make_engine, retention, refused):
    srv = serve()
    if refused:
        with pytest.raises(ValueError, match=rf"chunk_tokens {3 * C} spans 3 of vLLM's {C}-token blocks.*"
                                             r"--prefix-cache-retention-interval that divides"):
            make_engine(srv.endpoint, chunk_tokens=3 * C, retention=retention)
        return
    eng = make_engine(srv.endpoint, chunk_tokens=3 * C, retention=retention, step_tokens=3 * C)
    a = tokens(7 * C + 3, 24)
    run(eng, "A", a)
    settle(eng)
    eng.add_request("B", a)
    so, _ = eng.step_until_scheduled()
    eng.run()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 6 * C  # the last whole chunk
