"""A transformers hybrid cache laid out as vLLM pages, and back.

Pages are the views `hybridkv_bench.pools.vllm_pools` makes: per group, per layer, (num_blocks, page_bytes)
uint8 over buffers shared by the i-th layer of every group. What a page holds:
- attention block j of a layer: K then V of tokens [j*B, (j+1)*B), each (B, kv_heads, head_dim) in the
  cache dtype: vLLM's hybrid layout (num_blocks, 2, block_size, kv_heads, head_dim), one block contiguous.
- recurrent block (the chunk's last block): the state after the chunk's last token: the conv state
  (conv_dim, kernel - 1) in the cache dtype, then the SSM state (v_heads, k_dim, v_dim) in float32, then
  zero padding up to the page size (vLLM pads state pages to the attention page).
transformers keeps `kernel` conv columns where vLLM keeps `kernel - 1`; the oldest one never reaches a
later token's output, so it is not stored and comes back as zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hybridkv.engine.handles import TransferHandle
from hybridkv.model.layout import DTYPE_BYTES, ModelLayout
from hybridkv.model.policy import object_blocks

from hybridkv_bench.engines.hf.model import HFModel
from hybridkv_bench.engines.hf.spec import STATE_DTYPE

MAX_RUNS = 8  # a layer's blocks in more runs of consecutive ids than this are gathered in one call instead


@dataclass(frozen=True, slots=True)
class _Ids:
    """A group's block ids for a cache: on the model's device, and as runs of consecutive ids when few."""

    tensor: torch.Tensor
    runs: list[tuple[int, int, int]] | None  # (position, first block, blocks); None: too many runs


def _hold_kv(cache: Any, li: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Make `k` and `v` layer li's K/V in transformers' `cache` as they are, not a copy: `update` with them would
    append them to its empty tensors (a pass over every byte); an update of no tokens sets the layer up instead."""
    cache.update(k[:, :, :0], v[:, :, :0], li)
    layer = cache.layers[li]
    layer.keys, layer.values = k, v


class PageShapeError(ValueError):
    """The model's cache tensors do not fit the layout's pages."""


@dataclass(frozen=True, slots=True)
class StateShape:
    """Byte offsets of the conv and SSM states inside a recurrent page."""

    conv_dim: int
    conv_cols: int  # kernel - 1
    v_heads: int
    k_dim: int
    v_dim: int
    conv_bytes: int
    ssm_bytes: int


class PageCodec:
    """Copies between one model's transformers cache and its vLLM-shaped pages, group by group."""

    def __init__(self, hf: HFModel, layout: ModelLayout, pages: Sequence[Sequence[torch.Tensor]], chunk_tokens: int):
        self.hf, self.layout, self.pages, self.chunk_tokens = hf, layout, pages, chunk_tokens
        layout.check_chunk_tokens(chunk_tokens)
        cfg = hf.cfg
        index = {f"model.layers.{i}": i for i in range(cfg.num_layers)}
        self.layer_index = [[index[n] for n in g.layer_names] for g in layout.groups]
        kinds = hf.layer_kinds
        for g, grp in enumerate(layout.groups):
            want = "attention" if grp.kind == "attention" else "recurrent"
            wrong = [i for i in self.layer_index[g] if kinds[i] != want]
            if wrong:
                raise PageShapeError(f"group {g} ({grp.kind}) holds layers {wrong} the model makes {kinds[wrong[0]]}")
        self.kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        k_dim, v_dim, v_heads = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
        conv_dim = 2 * cfg.linear_num_key_heads * k_dim + v_heads * v_dim
        cols, es = cfg.linear_conv_kernel_dim - 1, hf.dtype.itemsize
        self.state = StateShape(conv_dim=conv_dim, conv_cols=cols, v_heads=v_heads, k_dim=k_dim, v_dim=v_dim,
                                conv_bytes=conv_dim * cols * es,
                                ssm_bytes=v_heads * k_dim * v_dim * DTYPE_BYTES[STATE_DTYPE])
        for grp in layout.groups:
            need = (2 * grp.block_tokens * self.kv_heads * self.head_dim * es if grp.kind == "attention"
                    else self.state.conv_bytes + self.state.ssm_bytes)
            if need > grp.page_bytes:
                raise PageShapeError(f"a {grp.kind} page needs {need} B, the layout's page is {grp.page_bytes} B")

    # ---- views --------------------------------------------------------------------------------------

    def _kv_view(self, g: int, layer: int) -> torch.Tensor:
        """(num_blocks, 2, B, kv_heads, head_dim) typed view of one attention layer's pages."""
        t = self.pages[g][layer]
        B = self.layout.groups[g].block_tokens
        n = 2 * B * self.kv_heads * self.head_dim * self.hf.dtype.itemsize
        return t[:, :n].view(self.hf.dtype).view(t.shape[0], 2, B, self.kv_heads, self.head_dim)

    def state_views(self, g: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv, ssm, padding) byte views of one recurrent layer's pages, each (num_blocks, n)."""
        t, s = self.pages[g][layer], self.state
        return t[:, :s.conv_bytes], t[:, s.conv_bytes:s.conv_bytes + s.ssm_bytes], t[:, s.conv_bytes + s.ssm_bytes:]

    # ---- cache -> pages -----------------------------------------------------------------------------

    def write_attention(self, cache: Any, blocks: Sequence[Sequence[int]], first_block: int, n_blocks: int) -> None:
        """K/V of blocks first_block..n_blocks-1 (token blocks of each attention group) into their pages."""
        for g in self.layout.attention_groups:
            B = self.layout.groups[g].block_tokens
            ids = torch.as_tensor(list(blocks[g][first_block:n_blocks]), device=self.hf.device)
            if not len(ids):
                continue
            lo, hi = first_block * B, n_blocks * B
            for j, li in enumerate(self.layer_index[g]):
                layer = cache.layers[li]
                if layer.keys is None or layer.keys.shape[2] < hi:
                    have = 0 if layer.keys is None else layer.keys.shape[2]
                    raise PageShapeError(f"layer {li} caches {have} tokens; blocks up to {n_blocks} need {hi}")
                kv = torch.stack([layer.keys[0, :, lo:hi], layer.values[0, :, lo:hi]])  # (2, kvh, T, hd)
                kv = kv.permute(2, 0, 1, 3).reshape(n_blocks - first_block, B, 2, self.kv_heads, self.head_dim)
                self._kv_view(g, j).index_copy_(0, ids, kv.transpose(1, 2).to(self.hf.dtype))

    def state_block(self, blocks: Sequence[Sequence[int]], g: int, chunk: int) -> int:
        """The block of group g that holds the state after chunk `chunk` (hybridkv.model.policy's rule)."""
        return int(object_blocks(self.layout, self.chunk_tokens, g, chunk, blocks[g])[0])

    def write_states(self, cache: Any, blocks: Sequence[Sequence[int]], chunk: int) -> None:
        """Every recurrent layer's state (as it is now in `cache`: after chunk `chunk`) into its state block."""
        for g in self.layout.recurrent_groups:
            bid = self.state_block(blocks, g, chunk)
            for j, li in enumerate(self.layer_index[g]):
                layer = cache.layers[li]
                conv = layer.conv_states[0][0, :, -self.state.conv_cols:].contiguous()
                ssm = layer.recurrent_states[0][0].to(getattr(torch, STATE_DTYPE)).contiguous()
                cb, sb, pad = self.state_views(g, j)
                cb[bid].copy_(conv.view(torch.uint8).flatten())
                sb[bid].copy_(ssm.view(torch.uint8).flatten())
                pad[bid].zero_()

    # ---- pages -> cache -----------------------------------------------------------------------------

    def read_cache(self, blocks: Sequence[Sequence[int]], n_chunks: int) -> Any:
        """A fresh transformers cache holding the first `n_chunks` chunks: every attention block of them and
        the recurrent states after chunk n_chunks - 1."""
        cache = self.hf.new_cache()
        for g in self.layout.attention_groups:
            ids = self._attention_ids(blocks, g, n_chunks)
            for j, li in enumerate(self.layer_index[g]):
                k, v = self._empty_kv(g, len(ids.tensor))
                self._fill_kv(g, j, ids, k, v)
                _hold_kv(cache, li, k, v)
        self._read_states(cache, blocks, n_chunks)
        return cache

    def read_cache_layerwise(self, blocks: Sequence[Sequence[int]], n_chunks: int, load: TransferHandle,
                             layers: Sequence[torch.nn.Module]) -> tuple[Any, list[Any]]:
        """The cache `read_cache` makes, filled as the load writes each layer: the recurrent states now (after
        their pages, which a layer-wise load writes first), each attention layer's K/V as soon as its pages are
        written. On the GPU every fill is queued now on a stream of its own, each after its layer's pages alone
        (`load`'s `wait_layer`), so a fill runs beside the forward's earlier layers rather than in its stream; a
        pre-hook on decoder layer `layers[li]` orders the forward after that layer's fill only. Elsewhere the hook
        fills the layer itself (after the whole load). Returns the cache and the hooks, which the caller removes
        after the forward."""
        cache = self.hf.new_cache()
        hooks: list[Any] = []
        cuda = self.hf.device.type == "cuda"
        side = torch.cuda.Stream(self.hf.device) if cuda else None
        if side is not None:  # the cache's tensors are made on the model's stream: the fills come after that
            side.wait_stream(torch.cuda.current_stream(self.hf.device))
        # every attention layer, in the order the forward reaches them (and the load writes them): a fill queued
        # behind another group's later layer would wait for that layer's pages
        todo = sorted((li, g, j) for g in self.layout.attention_groups for j, li in enumerate(self.layer_index[g]))
        ids_of = {g: self._attention_ids(blocks, g, n_chunks) for g in self.layout.attention_groups}
        for li, g, j in todo:
            ids, name = ids_of[g], self.layout.groups[g].layer_names[j]
            # the right lengths from the start (masks and positions read them before layer 0 runs)
            k, v = self._empty_kv(g, len(ids.tensor))
            _hold_kv(cache, li, k, v)
            filled = None
            if side is not None:
                # written on `side`: their memory is not reused before that work is done, even if the forward
                # never reaches the layer (an error) and frees the cache with its fill still queued
                k.record_stream(side)
                v.record_stream(side)
                with torch.cuda.stream(side):
                    load.wait_layer(name, stream=side)
                    self._fill_kv(g, j, ids, k, v)
                    filled = torch.cuda.Event()
                    filled.record(side)

            def fill(module: Any, args: Any, g: int = g, j: int = j, ids: _Ids = ids, k: torch.Tensor = k,
                     v: torch.Tensor = v, name: str = name, pos: int = len(hooks), filled: Any = filled) -> None:
                if filled is not None:
                    torch.cuda.current_stream(self.hf.device).wait_event(filled)
                else:
                    load.wait_layer(name)
                    self._fill_kv(g, j, ids, k, v)
                hooks[pos].remove()  # once: a later segment's forward finds the layer filled

            hooks.append(layers[li].register_forward_pre_hook(fill))
        for g in self.layout.recurrent_groups:
            for name in self.layout.groups[g].layer_names:
                load.wait_layer(name)
        self._read_states(cache, blocks, n_chunks)
        return cache, hooks

    def _attention_ids(self, blocks: Sequence[Sequence[int]], g: int, n_chunks: int) -> _Ids:
        n_blocks = n_chunks * self.chunk_tokens // self.layout.groups[g].block_tokens
        ids = [int(b) for b in blocks[g][:n_blocks]]
        runs: list[tuple[int, int, int]] = []  # (position, first block, blocks) of each run of consecutive ids
        for pos, b in enumerate(ids):
            if runs and runs[-1][1] + runs[-1][2] == b:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((pos, b, 1))
        return _Ids(torch.as_tensor(ids, device=self.hf.device), runs if len(runs) <= MAX_RUNS else None)

    def _empty_kv(self, g: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialised K and V of `n_blocks` blocks of attention group g, shaped as transformers' cache holds them."""
        shape = (1, self.kv_heads, n_blocks * self.layout.groups[g].block_tokens, self.head_dim)
        return (torch.empty(shape, dtype=self.hf.dtype, device=self.hf.device),
                torch.empty(shape, dtype=self.hf.dtype, device=self.hf.device))

    def _fill_kv(self, g: int, j: int, ids: _Ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer j of attention group g's K and V over blocks `ids` into `k` and `v` (from `_empty_kv`): a run of
        consecutive blocks is read in place, one strided copy per run and tensor; blocks in many runs are gathered
        first (one pass more)."""
        src = self._kv_view(g, j)  # (num_blocks, 2, B, kvh, hd)
        B = self.layout.groups[g].block_tokens
        # (kvh, n, B, hd) views of the cache tensors: block-major token order, as the pages hold them
        kd = k.view(self.kv_heads, -1, B, self.head_dim)
        vd = v.view(self.kv_heads, -1, B, self.head_dim)
        if ids.runs is None:  # K, then V: each gathered (n, B, kvh, hd), then laid out as the cache holds it
            kd.copy_(src[:, 0].index_select(0, ids.tensor).permute(2, 0, 1, 3))
            vd.copy_(src[:, 1].index_select(0, ids.tensor).permute(2, 0, 1, 3))
            return
        for pos, first, n in ids.runs:
            kd[:, pos:pos + n].copy_(src[first:first + n, 0].permute(2, 0, 1, 3))
            vd[:, pos:pos + n].copy_(src[first:first + n, 1].permute(2, 0, 1, 3))

    def _read_states(self, cache: Any, blocks: Sequence[Sequence[int]], n_chunks: int) -> None:
        """Every recurrent layer's state after chunk n_chunks - 1 from its state block into `cache`."""
        hf, s = self.hf, self.state
        ssm_dtype = getattr(torch, STATE_DTYPE)
        for g in self.layout.recurrent_groups:
            bid = self.state_block(blocks, g, n_chunks - 1)
            for j, li in enumerate(self.layer_index[g]):
                cb, sb, _ = self.state_views(g, j)
                conv = cb[bid].clone().view(hf.dtype).view(1, s.conv_dim, s.conv_cols)
                conv = torch.cat([conv.new_zeros(1, s.conv_dim, 1), conv], dim=-1)
                ssm = sb[bid].clone().view(ssm_dtype).view(1, s.v_heads, s.k_dim, s.v_dim)
                cache.update_conv_state(conv, li, conv_kernel_size=s.conv_cols + 1)
                cache.update_recurrent_state(ssm, li)
