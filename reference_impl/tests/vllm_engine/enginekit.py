"""Helpers of the real-engine tests: tiny random-weight models written locally (config, weights and a tokenizer;
nothing is downloaded: the Qwen3-Next-shaped hybrid, and a Gemma 3 text model with sliding-window layers), vLLM
engines with the connector, greedy generation (with the top-2 logprobs that `departure` reads), and the tools that
look inside: vLLM's KV cache zeroed, the connector's counters, the server's stored objects corrupted on purpose,
the blocks a request's first forward reads its prefix from compared byte for byte with the server's objects."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hybridkv.engine.vllm.settings import kv_transfer_config
from hybridkv_bench.greedy import NEAR_TIE, departure
from hybridkv_bench.vllm_real import ModelShape, server_settled, write_model
from hybridkv_bench.vllm_real import flush_connector as _flush_connector
from hybridkv_bench.vllm_real import prompt as _prompt

__all__ = ["NEAR_TIE", "ModelShape", "departure", "server_settled", "write_model"]
VOCAB = ModelShape().vocab


def prompt(n: int, seed: int) -> list[int]:
    """n token ids of the tiny hybrid's vocabulary (neither its unknown nor its end token)."""
    return _prompt(n, seed, VOCAB)


BLOCK = 128  # the tiny hybrid's unified block on vLLM's CPU backend (attention raised to hold a GDN state)
STEP_TOKENS = 2 * BLOCK  # a scheduler step; GDN states exist where steps end on block boundaries


def engine_args(model: Path, endpoint: str | None, **extra: Any) -> dict[str, Any]:
    """vLLM engine arguments: prefix caching (Mamba align mode), a GDN state kept at every block boundary,
    eager mode (no compile at start-up), a small CPU KV cache, and the connector when `endpoint` is given."""
    args: dict[str, Any] = dict(
        model=str(model), dtype="bfloat16", enable_prefix_caching=True, max_model_len=8192,
        max_num_batched_tokens=STEP_TOKENS, prefix_cache_retention_interval=BLOCK, enforce_eager=True,
        max_num_seqs=16, seed=0, kv_cache_memory_bytes=192 << 20, disable_log_stats=False)
    if endpoint is not None:
        args["kv_transfer_config"] = kv_transfer_config(endpoint, **extra)
    return args


def make_llm(model: Path, endpoint: str | None, **extra: Any):
    from vllm import LLM

    return LLM(**engine_args(model, endpoint, **extra))


def close_llm(llm) -> None:
    """Stop an engine and its processes now (a later engine in this process must not share them); again is
    a no-op."""
    import gc

    if not getattr(llm, "_hkv_closed", False):
        llm._hkv_closed = True
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


@dataclass(frozen=True, slots=True)
class Generated:
    tokens: list[int]
    cached: int  # vLLM's num_cached_tokens: its own prefix cache plus the connector's hit
    top: tuple[dict[int, float], ...] = ()  # per generated token, the logprobs of vLLM's two likeliest tokens


def generate(llm, prompts: list[list[int]], max_tokens: int = 12, salts: list[str | None] | None = None
             ) -> list[Generated]:
    """Greedy continuations of `prompts`, all in one batch (vLLM schedules them together), with the top two
    logprobs at every position (`departure` reads them)."""
    from vllm import SamplingParams

    items: list[dict[str, Any]] = []
    for i, p in enumerate(prompts):
        item: dict[str, Any] = {"prompt_token_ids": p}
        if salts is not None and salts[i] is not None:
            item["cache_salt"] = salts[i]
        items.append(item)
    outs = llm.generate(items, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    return [Generated(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0),
                      tuple({t: float(lp.logprob) for t, lp in d.items()} for d in o.outputs[0].logprobs or ()))
            for o in outs]


def departures(got: list[Generated], ref: list[Generated], tol: float = NEAR_TIE) -> list[tuple[int, str]]:
    """(index, why) of each of `got` that is not the continuation of its `ref` (`departure`)."""
    return [(i, why) for i, (g, r) in enumerate(zip(got, ref, strict=True)) if (why := departure(g, r, tol))]


def _zero_kv(worker) -> int:
    """In the worker: zero every KV-cache tensor (attention pages and GDN states)."""
    n = 0
    for t in worker.model_runner.kv_caches:
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            x.zero_()
            n += 1
    return n


def forget_local(llm) -> None:
    """Wait for the connector's stores, then drop everything vLLM itself holds: its prefix cache and the
    bytes of its KV cache, so that a warm request's prefix can only come from hybridkv."""
    llm.collective_rpc(_flush_connector)
    assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache (requests still running?)"
    assert all(n > 0 for n in llm.collective_rpc(_zero_kv))


def _connector_layout(worker):
    import msgspec
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    c = get_kv_transfer_group()
    return msgspec.msgpack.encode(c.layout), c.chunk_tokens  # bytes: vLLM's RPC would turn a Struct into a dict


def write_gemma3_model(directory: Path, sliding_window: int, pattern: str = "SSSF", seed: int = 0) -> Path:
    """A tiny random-weight Gemma 3 text model (Gemma3ForCausalLM): one character of `pattern` per layer, `S` a
    sliding-window layer of `sliding_window` tokens, `F` a full-attention one; the word-level tokenizer of the
    hybrid's vocabulary. Untied output weights and a wide initialisation keep its greedy tokens depending on the
    context (tied ones make Gemma repeat its input token)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=len(pattern),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=sliding_window, layer_types=["sliding_attention" if c == "S" else "full_attention"
                                                    for c in pattern],
        max_position_embeddings=1 << 14, tie_word_embeddings=False, initializer_range=0.08,
        architectures=["Gemma3ForCausalLM"], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    model: Any = Gemma3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(directory)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t0").save_pretrained(
        directory)
    return directory


def _worker_counters(worker) -> dict[str, int]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    st = get_kv_transfer_group().worker_side.stats
    return {k: getattr(st, k) for k in st.__slots__ if isinstance(getattr(st, k), int)}


def worker_counters(llm) -> dict[str, int]:
    """The connector's worker-side counters (loads, loaded_bytes, stores, stored_bytes, ...) of rank 0."""
    return llm.collective_rpc(_worker_counters)[0]


def connector_layout(llm):
    """The layout and chunk size the engine's connector derived from vLLM's KV-cache config."""
    import msgspec
    from hybridkv.model.layout import ModelLayout

    (encoded, chunk), *_ = llm.collective_rpc(_connector_layout)
    return msgspec.msgpack.decode(encoded, type=ModelLayout), chunk


def external_hits(llm) -> int:
    """vLLM's own counter of prefix tokens that came from the connector."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits"))


def corrupt_stored(llm, endpoint: str, tokens: list[int], kind: str, salt: str = "") -> int:
    """Overwrite, in the server's L1 arena, the stored objects of `tokens`' prefix of group kind `kind`
    ('attention' or 'recurrent') with other bytes: the negative control that shows a test can see wrong KV.
    Returns the number of objects changed."""
    def every_page(layout, chunk: int, o) -> range | None:
        g = layout.groups[o.group]
        return range(g.num_layers * g.tail_blocks(chunk)) if g.kind == kind else None

    return corrupt_stored_pages(llm, endpoint, tokens, every_page, salt)


@contextmanager
def _stored_objects(llm, endpoint: str, tokens: list[int], salt: str = "", tp_rank: int = 0):
    """(layout, chunk_tokens, the objects a lookup of `tokens`' prefix hands out under TP rank `tp_rank`'s
    namespace (that rank's shard), the server's arena mapped for writing), pinned until the block ends."""
    from hybridkv.engine.client import CacheClient
    from hybridkv.model.keys import chunk_keys
    from hybridkv.wire import protocol as P

    layout, chunk = connector_layout(llm)
    with CacheClient(endpoint, timeout_s=10) as c:
        reg, _ = c.call(P.Register(layout=layout, chunk_tokens=chunk, tp_rank=tp_rank, salt=salt, name="inspector"))
        try:
            keys = chunk_keys(reg.namespace, tokens, chunk)
            hit, _ = c.call(P.Lookup(engine=reg.engine, request="inspect", keys=keys, policy="boundary"))
            fd = os.open(reg.arena_path, os.O_RDWR)
            try:
                with mmap.mmap(fd, reg.arena_bytes) as arena:
                    yield layout, chunk, hit.objects, arena
            finally:
                os.close(fd)
            c.call(P.EndSession(engine=reg.engine, request="inspect"))
        finally:
            c.call(P.Unregister(engine=reg.engine))


def corrupt_stored_pages(llm, endpoint: str, tokens: list[int], pages: Callable[[Any, int, Any], Any],
                         salt: str = "") -> int:
    """Overwrite, in the server's L1 arena, pages of the objects a lookup of `tokens`' prefix hands out:
    `pages(layout, chunk_tokens, object)` names the pages of that object to change (page l * blocks + j is
    layer l's copy of the object's block j), or None. Returns the number of objects changed."""
    changed = 0
    with _stored_objects(llm, endpoint, tokens, salt) as (layout, chunk, objects, arena):
        for o in objects:
            which = pages(layout, chunk, o)
            if which is None:
                continue
            page = layout.groups[o.group].page_bytes
            for p in which:
                view = np.frombuffer(arena, np.uint8, page, o.offset + p * page)
                view += 77  # every byte other than it was (wraps around)
                del view
            changed += 1
    return changed


def _digest(pages) -> str:
    """One block's pages, every layer's, as one digest."""
    h = hashlib.blake2b(digest_size=16)
    for p in pages:
        h.update(p)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class PrefixRead:
    """What a request's first forward found in the blocks of its computed prefix (`watch_prefix_reads`)."""

    tokens: list[int]  # the prefix: num_computed_tokens when first scheduled
    block_ids: list[list[int]]  # vLLM's block table then, per group
    digests: dict[tuple[int, int], str]  # (group, block id) -> digest of its pages, taken before that forward


def _watch_prefix_reads(worker) -> int:
    """In the worker: from now on, right before each forward, digest every block that a request scheduled for the
    first time with a computed prefix reads it from (attention: the prefix's blocks; recurrent: the state block
    at its end, which vLLM's align mode copies into the request's running block before the forward)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    runner = worker.model_runner
    if hasattr(runner, "_hkv_prefix_reads"):  # watched already
        runner._hkv_prefix_reads.clear()
        return 0
    ws = get_kv_transfer_group().worker_side
    groups = ws.layout.groups
    reads = runner._hkv_prefix_reads = []
    pending: list = []
    execute, forward = runner.execute_model, runner._model_forward

    def watched_execute(scheduler_output, *args, **kwargs):
        pending[:] = [r for r in scheduler_output.scheduled_new_reqs if r.num_computed_tokens > 0]
        return execute(scheduler_output, *args, **kwargs)

    def watched_forward(*args, **kwargs):
        for r in pending:
            n = r.num_computed_tokens
            digests = []
            for g, (grp, ids) in enumerate(zip(groups, r.block_ids, strict=True)):
                read = [ids[(n - 1) // grp.block_tokens]] if grp.kind == "recurrent" else ids[:n // grp.block_tokens]
                digests += [[g, b, _digest(t[b].numpy().tobytes() for t in ws._pages[g])] for b in read]
            reads.append([list(r.prompt_token_ids[:n]), [list(x) for x in r.block_ids], digests])
        pending.clear()
        return forward(*args, **kwargs)

    runner.execute_model, runner._model_forward = watched_execute, watched_forward
    return 0


def _digest_blocks(worker, blocks: list[list[int]]) -> list[str]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    pages = get_kv_transfer_group().worker_side._pages
    return [_digest(t[b].numpy().tobytes() for t in pages[g]) for g, b in blocks]


def read_again(llm, read: PrefixRead) -> PrefixRead:
    """The same blocks' digests now (e.g. after `forget_local` zeroed them): `unlike_stored`'s negative control."""
    blocks = [list(k) for k in read.digests]
    now = llm.collective_rpc(_digest_blocks, args=(blocks,))[0]
    return PrefixRead(read.tokens, read.block_ids, {(g, b): d for (g, b), d in zip(blocks, now, strict=True)})


def _take_prefix_reads(worker) -> list:
    reads = worker.model_runner._hkv_prefix_reads
    taken = list(reads)
    reads.clear()
    return taken


def watch_prefix_reads(llm) -> None:
    """Digest, in rank 0's worker, the blocks each request's first forward reads its computed prefix from
    (`prefix_reads` returns them). It only reads: vLLM's forward and the connector run as they would."""
    llm.collective_rpc(_watch_prefix_reads)


def prefix_reads(llm) -> list[PrefixRead]:
    """The prefixes read since the last call (`watch_prefix_reads`)."""
    return [PrefixRead(tokens, ids, {(g, b): d for g, b, d in digests})
            for tokens, ids, digests in llm.collective_rpc(_take_prefix_reads)[0]]


def unlike_stored(llm, endpoint: str, read: PrefixRead, salt: str = "", tp_rank: int = 0) -> list[str]:
    """Where the blocks a forward read its prefix from (`prefix_reads`, of rank `tp_rank`) are not the bytes of
    the server's objects of that prefix (that rank's shard), page for page: each block vLLM's block table names
    for an object's chunk, or a missing object or block. Empty when the forward read exactly what the server
    holds."""
    from hybridkv.model.policy import object_blocks

    bad: list[str] = []
    covered: set[tuple[int, int]] = set()
    with _stored_objects(llm, endpoint, read.tokens, salt, tp_rank) as (layout, chunk, objects, arena):
        if len(objects) == 0 or max(o.chunk for o in objects) + 1 != len(read.tokens) // chunk:
            bad.append(f"the server's objects end at chunk {max((o.chunk for o in objects), default=-1)}, the "
                       f"prefix at {len(read.tokens) // chunk}")
        for o in objects:
            grp = layout.groups[o.group]
            ids = object_blocks(layout, chunk, o.group, o.chunk, read.block_ids[o.group])
            for j, b in enumerate(ids):
                covered.add((o.group, b))
                at = [o.offset + (layer * len(ids) + j) * grp.page_bytes for layer in range(grp.num_layers)]
                stored = _digest(arena[a:a + grp.page_bytes] for a in at)
                if read.digests.get((o.group, b)) != stored:
                    bad.append(f"group {o.group} chunk {o.chunk}: block {b} holds other bytes than the object")
    bad += [f"group {g}: block {b} read, no object carries it" for g, b in read.digests if (g, b) not in covered]
    return bad
