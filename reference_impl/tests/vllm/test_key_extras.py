"""What vLLM's own prefix cache keys a block by beside its tokens, in chunk keys, under vLLM's real scheduler:
requests with another LoRA adapter or another image never share a hit, the same adapter or image does, and the
chunks before an image are shared by every request with that text."""

from __future__ import annotations

import pytest

# "vllm.config", not "vllm": without vLLM, this folder would import as a namespace package named vllm
pytest.importorskip("vllm.config", reason="vLLM is not installed here; `nox -s vllm` builds an environment with it")
from vllmkit import C, sched_stats, settle, tokens


def hit(eng, rid: str, toks: list[int], **kw) -> int:
    """The external hit vLLM's scheduler took for a new request; the request then runs to its end (and stores)."""
    hits = sched_stats(eng).hit_tokens
    eng.add_request(rid, toks, **kw)
    so, rep = eng.step_until_scheduled()
    assert rep.corrupt_pages == 0
    assert eng.run().corrupt_pages == 0
    settle(eng)  # vLLM's own prefix cache is dropped: the next hit can only come from hybridkv
    assert so.scheduled_new_reqs[0].num_computed_tokens == sched_stats(eng).hit_tokens - hits
    return sched_stats(eng).hit_tokens - hits


def test_lora_adapters_never_share_a_hit(serve, make_engine):
    eng = make_engine(serve().endpoint, max_loras=2)  # as under --enable-lora --max-loras 2
    a = tokens(4 * C + 9, 40)
    assert hit(eng, "A", a, lora=("tenant-a", 1)) == 0
    assert hit(eng, "B", a, lora=("tenant-b", 2)) == 0      # another adapter: nothing of A's
    assert hit(eng, "C", a) == 0                            # the base model: nothing of either
    assert hit(eng, "D", a, lora=("tenant-a", 1)) == 4 * C  # A's adapter again: A's chunks
    assert hit(eng, "E", a, lora=("tenant-b", 2)) == 4 * C


def test_images_never_share_a_hit_past_their_placeholders(serve, make_engine):
    eng = make_engine(serve().endpoint)
    a = tokens(5 * C + 9, 41)
    cat, dog = [("mm-hash-cat", C + 10, 50)], [("mm-hash-dog", C + 10, 50)]  # an image inside chunk 1
    assert hit(eng, "A", a, images=cat) == 0
    assert hit(eng, "B", a, images=dog) == C    # the same placeholder tokens, another image: chunk 0 only
    assert hit(eng, "C", a) == C                # no image at all: chunk 0 only
    assert hit(eng, "D", a, images=cat) == 5 * C
    # the same image placed 10 tokens later is another prompt from chunk 1 on
    assert hit(eng, "E", a, images=[("mm-hash-cat", C + 20, 50)]) == C
