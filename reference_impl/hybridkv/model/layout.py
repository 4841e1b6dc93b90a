"""KV-cache group layouts: what a hybrid model's paged cache looks like to the cache.

A model's KV cache is a list of groups as vLLM builds them. Every layer of a group has one page per
block; pages are opaque bytes here. These types travel on the wire (engine registration), so they
are msgspec structs that validate themselves on construction and on decode.

Group kinds: `attention` (full attention: a chunk's object holds all its blocks), `recurrent` (a Mamba / GDN
state: the chunk's last block) and `sliding` (sliding-window attention over `window` tokens: a token at
position p attends to positions p - window + 1 .. p, so resuming at a chunk boundary t needs the KV of
[t - window + 1, t) only, vLLM's own rule; a chunk's object holds just its last `tail_blocks` blocks, the
ones a resume at the chunk's end or later can need).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from math import ceil
from typing import Annotated, Literal

import msgspec

GroupKind = Literal["attention", "recurrent", "sliding"]

# Dtype names the legacy wire formats use to rebuild typed tensors (the seed serialized bf16 tensors).
DTYPE_BYTES = {
    "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "bfloat16": 2, "float16": 2, "int16": 2, "float32": 4, "int32": 4, "float64": 8, "int64": 8,
}


# Bounds that keep every size the server computes from a layout well inside 64 bits (sizes travel as
# msgpack integers and index the arena); real models are many orders of magnitude below them.
MAX_PAGE_BYTES = 1 << 40
MAX_BLOCK_TOKENS = 1 << 24
MAX_CHUNK_TOKENS = 1 << 32
MAX_OBJECT_BYTES = 1 << 48
# Bounds on what a registered layout makes the server keep for its engine (docs/protocol.md#limits):
# vLLM's layer names are about 40 characters, the largest hybrid models have under 100 layers in a few groups.
MAX_NAME_CHARS = 256   # a model id or a layer name
MAX_LAYERS = 1024      # in one layout, all groups together
MAX_GROUPS = 64
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]


class LayoutError(ValueError):
    """A layout, chunk size or block list that cannot describe a paged KV cache."""


def layer_index(name: str) -> int | str:
    """The decoder-layer index in a layer name ('model.layers.7.self_attn.attn' -> 7); the name itself when it
    holds none."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return name


class GroupLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One KV-cache group: its kind, its layers, the bytes of one page per layer and tokens per block, and for a
    sliding-window group its window (0 for every other kind). Defaults are left off the wire, so a layout
    without a sliding group encodes as it did before the field existed."""

    kind: GroupKind
    layer_names: Annotated[tuple[Name, ...], msgspec.Meta(max_length=MAX_LAYERS)]
    page_bytes: int
    block_tokens: int
    # dtype of the page contents, used only by the legacy pickle / torch.save formats
    dtype: str = "bfloat16"
    # a sliding group: the tokens a position attends to, itself included (vLLM's sliding_window, plus any
    # tokens vLLM retains below the window); vLLM drops the KV of positions < t - window + 1 at t computed tokens
    window: int = 0

    def __post_init__(self) -> None:
        if not self.layer_names:
            raise LayoutError("a group needs at least one layer")
        if len(set(self.layer_names)) != len(self.layer_names):
            raise LayoutError(f"duplicate layer names in group: {self.layer_names}")
        if not 0 < self.page_bytes <= MAX_PAGE_BYTES:
            raise LayoutError(f"page_bytes must be in 1..{MAX_PAGE_BYTES}, got {self.page_bytes}")
        if not 0 < self.block_tokens <= MAX_BLOCK_TOKENS:
            raise LayoutError(f"block_tokens must be in 1..{MAX_BLOCK_TOKENS}, got {self.block_tokens}")
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}")
        if self.page_bytes % DTYPE_BYTES[self.dtype]:
            raise LayoutError(f"page_bytes {self.page_bytes} is not a whole number of {self.dtype}")
        if self.kind == "sliding" and not 0 < self.window <= MAX_CHUNK_TOKENS:
            raise LayoutError(f"a sliding group's window must be in 1..{MAX_CHUNK_TOKENS} tokens, got {self.window}")
        if self.kind != "sliding" and self.window:
            raise LayoutError(f"{self.kind} groups have no window (got {self.window}); only sliding groups do")

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def window_blocks(self) -> int:
        """A sliding group: the blocks that can hold KV a resume at a block boundary needs (the window's last
        window - 1 tokens, ceil((window - 1) / block), at least one). 0 for other kinds."""
        if self.kind != "sliding":
            return 0
        return max(1, -(-(self.window - 1) // self.block_tokens))

    def tail_blocks(self, chunk_tokens: int) -> int:
        """Blocks of one chunk its object holds: all of them (attention), the last (recurrent), or the last
        min(blocks per chunk, window_blocks) (sliding: no resume at this chunk's end or later reads further
        back into it)."""
        bpc = chunk_tokens // self.block_tokens
        if self.kind == "recurrent":
            return 1
        return min(bpc, self.window_blocks) if self.kind == "sliding" else bpc

    def window_start_chunk(self, n: int, chunk_tokens: int) -> int:
        """The first chunk of the ones whose objects a resume at n chunks needs: 0 for attention, n - 1 for a
        recurrent state, the chunk holding token max(0, n·chunk - window + 1) for a sliding group (vLLM frees
        every block below it). Chunks before it vLLM never reads again."""
        if self.kind == "attention":
            return 0
        if self.kind == "recurrent":
            return max(0, n - 1)
        return max(0, n * chunk_tokens - self.window + 1) // chunk_tokens


class ModelLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model's KV-cache layout on one tensor-parallel rank: its groups, in vLLM's group order."""

    model: Name
    groups: Annotated[tuple[GroupLayout, ...], msgspec.Meta(max_length=MAX_GROUPS)]
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.model:
            raise LayoutError("model id must not be empty")
        if not self.groups:
            raise LayoutError("a layout needs at least one group")
        if self.tp_size < 1:
            raise LayoutError(f"tp_size must be >= 1, got {self.tp_size}")
        names = [n for g in self.groups for n in g.layer_names]
        if len(names) > MAX_LAYERS:
            raise LayoutError(f"{len(names)} layers in the layout; the limit is {MAX_LAYERS}")
        if len(set(names)) != len(names):
            raise LayoutError("a layer appears in more than one group")
        if not any(g.kind != "recurrent" for g in self.groups):
            # A cache of recurrent state alone has no prefix to resume from block by block.
            raise LayoutError("a layout needs at least one attention or sliding-window group")

    def fingerprint(self) -> bytes:
        """A stable 16-byte digest of everything that decides where a byte of a page lives: the model, TP size,
        and per group its kind, page and block sizes, dtype, decoder-layer indices and (sliding groups) window.
        Layer names enter only through their index: vLLM's model classes name a layer differently
        ('model.layers.3.self_attn.attn', 'language_model.model.layers.3...'), presets 'model.layers.3', and all
        of them mean layer 3."""
        return hashlib.blake2b(msgspec.msgpack.encode(("layout-v2", self.model, self.tp_size, self.signature())),
                               digest_size=16).digest()

    def signature(self) -> list[tuple]:
        """Per group, in order: (kind, decoder-layer indices, page bytes, block tokens, dtype), and a sliding
        group's window after them (other groups' tuples, and so every fingerprint made before sliding groups
        existed, are unchanged); no names."""
        return [(g.kind, [layer_index(n) for n in g.layer_names], g.page_bytes, g.block_tokens, g.dtype)
                + ((g.window,) if g.kind == "sliding" else ()) for g in self.groups]

    def check_chunk_tokens(self, chunk_tokens: int) -> None:
        """Reject a chunk size that does not cover a whole number of blocks in every group."""
        if not 0 < chunk_tokens <= MAX_CHUNK_TOKENS:
            raise LayoutError(f"chunk_tokens must be in 1..{MAX_CHUNK_TOKENS}, got {chunk_tokens}")
        for i, g in enumerate(self.groups):
            if chunk_tokens % g.block_tokens:
                raise LayoutError(
                    f"chunk_tokens {chunk_tokens} is not a multiple of group {i}'s block size {g.block_tokens}"
                )
            if self.object_bytes(i, chunk_tokens) > MAX_OBJECT_BYTES:
                raise LayoutError(f"group {i}'s object at chunk_tokens {chunk_tokens} is "
                                  f"{self.object_bytes(i, chunk_tokens)} B, over the {MAX_OBJECT_BYTES} B limit")

    def default_chunk_tokens(self) -> int:
        """The smallest chunk that is whole blocks in every group (vLLM's unified block size)."""
        from math import lcm

        return lcm(*(g.block_tokens for g in self.groups))

    def blocks_per_chunk(self, group: int, chunk_tokens: int) -> int:
        return chunk_tokens // self.groups[group].block_tokens

    def object_bytes(self, group: int, chunk_tokens: int) -> int:
        """Bytes of one (chunk, group) object: every layer's pages for the chunk (attention), its last
        `tail_blocks` (sliding window), or its end state (recurrent)."""
        g = self.groups[group]
        return g.num_layers * g.tail_blocks(chunk_tokens) * g.page_bytes

    def chunk_bytes(self, chunk_tokens: int) -> int:
        return sum(self.object_bytes(i, chunk_tokens) for i in range(len(self.groups)))

    @property
    def attention_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind == "attention"]

    @property
    def recurrent_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind == "recurrent"]

    @property
    def sliding_groups(self) -> list[int]:
        return [i for i, g in enumerate(self.groups) if g.kind == "sliding"]


def vllm_group_size(layer_counts: list[int]) -> int:
    """Layers per KV-cache group under vLLM's uniform-page-size grouping."""
    lo, hi = min(layer_counts), max(layer_counts)
    return hi if hi < lo * 1.5 else lo


def vllm_groups(layer_kinds: Sequence[str | None] | Sequence[tuple[int, str]]) -> list[tuple[str, list[int]]]:
    """(kind, layer indices) of each KV-cache group, in vLLM's order: buckets by first appearance, each split
    into ceil(len / size) groups, group i taking the bucket's layers i::groups (vLLM pads the last ones).
    `layer_kinds` is one kind per decoder layer (None: MLP, MoE, which keep no cache and join no group), or the
    (layer index, kind) of each cache layer in vLLM's registration order (a config's `cache_layers()`)."""
    buckets: dict[str, list[int]] = {}
    for i, item in enumerate(layer_kinds):
        index, kind = item if isinstance(item, tuple) else (i, item)
        if kind is not None:
            buckets.setdefault(kind, []).append(index)
    size = vllm_group_size([len(v) for v in buckets.values()])
    out: list[tuple[str, list[int]]] = []
    for kind, idxs in buckets.items():
        n = ceil(len(idxs) / size)
        out.extend((kind, idxs[i::n]) for i in range(n))
    return out
