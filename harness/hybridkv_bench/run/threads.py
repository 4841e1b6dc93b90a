"""A repeat of a workload's plan by engines of the runner's own process (one, or a thread each)."""

from __future__ import annotations

import threading

from hybridkv_bench.engines.step import RepeatInfo, abort_all, align_barriers, request_index, run_request
from hybridkv_bench.metrics import RequestRow
from hybridkv_bench.workloads.base import Plan
from hybridkv_bench.workloads.hits import ExpectedHits


def repeat_in_threads(engines: list, oracles: dict[int, ExpectedHits], plan: Plan,
                      info: RepeatInfo) -> list[RequestRow]:
    """One repeat of `plan` by `engines` of this process: in order for one engine, else one thread each,
    with a barrier between phases; the rows in request order."""
    rows: list[RequestRow] = []
    lock = threading.Lock()
    index = request_index(plan)
    aligned = align_barriers(plan, threading.Barrier)  # aligned requests' transfers start together

    def one(req, step: int) -> None:
        row = run_request(engines[req.engine], oracles[plan.ranks[req.engine]], req, step, index[id(req)], info,
                          aligned[step])
        with lock:
            rows.append(row)

    if len(engines) == 1:
        for step, phase in enumerate(plan.phases):
            for r in phase:
                one(r, step)
        return rows
    # Engines at once, one thread each; a barrier between phases. An engine that fails breaks the
    # barrier so that the others stop instead of waiting for it.
    barrier = threading.Barrier(len(engines))
    errors: list[BaseException] = []

    def engine_thread(e: int) -> None:
        try:
            for step, phase in enumerate(plan.phases):
                for r in phase:
                    if r.engine == e:
                        one(r, step)
                barrier.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            abort_all([barrier, *aligned])  # a partner waiting to start its transfer with this one stops too

    threads = [threading.Thread(target=engine_thread, args=(e,), name=f"hkv-engine-{e}") for e in
               range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)  # short joins keep the main thread responsive to Ctrl-C
    if errors:
        raise errors[0]
    rows.sort(key=lambda r: r.request)
    return rows
