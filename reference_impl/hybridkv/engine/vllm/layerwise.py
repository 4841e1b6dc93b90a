"""load_mode "layerwise": a hit's attention pages are copied in the step that first schedules the request, each
attention layer waiting for its own pages (`wait_for_layer_load`), while everything that can fail because of the
cache server stays in the asynchronous phase (README, "Layer-wise loads: why they stay fail-safe").

The asynchronous phase (the request in WAITING_FOR_REMOTE_KVS, as in load_mode "async") sends the pinning lookup
and loads the GDN states, which vLLM's mamba preprocessing copies before any in-step load could land. The
attention part of the hit stays pinned under the lookup's lease, its copy plan already checked against vLLM's
blocks, its slots in the arena this process has mapped. vLLM caches the request's blocks in its prefix cache the
moment it takes the request out of WAITING_FOR_REMOTE_KVS, before it is scheduled (or while it still is not):
`promoted` names those requests in that same step, and the worker copies their attention pages in it, before the
step's forward (`has_sync_kv_loads`) and whatever else the step schedules. Every in-step copy has ended, on the CPU
or on vLLM's stream, when the step's `wait_for_save` returns, so no later step reads a block before it is written.

An in-step copy that fails cannot be handed back to vLLM as a recompute (vLLM 0.32/0.33 ignore `failed_recving`
for a request that left WAITING_FOR_REMOTE_KVS and raise on `invalid_block_ids` for models of several KV-cache
groups), so it stops the step with `StepLoadError`: never a forward over unwritten blocks. Under tensor parallelism
every rank stops at the same point (`tp_vote`): a rank that raised alone would leave the others waiting in the
forward's next collective until vLLM's execute_model timeout (300 s) and their processes spinning after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hybridkv.engine.transfer import Hit, KVTransfer, TransferHandle
from hybridkv.engine.vllm.plan import LoadJob
from hybridkv.engine.vllm.stats import WorkerStats
from hybridkv.model.layout import ModelLayout

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class StepLoadError(RuntimeError):
    """An attention load inside the step could not write vLLM's blocks: the step must not run its forward."""


def promoted(held: set[str], requests: dict[str, Request]) -> list[str]:
    """The scheduler side's half: the requests of `held` (layer-wise loads whose asynchronous phase was planned)
    that vLLM took out of WAITING_FOR_REMOTE_KVS in this step, so that their blocks are in its prefix cache now.
    They leave `held`; finished ones leave it without a load (vLLM may hand their blocks to others)."""
    from vllm.v1.request import RequestStatus

    out = []
    for rid in list(held):
        req = requests.get(rid)
        if req is None or req.is_finished():
            held.discard(rid)
        elif req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            held.discard(rid)
            out.append(rid)
    return out


def tp_vote(tp_size: int) -> Callable[[bool], bool] | None:
    """For a worker of a tensor-parallel group (`tp_size` > 1): vote(failed) -> whether any rank's vote was True,
    over vLLM's CPU (gloo) group of the ranks. Every rank calls it at the same points of a step (the step's loads
    and attention layers are the same on every rank), so all stop together, before any of them enters a collective
    the others would never join. None at TP 1."""
    if tp_size <= 1:
        return None

    def vote(failed: bool) -> bool:
        import torch
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        flag = torch.tensor([int(failed)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return bool(flag.item())

    return vote


@dataclass(slots=True, eq=False)
class _Held:
    """A hit's attention part, pinned under its lease, waiting for the step that schedules its request."""

    transfer: KVTransfer  # the connection whose arena mapping the pages are copied from (kept open until then)
    hit: Hit
    job: LoadJob


class LayerwiseLoads:
    """One worker rank's layer-wise loads: the held attention parts, and this step's in-step copies."""

    def __init__(self, layout: ModelLayout, stats: WorkerStats, timeout_s: float,
                 vote: Callable[[bool], bool] | None = None):
        self.recurrent = set(layout.recurrent_groups)
        self.stats = stats
        self.timeout_s = timeout_s
        self.vote = vote  # TP > 1: `tp_vote`'s, so that a failure on one rank stops every rank at the same point
        self._held: dict[str, _Held] = {}
        self._step: list[tuple[str, TransferHandle]] = []
        self.started = False  # this step's copies are queued (by start_load_kv, or the first layer's wait)
        self._failed = ""  # why this rank's in-step load of this step failed; kept until the step ends
        self._closing: list[KVTransfer] = []  # dropped connections closed once no held hit reads their arena
        self._lock = threading.Lock()

    def hold(self, t: KVTransfer, hit: Hit, job: LoadJob) -> Hit:
        """Split a pinned hit: keep its attention part for the step that schedules the request (its blocks checked
        now, so a bad plan fails this asynchronous phase: a recompute), and return the recurrent part, to load now
        without releasing the lease (lease 0)."""
        states = [o for o in hit.objects if o.group in self.recurrent]
        pages = replace(hit, objects=[o for o in hit.objects if o.group not in self.recurrent])
        t.check_blocks(pages.objects, job.block_ids)
        with self._lock:
            old = self._held.pop(job.request_id, None)
            self._held[job.request_id] = _Held(t, pages, job)
        if old is not None:  # vLLM looked the request up again (its earlier load failed on another rank)
            old.transfer.release(old.hit)
        return replace(hit, lease=0, objects=states)

    def start(self, request_ids: list[str], ready) -> None:
        """Queue the in-step copies of the requests vLLM promoted: from the arena slots their lease pins into the
        blocks the asynchronous phase checked, layer by layer. Raises StepLoadError when one has nothing to copy
        from (vLLM's blocks for it would stay unwritten), on every rank when one rank's has (`_stop_if_failed`)."""
        self.started = True
        for rid in request_ids:
            with self._lock:
                held = self._held.pop(rid, None)
            if held is None:
                self._fail(f"vLLM scheduled {rid} for its in-step attention load, but this rank holds no pinned "
                           "hit for it")
                continue
            try:
                self._step.append((rid, held.transfer.retrieve(held.hit, held.job.block_ids, ready, layerwise=True)))
            except Exception as e:
                self._fail(f"the in-step attention load of {rid} could not start: {e!r}")
            finally:
                self._close_unheld()
        self._stop_if_failed()

    def wait_layer(self, name: str) -> None:
        """vLLM's attention layer `name` is about to read the cache: order it after this step's copies of that
        layer (CUDA: on the GPU; CPU: the copies run on the load thread, so this waits for each load whole)."""
        if not self.started:  # the same on every rank: the step's loads are
            return
        self.stats.layer_waits += 1
        for rid, h in self._step:
            try:
                h.wait_layer(name, timeout=self.timeout_s)
            except Exception as e:
                self._fail(f"the in-step attention load of {rid} failed: {e!r}")
                break
        self._stop_if_failed()

    def end_step(self, stream) -> None:
        """Every copy of this step has ended (CPU) or is ahead of whatever vLLM queues next on `stream` (CUDA),
        whether or not a forward waited for it (a step without one, layers the forward never asked for). A step
        whose in-step load failed on any rank raises StepLoadError here on every rank (again, if a layer's wait
        raised it already: vLLM calls this in a `finally`), before the step's stores read any block."""
        step, started, self._step, self.started = self._step, self.started, [], False
        if not started:
            return
        for rid, h in step:
            try:
                if stream is not None and h.layer_ready is not None:
                    for events in h.layer_ready.values():
                        for ev in events:
                            stream.wait_event(ev)
                    if h.done.done() and h.done.exception() is not None:
                        raise h.done.exception()  # type: ignore[misc]
                else:
                    h.wait(self.timeout_s)
            except Exception as e:
                self._fail(f"the in-step attention load of {rid} failed: {e!r}")
                continue
            self.stats.step_loads += 1
            self.stats.step_loaded_bytes += h.nbytes
        try:
            self._stop_if_failed()
        finally:
            self._failed = ""

    def _fail(self, why: str) -> None:
        self._failed = self._failed or f"hybridkv: {why}"

    def _stop_if_failed(self) -> None:
        """Raise StepLoadError when this rank's in-step load of this step failed, or (TP > 1) another rank's: every
        rank votes here at the same point of the step, and all raise together."""
        failed = bool(self._failed)
        if self.vote is not None:
            failed = self.vote(failed)
        if failed:
            raise StepLoadError(self._failed or "hybridkv: another tensor-parallel rank's in-step attention load of "
                                "this step failed; every rank stops the step")

    def finished(self, request_ids: set[str]) -> None:
        """Requests vLLM finished: their held hits go (their server sessions end, which drops the pins)."""
        with self._lock:
            for rid in request_ids:
                self._held.pop(rid, None)
        self._close_unheld()

    def close_when_unheld(self, t: KVTransfer) -> bool:
        """A dropped connection: True when held hits still copy from its arena, so it is closed once they are
        gone (the worker side must not close it now); False when nothing holds it."""
        with self._lock:
            if not any(h.transfer is t for h in self._held.values()):
                return False
            self._closing.append(t)
        return True

    def _close_unheld(self) -> None:
        with self._lock:
            held = {id(h.transfer) for h in self._held.values()}
            done = [t for t in self._closing if id(t) not in held]
            self._closing = [t for t in self._closing if id(t) in held]
        for t in done:
            threading.Thread(target=t.close, name="hkv-vllm-close", daemon=True).start()
