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
                k, v = self._attention_kv(g, j, ids)
                cache.update(k.contiguous(), v.contiguous(), li)
        self._read_states(cache, blocks, n_chunks)
        return cache

    def read_cache_layerwise(self, blocks: Sequence[Sequence[int]], n_chunks: int, load: TransferHandle,
                             layers: Sequence[torch.nn.Module]) -> tuple[Any, list[Any]]:
        """The cache `read_cache` makes, filled as the forward reaches each layer: the recurrent states now
        (after their pages, which a layer-wise load writes first), each attention layer's K/V by a pre-hook
        on its decoder layer `layers[li]` that orders the fill after that layer's pages alone (`load`'s
        `wait_layer`, on the GPU). Returns the cache and the hooks, which the caller removes after the forward."""
        cache = self.hf.new_cache()
        hooks: list[Any] = []
        for g in self.layout.attention_groups:
            ids = self._attention_ids(blocks, g, n_chunks)
            names = self.layout.groups[g].layer_names
            for j, li in enumerate(self.layer_index[g]):
                # the right lengths from the start (masks and positions read them before layer 0 runs)
                shape = (1, self.kv_heads, len(ids) * self.layout.groups[g].block_tokens, self.head_dim)
                cache.update(torch.empty(shape, dtype=self.hf.dtype, device=self.hf.device),
                             torch.empty(shape, dtype=self.hf.dtype, device=self.hf.device), li)

                def fill(module: Any, args: Any, g: int = g, j: int = j, li: int = li, ids: torch.Tensor = ids,
                         name: str = names[j], pos: int = len(hooks)) -> None:
                    load.wait_layer(name)
                    k, v = self._attention_kv(g, j, ids)
                    cache.layers[li].keys.copy_(k)
                    cache.layers[li].values.copy_(v)
                    hooks[pos].remove()  # once: a later segment's forward finds the layer filled

                hooks.append(layers[li].register_forward_pre_hook(fill))
        for g in self.layout.recurrent_groups:
            for name in self.layout.groups[g].layer_names:
                load.wait_layer(name)
        self._read_states(cache, blocks, n_chunks)
        return cache, hooks

    def _attention_ids(self, blocks: Sequence[Sequence[int]], g: int, n_chunks: int) -> torch.Tensor:
        n_blocks = n_chunks * self.chunk_tokens // self.layout.groups[g].block_tokens
        return torch.as_tensor(list(blocks[g][:n_blocks]), device=self.hf.device)

    def _attention_kv(self, g: int, j: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer j of attention group g's K and V over blocks `ids`, shaped as transformers' cache holds them."""
        kv = self._kv_view(g, j).index_select(0, ids)  # (n, 2, B, kvh, hd)
        kv = kv.permute(1, 3, 0, 2, 4).reshape(2, 1, self.kv_heads, -1, self.head_dim)
        return kv[0], kv[1]

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
