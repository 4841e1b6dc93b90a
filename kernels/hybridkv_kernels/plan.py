"""Page copy plans: every page copy of a gather or scatter as (src, dst) address pairs, validated once.

An object is one group's pages for some blocks, layer-major: `obj[l, j] = layers[l][block_ids[j]]`,
`L * n * page_bytes` contiguous bytes. A plan joins any number of (layers, block_ids, object)
transfers, from any number of groups with one page size, so one kernel launch can move them all.
Everything is checked here, before any byte moves: a plan that exists is safe to run.

A scatter's block id may be `HOLE` (-1): the engine has no block there (e.g. a sliding-window layer's block
outside the window, which the engine freed), so that page of the object is written nowhere. A gather's may
not: every page of an object it fills must come from somewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch

from hybridkv_kernels.pages import PagedLayers

Direction = Literal["gather", "scatter"]
HOLE = -1  # a scatter's block id for "no engine block here": the object's page there is not written


class PageTransfer(NamedTuple):
    """One object: `layers`' pages at `block_ids`, gathered into or scattered from `obj` (flat uint8)."""

    layers: PagedLayers
    block_ids: Sequence[int] | np.ndarray | torch.Tensor
    obj: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class PageCopyPlan:
    """Page copies of `page_bytes` each, `src_addr[p] -> dst_addr[p]`, and the tensors they live in."""

    direction: Direction
    device: torch.device
    page_bytes: int
    elem_bytes: int  # widest of 16/8/4/2/1 dividing page_bytes and every address: the kernel's access width
    src_addr: np.ndarray  # int64 (P,)
    dst_addr: np.ndarray  # int64 (P,)
    page_transfer: np.ndarray  # int64 (P,): index into transfers
    page_layer: np.ndarray  # int64 (P,): layer within that transfer's group
    engine_storage: np.ndarray  # int64 (P,): storage address of the engine page's allocation
    transfers: tuple[PageTransfer, ...]  # block_ids normalized to int64 numpy arrays
    anchor: torch.Tensor  # an engine page view; kernels address every page relative to its data_ptr()
    part: bool = False  # made by `take`: some pages of its transfers only (the torch path then goes page-wise)
    object_storage: np.ndarray | None = None  # int64 (T,): storage address of each object's allocation, if known

    @property
    def num_pages(self) -> int:
        return int(self.src_addr.shape[0])

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    def take(self, pages: np.ndarray) -> PageCopyPlan:
        """The plan of pages `pages` (indices into this plan, in the order given): e.g. one layer's copies, so
        that a reader of that layer waits for those alone. Every check of the whole plan holds for a part."""
        pages = np.asarray(pages, dtype=np.int64)
        if pages.ndim != 1 or (pages.size and (pages.min() < 0 or pages.max() >= self.num_pages)):
            raise ValueError(f"page indices must be a 1-d selection of this plan's {self.num_pages} pages")
        return dataclasses.replace(self, src_addr=self.src_addr[pages], dst_addr=self.dst_addr[pages],
                                   page_transfer=self.page_transfer[pages], page_layer=self.page_layer[pages],
                                   engine_storage=self.engine_storage[pages], part=True)


def _block_ids(ids: Sequence[int] | np.ndarray | torch.Tensor, index: int) -> np.ndarray:
    """Block ids as a 1-d int64 numpy array; a device tensor is copied to the host (and syncs)."""
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        return ids  # what the transfer library passes: nothing to convert or check
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"transfer {index}: block ids must be a 1-d sequence of ints, got {arr.dtype} "
                         f"shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


def _check_object(obj: torch.Tensor, layers: PagedLayers, n: int, device: torch.device, index: int,
                  pinned: dict[int, bool] | None = None) -> None:
    """Reject an object tensor of the wrong type, size or place for its transfer. `pinned` memoizes the
    page-locked test per base tensor within one plan (a driver query per object otherwise: the slots of
    one arena are views of one registered mapping)."""
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"transfer {index}: object must be a torch.Tensor, got {type(obj).__name__}")
    if obj.dtype != torch.uint8:
        raise ValueError(f"transfer {index}: object dtype must be torch.uint8, got {obj.dtype}")
    if not obj.is_contiguous():
        raise ValueError(f"transfer {index}: object must be contiguous bytes, got strides {obj.stride()}")
    want = layers.object_bytes(n)
    if obj.numel() != want:
        raise ValueError(f"transfer {index}: object has {obj.numel()} B, expected {want} B "
                         f"({layers.num_layers} layers x {n} blocks x {layers.page_bytes} B)")
    if obj.device == device:
        return
    # A GPU reaches host memory only when it is page-locked (pinned, or cudaHostRegister'ed).
    if device.type == "cuda" and obj.device.type == "cpu":
        # A view is page-locked when its base is: pinned allocations and registered mappings are locked whole.
        base = obj._base if obj._base is not None else obj
        ok = pinned.get(id(base)) if pinned is not None else None
        if ok is None:
            ok = base.is_pinned()
            if pinned is not None:
                pinned[id(base)] = ok
        if ok:
            return
    raise ValueError(f"transfer {index}: object on {obj.device} is not reachable from {device} "
                     f"(use a tensor on {device} or page-locked host memory)")


def _storage_addr(obj: torch.Tensor, memo: dict[int, int]) -> int:
    """The address of the storage `obj` lives in, looked up once per base tensor (`memo`, by id: the objects
    hold their bases alive while a plan is bound)."""
    base = obj._base if obj._base is not None else obj
    addr = memo.get(id(base))
    if addr is None:
        addr = memo[id(base)] = base.untyped_storage().data_ptr()
    return addr


def _widest_alignment(*values: int | np.ndarray) -> int:
    """The widest of 16, 8, 4, 2, 1 bytes dividing every value."""
    acc = 0
    for v in values:
        if isinstance(v, np.ndarray):
            acc |= int(np.bitwise_or.reduce(v)) if v.size else 0
        else:
            acc |= int(v)
    lowest = acc & -acc if acc else 16
    return min(16, lowest)


def _check_no_overlap(plan_dst: np.ndarray, page_bytes: int, describe) -> None:
    """Reject destination pages that overlap: two writes to the same bytes in one launch race."""
    if plan_dst.size < 2:
        return
    order = np.argsort(plan_dst, kind="stable")
    close = np.flatnonzero(np.diff(plan_dst[order]) < page_bytes)
    if close.size:
        a, b = order[close[0]], order[close[0] + 1]
        raise ValueError(f"destination pages overlap: {describe(a)} and {describe(b)}")


@dataclass(frozen=True, slots=True, eq=False)
class EnginePages:
    """The engine half of a plan: every page of some (layers, block_ids) transfers, validated and addressed,
    with the objects still to come. Built from the block ids alone (e.g. while a store's reservation is in
    flight), then `bind` gives each transfer its object, or None to leave it out, and returns the plan."""

    direction: Direction
    device: torch.device
    page_bytes: int
    layers: tuple[PagedLayers, ...]
    block_ids: tuple[np.ndarray, ...]  # int64, one per transfer
    counts: np.ndarray  # int64 (T,): pages of each transfer that are copied (a scatter's holes left out)
    page_transfer: np.ndarray  # int64 (P,)
    page_k: np.ndarray  # int64 (P,): page index within its object
    page_layer: np.ndarray  # int64 (P,)
    page_block: np.ndarray  # int64 (P,)
    engine_addr: np.ndarray  # int64 (P,)
    engine_storage: np.ndarray  # int64 (P,)
    anchor: torch.Tensor
    object_bytes: np.ndarray  # int64 (T,): the size each transfer's object must have

    def _check_objects(self, objects: Sequence[torch.Tensor | None]) -> tuple[list[int], list[int], list[int]]:
        """The transfers given an object, and each object's address and its allocation's, every object checked
        (`_check_object` names what is wrong with one). One pass of cheap tests per object: the slots of one
        arena are views of one base, whose page-locked test and storage address are looked up once."""
        if len(objects) != len(self.layers):
            raise ValueError(f"{len(objects)} objects given for {len(self.layers)} transfers")
        want = self.object_bytes.tolist()
        cuda = self.device.type == "cuda"
        index = self.device.index
        bases: dict[int, tuple[bool, int]] = {}  # id(base) -> (reachable, storage address): the objects hold
        keep: list[int] = []                       # their bases alive, so ids stay unique during the loop
        addrs: list[int] = []
        storage: list[int] = []
        for i, o in enumerate(objects):
            if o is None:
                continue
            if not (isinstance(o, torch.Tensor) and o.dtype == torch.uint8 and o.is_contiguous()
                    and o.numel() == want[i]):
                _check_object(o, self.layers[i], self.block_ids[i].size, self.device, i)
            base = o._base if o._base is not None else o
            seen = bases.get(id(base))
            if seen is None:
                # A GPU reaches host memory only when it is page-locked (pinned, or cudaHostRegister'ed): a
                # pinned allocation or registered mapping is locked whole, so a view is when its base is.
                ok = ((base.is_cuda and base.get_device() == index) or (base.is_cpu and base.is_pinned())) if cuda \
                    else base.is_cpu
                seen = bases[id(base)] = (ok, base.untyped_storage().data_ptr())
            if not seen[0]:
                _check_object(o, self.layers[i], self.block_ids[i].size, self.device, i)
            keep.append(i)
            addrs.append(o.data_ptr())
            storage.append(seen[1])
        if not keep:
            raise ValueError("a plan needs at least one transfer")
        return keep, addrs, storage

    def bind(self, objects: Sequence[torch.Tensor | None]) -> PageCopyPlan:
        """The plan moving transfer i's pages to or from objects[i] (None: transfer i is left out)."""
        keep, addrs, storage = self._check_objects(objects)
        transfers = tuple(PageTransfer(self.layers[i], self.block_ids[i], o)
                          for i in keep if (o := objects[i]) is not None)
        if len(keep) == len(objects):  # every transfer bound (a load, a store of every object): no selection
            sel: slice | np.ndarray = slice(None)
            page_tr = self.page_transfer
        else:
            renumber = np.full(len(objects), -1, dtype=np.int64)
            renumber[keep] = np.arange(len(keep))
            sel = np.repeat(renumber >= 0, self.counts)
            page_tr = renumber[self.page_transfer[sel]]
        k, layer, block = self.page_k[sel], self.page_layer[sel], self.page_block[sel]
        obj_addr = np.array(addrs, dtype=np.int64)
        obj_storage = np.array(storage, dtype=np.int64)
        objects_addr = obj_addr[page_tr] + k * self.page_bytes
        engine = self.engine_addr[sel]
        src, dst = (engine, objects_addr) if self.direction == "gather" else (objects_addr, engine)

        def describe(p: int) -> str:
            """Name page p the way its caller knows it."""
            return f"transfer {keep[int(page_tr[p])]} layer {int(layer[p])} block {int(block[p])}"

        _check_no_overlap(dst, self.page_bytes, describe)
        # The anchor and its storage base join the alignment so a typed anchor view of that width exists.
        elem = _widest_alignment(src, dst, self.page_bytes, self.anchor.data_ptr(),
                                 self.anchor.untyped_storage().data_ptr())
        return PageCopyPlan(self.direction, self.device, self.page_bytes, elem, src, dst, page_tr, layer,
                            self.engine_storage[sel], transfers, self.anchor, object_storage=obj_storage)


def plan_pages(direction: Direction, transfers: Sequence[tuple[PagedLayers, Sequence[int] | np.ndarray | torch.Tensor]]
               ) -> EnginePages:
    """Validate (layers, block_ids) transfers and address every engine page of them; objects come in `bind`."""
    if direction not in ("gather", "scatter"):
        raise ValueError(f"direction must be 'gather' or 'scatter', got {direction!r}")
    if not transfers:
        raise ValueError("a plan needs at least one transfer")
    for i, t in enumerate(transfers):
        if not isinstance(t[0], PagedLayers):
            raise ValueError(f"transfer {i}: layers must be PagedLayers, got {type(t[0]).__name__}")
    first = transfers[0][0]
    page_bytes, device = first.page_bytes, first.device
    group_first: dict[int, int] = {}  # id(PagedLayers) -> its first layer among all groups' layers, in order
    group_layers: list[PagedLayers] = []
    ids_list: list[np.ndarray] = []
    per: list[tuple[int, int, int, int]] = []  # per transfer: blocks, layers, its group's first layer, its blocks
    layer_count = 0
    for i, (layers, ids) in enumerate(transfers):
        g0 = group_first.get(id(layers))
        if g0 is None:  # a group's page size and device are checked once: its other transfers share them
            if layers.page_bytes != page_bytes:
                raise ValueError(f"transfer {i}: page_bytes {layers.page_bytes} differs from the plan's "
                                 f"{page_bytes}; groups with other page sizes need their own plan")
            if layers.device != device:
                raise ValueError(f"transfer {i}: layers on {layers.device}, the plan's engine device is {device}")
            g0 = group_first[id(layers)] = layer_count
            group_layers.append(layers)
            layer_count += layers.num_layers
        arr = _block_ids(ids, i)
        ids_list.append(arr)
        per.append((arr.size, layers.num_layers, g0, layers.num_blocks))

    # One table of the per-transfer figures (a few small numpy calls, whatever the number of transfers: a short
    # plan's time is the count of calls, not their size).
    n, num_layers_t, layer_off_t, num_blocks_t = np.array(per, dtype=np.int64).reshape(len(per), 4).T
    ids_all = np.concatenate(ids_list) if len(ids_list) > 1 else ids_list[0]
    low = int(ids_all.min()) if ids_all.size else 0
    if low < (HOLE if direction == "scatter" else 0) or (ids_all >= np.repeat(num_blocks_t, n)).any():
        _refuse_block_ids(direction, ids_all, n, num_blocks_t)
    holes = low == HOLE  # a scatter's (a gather's were refused)

    # Page p of transfer t is (layer l, block j) with p - start[t] = l * n[t] + j: layer-major objects.
    if len(group_layers) == 1:
        base_all, stride_all, storage_all = first.base, first.stride, first.storage_base
    else:
        base_all = np.concatenate([g.base for g in group_layers])
        stride_all = np.concatenate([g.stride for g in group_layers])
        storage_all = np.concatenate([g.storage_base for g in group_layers])
    counts = num_layers_t * n
    ends = np.cumsum(counts)
    total = int(ends[-1])
    page_tr = np.repeat(np.arange(len(transfers), dtype=np.int64), counts)
    k = np.arange(total, dtype=np.int64) - (ends - counts)[page_tr]
    n_p = np.maximum(n, 1)[page_tr]
    layer = k // n_p
    block = ids_all[(np.cumsum(n) - n)[page_tr] + k - layer * n_p]
    if holes:  # a scatter's holes: those pages of the objects go nowhere (k still counts them)
        keep = block != HOLE
        page_tr, k, layer, block = page_tr[keep], k[keep], layer[keep], block[keep]
        counts = np.bincount(page_tr, minlength=len(transfers)).astype(np.int64)
    glayer = layer_off_t[page_tr] + layer
    engine = base_all[glayer] + block * stride_all[glayer]
    return EnginePages(direction, device, page_bytes, tuple(t[0] for t in transfers), tuple(ids_list), counts,
                       page_tr, k, layer, block, engine, storage_all[glayer], first.views[0],
                       num_layers_t * n * page_bytes)


def _refuse_block_ids(direction: Direction, ids_all: np.ndarray, n: np.ndarray, num_blocks_t: np.ndarray) -> None:
    """Raise for the first block id out of range (or a hole in a gather), naming its transfer."""
    tr_of_id = np.repeat(np.arange(n.size), n)
    holes = ids_all == HOLE
    if direction == "gather" and holes.any():
        which = int(tr_of_id[np.flatnonzero(holes)[0]])
        raise ValueError(f"transfer {which}: block id {HOLE} (a hole) in a gather: every page of the object "
                         "must come from an engine block")
    bad = np.flatnonzero(((ids_all < 0) & ~holes) | (ids_all >= num_blocks_t[tr_of_id]))
    which = int(tr_of_id[bad[0]])
    raise ValueError(f"transfer {which}: block id {int(ids_all[bad[0]])} is out of range "
                     f"[0, {int(num_blocks_t[which])})")


def build_plan(direction: Direction, transfers: Sequence[PageTransfer | tuple]) -> PageCopyPlan:
    """Validate `transfers` and lay out every page copy of a gather or scatter over all of them."""
    given = tuple(PageTransfer(*t) for t in transfers)
    return plan_pages(direction, [(t.layers, t.block_ids) for t in given]).bind([t.obj for t in given])


def plan_gather(transfers: Sequence[PageTransfer | tuple]) -> PageCopyPlan:
    """A plan copying engine pages into contiguous layer-major objects."""
    return build_plan("gather", transfers)


def plan_scatter(transfers: Sequence[PageTransfer | tuple]) -> PageCopyPlan:
    """A plan copying contiguous layer-major objects back into engine pages."""
    return build_plan("scatter", transfers)
