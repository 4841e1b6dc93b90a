"""The CUDA-IPC baseline, both sides: the engine exports its page views with CUDA IPC, the server maps
them and does the copies itself, as LMCache's default mode does. This is the design hybridkv exists
to replace: the server then holds a CUDA context (VRAM on every GPU it serves) and imports torch.
It is measured beside the shm path; a server runs it only when started with --cuda-ipc.
"""

from __future__ import annotations

from typing import Literal

import torch
from hybridkv_kernels import PagedLayers, build_plan, run_plan

from hybridkv.wire import protocol as P


def export_views(groups: list[PagedLayers]) -> list[list[P.CudaShare]]:
    """CUDA IPC handles of every group's page views (engine side)."""
    out = []
    for g in groups:
        shares = []
        for v in g.views:
            if v.device.type != "cuda":
                raise ValueError(f"cuda_ipc needs CUDA page tensors, got {v.device}")
            (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
             event_sync) = v._typed_storage()._share_cuda_()
            shares.append(P.CudaShare(device, handle, size_bytes, offset_bytes, ref_handle, ref_offset,
                                      event_handle, event_sync, int(v.storage_offset()), [int(x) for x in v.shape],
                                      [int(x) for x in v.stride()]))
        out.append(shares)
    return out


def _rebuild(s: P.CudaShare) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(torch.Tensor, torch.Size(s.size), tuple(s.stride), s.tensor_offset,
                               torch.storage.TypedStorage, torch.uint8, s.device, s.handle, s.storage_size_bytes,
                               s.storage_offset_bytes, False, s.ref_counter_handle, s.ref_counter_offset,
                               s.event_handle, s.event_sync_required)


class MappedEngine:
    """An engine's pages mapped into the server's CUDA context, and the server's arena pinned there."""

    def __init__(self, shares: list[list[P.CudaShare]], arena_buf: memoryview, page_bytes: list[int]):
        self.groups = [PagedLayers.from_views([_rebuild(s) for s in layers]) for layers in shares]
        for i, (g, pb) in enumerate(zip(self.groups, page_bytes, strict=True)):
            if g.page_bytes != pb:
                raise ValueError(f"group {i}: shared pages of {g.page_bytes} B, the layout says {pb} B")
        self.device = self.groups[0].device
        torch.cuda.set_device(self.device)
        self.arena = torch.frombuffer(arena_buf, dtype=torch.uint8)
        # the server pins its own arena, as a CUDA-IPC cache server pins its CPU buffers
        rc = torch.cuda.cudart().cudaHostRegister(self.arena.data_ptr(), self.arena.numel(), 0)
        if int(rc) not in (0, 712):  # 712: already registered by another engine's mapping in this process
            raise RuntimeError(f"cudaHostRegister of the arena failed with CUDA error {int(rc)}")
        self.stream = torch.cuda.Stream(self.device)

    def copy(self, direction: Literal["gather", "scatter"], objects: list[tuple[int, list[int], int, int]]) -> None:
        """Gather engine blocks into arena slots or scatter them back: (group, block ids, offset, length)."""
        transfers = [(self.groups[g], ids, self.arena[off:off + n]) for g, ids, off, n in objects]
        plan = build_plan(direction, transfers)
        run_plan(plan, "auto", self.stream)
        self.stream.synchronize()
