"""The fuzzer against a real server process: 20,000 mutated and garbage messages (nox -s fuzz runs 100,000)."""

from __future__ import annotations

import pytest
from fuzz_server import fuzz


@pytest.mark.slow
def test_fuzzed_messages_never_crash_or_grow_the_server(server_factory):
    srv = server_factory()
    res = fuzz(srv.endpoint, srv.pid, 20_000, seed=1, log=lambda *_: None)
    assert srv.alive() and res.server_alive, "the server died under fuzzing"
    assert res.unanswered == 0, f"{res.unanswered} messages got no answer"
    assert res.rss_end_mib - res.rss_warm_mib < 64, (res.rss_warm_mib, res.rss_end_mib)
    assert res.roundtrip_exact, "a store and retrieve after the fuzz did not return the stored bytes"
    assert res.errors_by_code.get("internal", 0) == 0, res.errors_by_code
    # the fuzz reached real handlers, not only the decoder
    for reached in ("LookupResult", "Prepared", "Retrieved", "Registered", "bad_message", "unknown_lease"):
        assert res.errors_by_code.get(reached, 0) > 0, (reached, res.errors_by_code)
