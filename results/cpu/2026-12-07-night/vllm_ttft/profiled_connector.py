"""HybridKVConnector with a timestamp at every vLLM call on a warm request's path, for `profile_warm.py`.

Each process (vLLM's scheduler, each worker) appends one JSON line per call to `$HKV_PROFILE_LOG`:
`[monotonic time, pid, event, fields]`. CLOCK_MONOTONIC is system-wide, so the lines of the scheduler and of
a worker process sort into one timeline. A profiling tool, not part of the library (it reads an env var).
"""

from __future__ import annotations

import json
import os
import resource
import time
from typing import Any

from hybridkv.engine.vllm.connector import HybridKVConnector

_LOG = None


def _mark(event: str, **fields: Any) -> None:
    global _LOG
    if _LOG is None:
        _LOG = open(os.environ["HKV_PROFILE_LOG"], "a", buffering=1)  # noqa: SIM115 (the process's lifetime)
    _LOG.write(json.dumps([time.monotonic(), os.getpid(), event, fields]) + "\n")


class ProfiledHybridKVConnector(HybridKVConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        side = self.scheduler_side
        link = getattr(side, "link", None)  # the scheduler's server connection (scheduler_link.py)
        if link is not None:
            ask = link.ask_ranks

            def timed_ask(msgs, timeout):
                t0 = time.monotonic()
                out = ask(msgs, timeout)
                _mark("ask", t0=t0, kind=type(msgs[0]).__name__)
                return out

            link.ask_ranks = timed_ask

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        t0 = time.monotonic()
        out = super().get_num_new_matched_tokens(request, num_computed_tokens)
        _mark("lookup", rid=request.request_id, t0=t0, computed=num_computed_tokens, hit=out[0])
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        t0 = time.monotonic()
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        _mark("alloc", rid=request.request_id, t0=t0, external=num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        t0 = time.monotonic()
        meta = super().build_connector_meta(scheduler_output)
        _mark("meta", t0=t0, loads=[j.request_id for j in meta.loads], stores=len(meta.stores),
              scheduled={r: n for r, n in scheduler_output.num_scheduled_tokens.items()})
        return meta

    def update_connector_output(self, connector_output):
        t0 = time.monotonic()
        super().update_connector_output(connector_output)
        _mark("output", t0=t0, recv=sorted(connector_output.finished_recving or ()))

    # ---- worker side
    def start_load_kv(self, forward_context, **kwargs):
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        t0 = time.monotonic()
        super().start_load_kv(forward_context, **kwargs)
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        meta = self._get_connector_metadata()
        # page faults and CPU time of this thread in the call: a copy into or out of pages it never touched faults
        _mark("start_load", t0=t0, loads=[j.request_id for j in meta.loads], stores=len(meta.stores),
              minflt=r1.ru_minflt - r0.ru_minflt, majflt=r1.ru_majflt - r0.ru_majflt,
              cpu=(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime), sys=r1.ru_stime - r0.ru_stime)

    def wait_for_save(self):
        t0 = time.monotonic()
        super().wait_for_save()
        _mark("save", t0=t0, stores=len(self._get_connector_metadata().stores))

    def get_transfer_results(self, finished_req_ids):
        t0 = time.monotonic()
        out = super().get_transfer_results(finished_req_ids)
        _mark("results", t0=t0, recv=sorted(out.finished_recving or ()))
        return out
