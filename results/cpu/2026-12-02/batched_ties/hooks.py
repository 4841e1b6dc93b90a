"""Instrumentation installed in the engine-core process (collective_rpc): per-load block ids, load end step,
block hashes at store, at load end and at the first step the request computes; zeroed blocks."""
from __future__ import annotations

import hashlib
import json
import os

STATE = {"step": 0, "loads": {}, "consumed": set()}


def _log(rec):
    with open(STATE["path"], "a") as f:
        f.write(json.dumps(rec) + "\n")


def _block_hash(ws, g, b):
    h = hashlib.blake2b(digest_size=12)
    for t in ws._pages[g]:
        h.update(t[b].contiguous().view(-1).numpy().tobytes() if hasattr(t[b], "numpy") else bytes(t[b]))
    return h.hexdigest()


def _tok_hash(tokens):
    return hashlib.blake2b(bytes(json.dumps(list(tokens)), "ascii"), digest_size=12).hexdigest()


def install(worker, path):
    from hybridkv.engine.vllm import worker_side as W
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    STATE["path"] = path
    conn = get_kv_transfer_group()
    ws = conn.worker_side
    layout = ws.layout
    B = [g.block_tokens for g in layout.groups]
    kinds = [g.kind for g in layout.groups]
    chunk = ws.chunk_tokens
    _log({"ev": "install", "pid": os.getpid(), "kinds": kinds, "block": B, "chunk": chunk})

    orig_start = W.WorkerSide.start_load
    orig_results = W.WorkerSide.transfer_results
    orig_save = W.WorkerSide.save

    def start_load(self, meta):
        for job in meta.loads:
            STATE["loads"][job.request_id] = {"hit": len(job.token_ids), "skip": job.skip_tokens,
                                              "ids": [list(map(int, x)) for x in job.block_ids],
                                              "tokens": list(job.token_ids), "start_step": STATE["step"]}
            _log({"ev": "start_load", "step": STATE["step"], "rid": job.request_id, "hit": len(job.token_ids),
                  "skip": job.skip_tokens, "ids": [list(map(int, x)) for x in job.block_ids],
                  "refused": job.refused})
        return orig_start(self, meta)

    def hashes_of(self, ld):
        hit = ld["hit"]
        out = {}
        for g, kind in enumerate(kinds):
            ids = ld["ids"][g]
            if kind == "recurrent":
                j = hit // B[g] - 1
                out[f"{g}:{j}"] = [ids[j], _block_hash(self, g, ids[j]), _tok_hash(ld["tokens"][:hit])]
            else:
                for j in range(ld["skip"] // B[g], hit // B[g]):
                    if ids[j] >= 0:
                        out[f"{g}:{j}"] = [ids[j], _block_hash(self, g, ids[j]),
                                           _tok_hash(ld["tokens"][:(j + 1) * B[g]])]
        return out

    def transfer_results(self):
        pending = {rid: ld.handle for rid, ld in self._loads.items()}
        finished, failed = orig_results(self)
        for rid in finished:
            ld = STATE["loads"].get(rid)
            if ld is None:
                continue
            ld["end_step"] = STATE["step"]
            ld["failed"] = rid in failed
            if rid not in failed:
                ld["hashes"] = hashes_of(self, ld)
            _log({"ev": "load_end", "step": STATE["step"], "rid": rid, "failed": rid in failed,
                  "hashes": ld.get("hashes"), "had_handle": pending.get(rid) is not None})
        return finished, failed

    def save(self, meta):
        r = orig_save(self, meta)
        for job in meta.stores:
            n = len(job.token_ids) // chunk
            rec = {}
            for g, kind in enumerate(kinds):
                bpc = chunk // B[g]
                ids = job.block_ids[g]
                if kind == "recurrent":
                    j = n * bpc - 1
                    rec[f"{g}:{j}"] = [int(ids[j]), _block_hash(self, g, int(ids[j])),
                                       _tok_hash(job.token_ids[:n * chunk])]
                else:
                    for j in range(job.start_chunk * bpc, n * bpc):
                        if int(ids[j]) >= 0:
                            rec[f"{g}:{j}"] = [int(ids[j]), _block_hash(self, g, int(ids[j])),
                                               _tok_hash(job.token_ids[:(j + 1) * B[g]])]
            _log({"ev": "store", "step": STATE["step"], "rid": job.request_id, "start": job.start_chunk, "n": n,
                  "hashes": rec})
        return r

    W.WorkerSide.start_load = start_load
    W.WorkerSide.transfer_results = transfer_results
    W.WorkerSide.save = save

    mr = worker.model_runner
    orig_exec = mr.execute_model
    orig_zero = mr._zero_block_ids

    def live_loaded():
        # blocks of loads not yet computed by their request
        out = {}
        for rid, ld in STATE["loads"].items():
            if rid in STATE["consumed"]:
                continue
            for g, ids in enumerate(ld["ids"]):
                for b in ids:
                    if b > 0:
                        out.setdefault((g, b), []).append(rid)
        return out

    def zero(block_ids):
        live = live_loaded()
        hits = [(b, live[(g, b)]) for b in block_ids for g in range(len(kinds)) if (g, b) in live]
        _log({"ev": "zero", "step": STATE["step"], "n": len(block_ids), "hits_loaded": hits})
        return orig_zero(block_ids)

    def execute_model(scheduler_output, *a, **k):
        STATE["step"] += 1
        step = STATE["step"]
        comp = dict(scheduler_output.num_scheduled_tokens)
        new = []
        for nr in scheduler_output.scheduled_new_reqs:
            ld = STATE["loads"].get(nr.req_id)
            rec = {"rid": nr.req_id, "nc": nr.num_computed_tokens, "sched": comp.get(nr.req_id),
                   "ids_len": [len(x) for x in nr.block_ids]}
            if ld is not None and ld.get("hashes") is not None and nr.req_id not in STATE["consumed"]:
                STATE["consumed"].add(nr.req_id)
                mism = []
                for key, (bid, hsh, _th) in ld["hashes"].items():
                    g, j = map(int, key.split(":"))
                    if kinds[g] == "recurrent":
                        want = (nr.num_computed_tokens - 1) // B[g]
                        if want != j:
                            mism.append(["state-index", key, want])
                    if j >= len(nr.block_ids[g]) or nr.block_ids[g][j] != bid:
                        mism.append(["block-id", key, bid, nr.block_ids[g][j] if j < len(nr.block_ids[g]) else None])
                    now = _block_hash(ws, g, bid)
                    if now != hsh:
                        mism.append(["changed", key, bid])
                rec.update({"loaded": True, "hit": ld["hit"], "start_step": ld["start_step"],
                            "end_step": ld.get("end_step"), "problems": mism})
            new.append(rec)
        cached = scheduler_output.scheduled_cached_reqs
        _log({"ev": "step", "step": step, "comp": comp, "new": new,
              "resumed": list(getattr(cached, "resumed_req_ids", []) or [])})
        return orig_exec(scheduler_output, *a, **k)

    mr.execute_model = execute_model
    mr._zero_block_ids = zero
    return os.getpid()
