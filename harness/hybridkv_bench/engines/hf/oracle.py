"""The logits oracle for a warm request, and the controls that must fail it.

A warm request continues from a cache restored out of pages that went to the cache server and back. Its
continuation logits (every position after the hit) are compared with
1. the same continuation from the in-memory cache the engine held at the same split token, run with the
   same segments, dtype and kernels: must be bitwise equal (a restored cache is that cache, byte for byte);
2. one full prefill of the whole prompt: in float32 max |diff| <= tolerance and the same argmax at every
   position; in bfloat16 the difference is reported, not judged (chunked and one-shot prefill round
   differently there).

The controls break a restore the way offload systems have broken it (the state zeroed, the state of an
earlier boundary, the conv state dropped, attention pages one block off); each must fail the oracle, or
the oracle proves nothing. They act on the engine's pages after a retrieve, before the cache is rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hybridkv.engine.transfer import Hit

from hybridkv_bench.engines.hf.pages import PageCodec


@dataclass(frozen=True, slots=True)
class OracleVerdict:
    """The comparison of one warm request's continuation logits."""

    bitwise_equal: bool          # restored == in-memory split, bit for bit
    split_max_abs_diff: float    # |restored - in-memory split| (0.0 when bitwise equal)
    full_max_abs_diff: float     # |restored - one full prefill|
    argmax_equal: bool           # restored and full prefill pick the same token at every position
    tolerance: float | None      # bound on full_max_abs_diff; None: reported only (bf16)

    @property
    def passed(self) -> bool:
        if not self.bitwise_equal:
            return False
        return self.tolerance is None or (self.full_max_abs_diff <= self.tolerance and self.argmax_equal)


def judge(restored: torch.Tensor, split: torch.Tensor, full: torch.Tensor, tolerance: float | None) -> OracleVerdict:
    """Compare (positions, vocab) logits: restored vs the in-memory split (bitwise) and vs a full prefill."""
    if restored.shape != split.shape or restored.shape != full.shape:
        raise ValueError(f"logits shapes differ: restored {tuple(restored.shape)}, split {tuple(split.shape)}, "
                         f"full {tuple(full.shape)}")
    r, s, f = restored.float(), split.float(), full.float()
    return OracleVerdict(bitwise_equal=torch.equal(restored, split),
                         split_max_abs_diff=float((r - s).abs().max()),
                         full_max_abs_diff=float((r - f).abs().max()),
                         argmax_equal=bool(torch.equal(r.argmax(-1), f.argmax(-1))),
                         tolerance=tolerance)


# ---- controls: each takes the codec, the request's block ids per group and the hit --------------------

Control = Callable[[PageCodec, Sequence[Sequence[int]], Hit], None]




def zero_recurrent_state(codec: PageCodec, blocks: Sequence[Sequence[int]], hit: Hit) -> None:
    """The SSM state at the hit's boundary zeroed (attention restored without its recurrent state)."""
    for g in codec.layout.recurrent_groups:
        bid = codec.state_block(blocks, g, hit.hit_chunks - 1)
        for j in range(codec.layout.groups[g].num_layers):
            codec.state_views(g, j)[1][bid].zero_()


def drop_conv_state(codec: PageCodec, blocks: Sequence[Sequence[int]], hit: Hit) -> None:
    """The conv state at the hit's boundary dropped (zeroed), the SSM state kept."""
    for g in codec.layout.recurrent_groups:
        bid = codec.state_block(blocks, g, hit.hit_chunks - 1)
        for j in range(codec.layout.groups[g].num_layers):
            codec.state_views(g, j)[0][bid].zero_()


def wrong_boundary_state(codec: PageCodec, blocks: Sequence[Sequence[int]], hit: Hit) -> None:
    """The state of the chunk before the hit's last one put where the boundary state belongs (needs a
    retrieve policy that loads every chunk's state, and a hit of at least two chunks)."""
    if hit.hit_chunks < 2:
        raise ValueError(f"wrong_boundary_state needs a hit of at least 2 chunks, got {hit.hit_chunks}")
    for g in codec.layout.recurrent_groups:
        good = codec.state_block(blocks, g, hit.hit_chunks - 1)
        early = codec.state_block(blocks, g, hit.hit_chunks - 2)
        for t in codec.pages[g]:
            t[good].copy_(t[early])


def shift_attention_blocks(codec: PageCodec, blocks: Sequence[Sequence[int]], hit: Hit) -> None:
    """Every attention page of the hit moved one block later (block j gets block j-1's page)."""
    for g in codec.layout.attention_groups:
        n = hit.hit_chunks * codec.chunk_tokens // codec.layout.groups[g].block_tokens
        ids = torch.as_tensor(list(blocks[g][:n]), device=codec.hf.device)
        for t in codec.pages[g]:
            t.index_copy_(0, ids[1:], t.index_select(0, ids[:-1]))


CONTROLS: dict[str, Control] = {
    "recurrent_state_zeroed": zero_recurrent_state,
    "wrong_boundary_state": wrong_boundary_state,
    "conv_state_dropped": drop_conv_state,
    "attention_shifted": shift_attention_blocks,
}
