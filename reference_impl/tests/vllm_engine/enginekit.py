"""Helpers of the real-engine tests: tiny random-weight models written locally (config, weights and a tokenizer;
nothing is downloaded: the Qwen3-Next-shaped hybrid, and a Gemma 3 text model with sliding-window layers), vLLM
engines with the connector, greedy generation, and the tools that look inside: vLLM's KV cache zeroed, the
connector's counters, the server's stored objects corrupted on purpose."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hybridkv.engine.vllm.settings import kv_transfer_config
from hybridkv_bench.vllm_real import ModelShape, server_settled, write_model
from hybridkv_bench.vllm_real import prompt as _prompt

__all__ = ["ModelShape", "server_settled", "write_model"]
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


def generate(llm, prompts: list[list[int]], max_tokens: int = 12, salts: list[str | None] | None = None
             ) -> list[Generated]:
    """Greedy continuations of `prompts`, all in one batch (vLLM schedules them together)."""
    from vllm import SamplingParams

    items: list[dict[str, Any]] = []
    for i, p in enumerate(prompts):
        item: dict[str, Any] = {"prompt_token_ids": p}
        if salts is not None and salts[i] is not None:
            item["cache_salt"] = salts[i]
        items.append(item)
    outs = llm.generate(items, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [Generated(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)) for o in outs]


def _zero_kv(worker) -> int:
    """In the worker: zero every KV-cache tensor (attention pages and GDN states)."""
    n = 0
    for t in worker.model_runner.kv_caches:
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            x.zero_()
            n += 1
    return n


def _flush_connector(worker) -> int:
    """In the worker: wait until the connector's stores are committed and its sessions ended."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().worker_side.wait_idle(30)
    return 0


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
    from hybridkv.layout import ModelLayout

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


def corrupt_stored_pages(llm, endpoint: str, tokens: list[int], pages: Callable[[Any, int, Any], Any],
                         salt: str = "") -> int:
    """Overwrite, in the server's L1 arena, pages of the objects a lookup of `tokens`' prefix hands out:
    `pages(layout, chunk_tokens, object)` names the pages of that object to change (page l * blocks + j is
    layer l's copy of the object's block j), or None. Returns the number of objects changed."""
    from hybridkv import protocol as P
    from hybridkv.engine.client import CacheClient
    from hybridkv.keys import chunk_keys

    layout, chunk = connector_layout(llm)
    with CacheClient(endpoint, timeout_s=10) as c:
        reg, _ = c.call(P.Register(layout=layout, chunk_tokens=chunk, tp_rank=0, salt=salt, name="corrupter"))
        keys = chunk_keys(reg.namespace, tokens, chunk)
        hit, _ = c.call(P.Lookup(engine=reg.engine, request="corrupt", keys=keys, policy="boundary"))
        changed = 0
        fd = os.open(reg.arena_path, os.O_RDWR)
        try:
            with mmap.mmap(fd, reg.arena_bytes) as arena:
                for o in hit.objects:
                    which = pages(layout, chunk, o)
                    if which is None:
                        continue
                    page = layout.groups[o.group].page_bytes
                    for p in which:
                        view = np.frombuffer(arena, np.uint8, page, o.offset + p * page)
                        view += 77  # every byte other than it was (wraps around)
                        del view
                    changed += 1
        finally:
            os.close(fd)
        c.call(P.EndSession(engine=reg.engine, request="corrupt"))
        c.call(P.Unregister(engine=reg.engine))
    return changed
