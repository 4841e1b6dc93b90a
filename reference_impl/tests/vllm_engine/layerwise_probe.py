"""What the layer-wise real-engine tests see inside each rank's worker (load_mode "layerwise"): the attention blocks of
every in-step load digested right before its copies start and right after the step ended them, the blocks each
request's first forward read its prefix from digested after that forward (the in-step copies land during it), and
every attention layer's wait for its own pages. It only reads: vLLM and the connector run as they would."""

from __future__ import annotations

from enginekit import PrefixRead, _digest, _stored_objects
from hybridkv.model.policy import object_blocks


def _attention_digests(ws, job, objects) -> list:
    """[group, block, digest] of every block the in-step load of `job` writes (its held attention objects)."""
    out = []
    for o in objects:
        for b in object_blocks(ws.layout, ws.chunk_tokens, o.group, o.chunk, job.block_ids[o.group]):
            if b >= 0:
                out.append([o.group, int(b), _digest(t[b].numpy().tobytes() for t in ws._pages[o.group])])
    return out


def _watch(worker) -> int:
    """In the worker: record (see the module) from now on; a second call clears what was recorded."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    runner = worker.model_runner
    if hasattr(runner, "_hkv_layerwise"):
        for k, v in runner._hkv_layerwise.items():
            if k != "steps":
                v.clear()
        return 0
    ws = get_kv_transfer_group().worker_side
    lw = ws.layerwise
    assert lw is not None, "the engine's connector is not in load_mode layerwise"
    groups = ws.layout.groups
    log = runner._hkv_layerwise = {"reads": [], "loads": [], "waits": [], "steps": [0]}
    new_reqs: list = []
    started: list = []
    execute, forward, start, end_step, wait = runner.execute_model, runner._model_forward, lw.start, lw.end_step, \
        lw.wait_layer

    def watched_execute(scheduler_output, *args, **kwargs):
        log["steps"][0] += 1
        new_reqs[:] = [r for r in scheduler_output.scheduled_new_reqs if r.num_computed_tokens > 0]
        return execute(scheduler_output, *args, **kwargs)

    def watched_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        for r in new_reqs:
            n = r.num_computed_tokens
            digests = []
            for g, (grp, ids) in enumerate(zip(groups, r.block_ids, strict=True)):
                read = [ids[(n - 1) // grp.block_tokens]] if grp.kind == "recurrent" else ids[:n // grp.block_tokens]
                digests += [[g, b, _digest(t[b].numpy().tobytes() for t in ws._pages[g])] for b in read]
            log["reads"].append([list(r.prompt_token_ids[:n]), [list(x) for x in r.block_ids], digests])
        new_reqs.clear()
        return out

    def watched_start(request_ids, ready):
        for rid in request_ids:
            held = lw._held.get(rid)
            if held is not None:
                started.append((held.job, held.hit.objects, _attention_digests(ws, held.job, held.hit.objects)))
        return start(request_ids, ready)

    def watched_end_step(stream):
        out = end_step(stream)
        for job, objects, before in started:
            log["loads"].append([list(job.token_ids), [list(map(int, x)) for x in job.block_ids], before,
                                 _attention_digests(ws, job, objects), log["steps"][0]])
        started.clear()
        return out

    def watched_wait(name):
        if lw._step:
            log["waits"].append([log["steps"][0], name, len(lw._step)])
        return wait(name)

    runner.execute_model, runner._model_forward = watched_execute, watched_forward
    lw.start, lw.end_step, lw.wait_layer = watched_start, watched_end_step, watched_wait
    return 0


def _take(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    log = worker.model_runner._hkv_layerwise
    out = {k: list(v) for k, v in log.items() if k != "steps"}
    for k in out:
        log[k].clear()
    out["rank"] = get_kv_transfer_group().worker_side.tp_rank
    return out


def _attention_layers(worker) -> list[str]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    layout = get_kv_transfer_group().worker_side.layout
    return [n for g in layout.groups if g.kind != "recurrent" for n in g.layer_names]


def watch(llm) -> None:
    llm.collective_rpc(_watch)


def take(llm) -> dict:
    """Rank 0's {'reads': [PrefixRead], 'loads': [(tokens, block ids, before, after, step)], 'waits': [(step, layer,
    loads)], 'rank': 0} since the last call."""
    return take_all(llm)[0]


def take_all(llm) -> list[dict]:
    """`take` of every tensor-parallel rank, in rank order."""
    out = []
    for got in sorted(llm.collective_rpc(_take), key=lambda g: g["rank"]):
        got["reads"] = [PrefixRead(t, ids, {(g, b): d for g, b, d in ds}) for t, ids, ds in got["reads"]]
        out.append(got)
    return out


def attention_layers(llm) -> list[str]:
    """The names of the model's attention layers, in the layout's order."""
    return llm.collective_rpc(_attention_layers)[0]


def attention_unlike_stored(llm, endpoint: str, tokens: list[int], block_ids: list[list[int]],
                            digests: list, tp_rank: int = 0) -> list[str]:
    """Where the attention blocks an in-step load of rank `tp_rank` writes (`digests`: [group, block, digest]) do
    not hold the server's objects of `tokens`' prefix (that rank's shard), page for page. Empty when every one
    does."""
    have = {(g, b): d for g, b, d in digests}
    bad = []
    with _stored_objects(llm, endpoint, tokens, tp_rank=tp_rank) as (layout, chunk, objects, arena):
        for o in objects:
            grp = layout.groups[o.group]
            if grp.kind == "recurrent":
                continue
            ids = object_blocks(layout, chunk, o.group, o.chunk, block_ids[o.group])
            for j, b in enumerate(ids):
                at = [o.offset + (layer * len(ids) + j) * grp.page_bytes for layer in range(grp.num_layers)]
                if have.get((o.group, int(b))) != _digest(arena[a:a + grp.page_bytes] for a in at):
                    bad.append(f"group {o.group} chunk {o.chunk}: block {b}")
    return bad


def check_in_step_loads(llm, endpoint: str, got: dict, n_loads: int) -> None:
    """Every in-step load of one rank (`got`: `take`'s) wrote blocks that did not hold the server's bytes (that
    rank's shard) before its step and do after it; the attention layers of each step that had loads to wait for
    waited in the forward's order, each once."""
    rank = got["rank"]
    assert len(got["loads"]) == n_loads, (rank, [len(x[0]) for x in got["loads"]])
    for tokens, block_ids, before, after, _ in got["loads"]:
        assert before and len(before) == len(after)
        assert len(attention_unlike_stored(llm, endpoint, tokens, block_ids, before, rank)) == len(before), \
            f"rank {rank}: the {len(tokens)}-token hit's attention blocks held the server's bytes before its load"
        assert not (bad := attention_unlike_stored(llm, endpoint, tokens, block_ids, after, rank)), (rank, bad)
    layers = attention_layers(llm)
    by_step: dict[int, list[str]] = {}
    for step, name, pending in got["waits"]:
        assert pending > 0
        by_step.setdefault(step, []).append(name)
    assert by_step, f"rank {rank}: no attention layer waited for an in-step load"
    assert set(by_step) <= {load[4] for load in got["loads"]}, f"rank {rank}: a wait in a step without loads"
    assert all(names == layers for names in by_step.values()), (rank, by_step)


def _break_in_step_loads(worker) -> int:
    """In the worker: every hit held from now on copies from a connection whose retrieve raises (an arena that
    is gone), so that its in-step load fails."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    lw = get_kv_transfer_group().worker_side.layerwise
    hold = lw.hold

    class Gone:
        def retrieve(self, *args, **kwargs):
            raise OSError("injected: the arena mapping is gone")

        def release(self, hit) -> None:
            pass

        def close(self) -> None:
            pass

    def broken_hold(t, hit, job):
        part = hold(t, hit, job)
        lw._held[job.request_id].transfer = Gone()
        return part

    lw.hold = broken_hold
    return 0


def break_in_step_loads(llm) -> None:
    llm.collective_rpc(_break_in_step_loads)
