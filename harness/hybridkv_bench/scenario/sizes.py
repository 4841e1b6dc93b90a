"""Scenario sizes: bytes a prefix or a workload stores, the checks that need the model's layout (run at
load time: chunk size, L1 against one request, every workload's working set against L1 + L2), and
`scaled`, which shrinks a scenario for quick CPU runs ("shortened by a flag, not by separate files")."""

from __future__ import annotations

import math

import msgspec
from hybridkv.layout import LayoutError, ModelLayout
from hybridkv.presets import hybrid_layout

from hybridkv_bench.engines.hf.spec import transformers_problem
from hybridkv_bench.scenario.spec import GIB, RooflinePrefill, Scenario, ScenarioError, expand_matrix
from hybridkv_bench.scenario.workloads import (
    Divergence,
    FanOut,
    L1Pressure,
    LongDocQA,
    MultiEngine,
    MultiTurn,
    StoreWhileLoad,
    Workload,
)

# ---- sizes ---------------------------------------------------------------------------------------

def prefix_bytes(layout: ModelLayout, chunk_tokens: int, tokens: int, policy: str) -> int:
    """Bytes of the cached objects of a `tokens`-long prefix (full chunks only) under a store or
    retrieve policy: `all` = every group for every chunk; `boundary` = attention for every chunk and
    recurrent state only at the last one (what resuming the prefix needs)."""
    n = tokens // chunk_tokens
    if n == 0:
        return 0
    attn = sum(layout.object_bytes(g, chunk_tokens) for g in layout.attention_groups)
    rec = sum(layout.object_bytes(g, chunk_tokens) for g in layout.recurrent_groups)
    return n * attn + (n if policy == "all" else 1) * rec


def request_prefix_tokens(w: Workload) -> int:
    """Tokens of the longest prefix one request of the workload expects to find cached."""
    match w:
        case LongDocQA() | Divergence() | L1Pressure() | MultiEngine() | StoreWhileLoad():
            return w.prompt_tokens
        case MultiTurn():
            return w.system_tokens + (w.turns - 1) * w.turn_tokens
        case FanOut():
            return w.system_tokens
    raise AssertionError(w)


def working_set_bytes(w: Workload, layout: ModelLayout, chunk_tokens: int, policy: str) -> int:
    """Bytes the workload stores into the cache (all documents, conversations, branches, ranks)."""
    one = lambda tokens: prefix_bytes(layout, chunk_tokens, tokens, policy)  # noqa: E731
    match w:
        case LongDocQA():
            return w.documents * one(w.prompt_tokens + w.question_tokens)
        case MultiTurn():
            passes = 3 if w.prefetch == "compare" else 1  # l1, l2, l2_prefetch: fresh conversations each
            return passes * w.conversations * one(w.system_tokens + w.turns * w.turn_tokens)
        case FanOut():
            shared = one(w.system_tokens)
            return shared + w.requests * (one(w.system_tokens + w.user_tokens) - shared)
        case Divergence():
            return 2 * one(w.prompt_tokens)
        case L1Pressure():
            return w.documents * one(w.prompt_tokens)
        case MultiEngine():
            return w.engines * one(w.prompt_tokens)
        case StoreWhileLoad():
            return (w.rounds + 1) * one(w.prompt_tokens)
    raise AssertionError(w)


# ---- validation ----------------------------------------------------------------------------------

def validate(scenario: Scenario, source: str = "<scenario>") -> None:
    """Check what the types cannot: the model against the presets, sizes against the layout."""
    def fail(msg: str) -> ScenarioError:
        return ScenarioError(f"{source}: {msg}")

    try:
        cfg = scenario.model.config()
        layout = hybrid_layout(cfg, scenario.model.tp)
    except (LayoutError, TypeError) as e:
        raise fail(f"model: {e}") from None
    chunk = scenario.model.chunk_tokens
    if chunk < 0:
        raise fail(f"model.chunk_tokens must be >= 0 (0 = the unified block size), got {chunk}")
    chunk = chunk or layout.default_chunk_tokens()
    try:
        layout.check_chunk_tokens(chunk)
    except LayoutError as e:
        raise fail(f"model.chunk_tokens: {e}") from None
    chunk_bytes = layout.chunk_bytes(chunk)
    if scenario.server.l1_bytes < chunk_bytes:
        raise fail(f"server.l1_gib {scenario.server.l1_gib} is smaller than one chunk of {layout.model} "
                   f"at tp={scenario.model.tp} ({chunk} tokens = {chunk_bytes / GIB:.4f} GiB)")
    roofline = isinstance(scenario.prefill, RooflinePrefill)
    if roofline and (cfg.active_params <= 0 or cfg.num_attention_heads <= 0):
        raise fail(f"prefill: the roofline needs active_params and num_attention_heads of {layout.model}; "
                   "set them in [model.overrides] or use kind = \"tokens_per_s\"")
    if scenario.engine == "transformers" and (
            problem := transformers_problem(scenario.transformers, cfg, [w.kind for w in scenario.workloads])):
        raise fail(problem)
    # Cases are expanded here so that a dead exclude entry is reported at load time.
    try:
        expand_matrix(scenario)
    except ScenarioError as e:
        raise fail(str(e).removeprefix(f"{scenario.name}: ")) from None
    smallest = "boundary" if "boundary" in scenario.matrix.store_policy else "all"
    for i, w in enumerate(scenario.workloads):
        where = f"workloads[{i}] ({w.label})"
        prefix = request_prefix_tokens(w)
        if prefix < chunk:
            raise fail(f"{where}: a {prefix}-token prefix is shorter than one {chunk}-token chunk, "
                       "so nothing would ever be cached")
        if isinstance(w, Divergence) and w.prompt_tokens < 2 * chunk:
            raise fail(f"{where}: prompt_tokens {w.prompt_tokens} must span at least 2 chunks ({2 * chunk})")
        one = prefix_bytes(layout, chunk, prefix, smallest)
        if one > scenario.server.l1_bytes:
            raise fail(f"{where}: one request's {prefix}-token prefix needs {one / GIB:.3f} GiB, more than "
                       f"server.l1_gib {scenario.server.l1_gib}: no warm request could ever hit")
        if isinstance(w, L1Pressure):
            total = working_set_bytes(w, layout, chunk, smallest)
            if total <= scenario.server.l1_bytes:
                raise fail(f"{where}: {w.documents} x {w.prompt_tokens} tokens store {total / GIB:.3f} GiB, "
                           f"which fits in server.l1_gib {scenario.server.l1_gib}: nothing would spill")
            if scenario.server.l2_gib <= 0:
                raise fail(f"{where}: needs an L2 to spill to (server.l2_gib is 0)")
        if isinstance(w, MultiTurn) and (problem := _prefetch_problem(w, scenario, layout, chunk, smallest)):
            raise fail(f"{where}: {problem}")
        room = scenario.server.l1_bytes + scenario.server.l2_bytes
        if not isinstance(w, L1Pressure) or scenario.server.l2_gib > 0:
            # Hits are checked exactly, with no model of eviction: what a case stores must stay cached.
            # Under L1 alone it must fit L1; with an L2 behind it, L1 + L2 (evicted objects spill there).
            for policy in scenario.matrix.store_policy:
                total = working_set_bytes(w, layout, chunk, policy)
                if total > room:
                    tiers = (f"server.l1_gib {scenario.server.l1_gib:g} + l2_gib {scenario.server.l2_gib:g}"
                             if scenario.server.l2_gib > 0 else f"server.l1_gib {scenario.server.l1_gib:g} (no L2)")
                    raise fail(f"{where}: its working set under store_policy {policy!r} is {total / GIB:.2f} GiB, "
                               f"more than {tiers} = {room / GIB:.2f} GiB hold; early prefixes would be evicted "
                               "and their hits lost (raise l1_gib, add an L2, or shrink the workload)")


def _prefetch_problem(w: MultiTurn, scenario: Scenario, layout: ModelLayout, chunk: int, policy: str) -> str:
    """Why a multi_turn's prefetch setting cannot measure what it is for ("" when it can)."""
    if w.prefetch == "off":
        return ""
    if scenario.server.l2_gib <= 0:
        return f"prefetch = {w.prefetch!r} brings prefixes back from L2, and server.l2_gib is 0"
    if scenario.engine == "vllm":
        return "prefetch hints are sent by the sim and transformers engines; the vllm engine sends none"
    if w.prefetch != "compare":
        return ""
    l1 = scenario.server.l1_bytes
    conv = prefix_bytes(layout, chunk, w.system_tokens + w.turns * w.turn_tokens, policy)
    if conv > l1:
        return (f"one conversation stores {conv / GIB:.3f} GiB, more than server.l1_gib {scenario.server.l1_gib:g}: "
                "the l1 tier would not come from L1")
    # Between two turns of one conversation the others each look up and store at least their first
    # turn's prefix: that must exceed L1 for this conversation's prefix to have left it.
    others = (w.conversations - 1) * prefix_bytes(layout, chunk, w.system_tokens + w.turn_tokens, policy)
    if others <= l1:
        return (f"the other {w.conversations - 1} conversations' first turns store {others / GIB:.3f} GiB, which "
                f"fits in server.l1_gib {scenario.server.l1_gib:g}: the l2 tiers would still come from L1 "
                "(add conversations or shrink L1)")
    return ""


# ---- scaling -------------------------------------------------------------------------------------

def scaled(scenario: Scenario, factor: float) -> Scenario:
    """A smaller copy for quick runs: token counts and request counts times `factor`.

    Prompt and system prefixes become multiples of the chunk size, at least 2 chunks and never more
    than before; a turn grows the prefix by whole chunks, at least one; tails (question, user) keep at
    least 1 token. Counts keep what the workload is for: at least 1 document or conversation, 3 turns
    (two resumes), 2 fan-out requests (one reuser); engines stay one per rank. L1 and L2 shrink with
    the largest workload's footprint (L1 to at least 4 chunks, and never below what fitted before);
    an l1_pressure workload gets as many documents as it takes to exceed the new L1 by half again.
    """
    if not 0 < factor <= 1:
        raise ScenarioError(f"{scenario.name}: scale factor must lie in (0, 1], got {factor}")
    layout = scenario.model.layout()
    chunk = scenario.model.resolved_chunk_tokens(layout)

    def prefix(tokens: int) -> int:
        if tokens < 2 * chunk:
            return tokens
        return min(tokens // chunk * chunk, max(2, math.floor(tokens * factor / chunk)) * chunk)

    def step(tokens: int) -> int:
        if tokens < chunk:
            return tokens
        return min(tokens // chunk * chunk, max(1, math.floor(tokens * factor / chunk)) * chunk)

    def tail(tokens: int) -> int:
        return max(1, round(tokens * factor))

    def count(n: int, least: int) -> int:
        return min(n, max(least, round(n * factor)))

    def shrink(w: Workload) -> Workload:
        r = msgspec.structs.replace
        match w:
            case LongDocQA():
                return r(w, prompt_tokens=prefix(w.prompt_tokens), question_tokens=tail(w.question_tokens),
                         documents=count(w.documents, 1))
            case MultiTurn():
                return r(w, system_tokens=prefix(w.system_tokens), turn_tokens=step(w.turn_tokens),
                         turns=count(w.turns, 3),
                         conversations=count(w.conversations, 2 if w.prefetch == "compare" else 1))
            case FanOut():
                return r(w, system_tokens=prefix(w.system_tokens), user_tokens=tail(w.user_tokens),
                         requests=count(w.requests, 2))
            case L1Pressure():
                return r(w, prompt_tokens=prefix(w.prompt_tokens), documents=count(w.documents, 1))
            case StoreWhileLoad():
                return r(w, prompt_tokens=prefix(w.prompt_tokens), rounds=count(w.rounds, 1))
            case Divergence() | MultiEngine():
                return r(w, prompt_tokens=prefix(w.prompt_tokens))
        raise AssertionError(w)

    workloads = tuple(shrink(w) for w in scenario.workloads)
    smallest = "boundary" if "boundary" in scenario.matrix.store_policy else "all"
    size = lambda w, policy="all": working_set_bytes(w, layout, chunk, policy) / GIB  # noqa: E731
    ratio = max(size(w) for w in workloads) / max(size(w) for w in scenario.workloads)
    l1 = max(scenario.server.l1_gib * ratio, 4 * layout.chunk_bytes(chunk) / GIB)
    l2 = scenario.server.l2_gib * ratio
    for old, new in zip(scenario.workloads, workloads, strict=True):
        if isinstance(new, L1Pressure):
            continue
        # What fitted before still fits; one request's prefix always fits (validate demands it).
        if size(old) <= scenario.server.l1_gib:
            l1 = max(l1, size(new))
        l1 = max(l1, prefix_bytes(layout, chunk, request_prefix_tokens(new), smallest) / GIB)
        if isinstance(new, MultiTurn) and new.prefetch == "compare":  # the l1 tier: one conversation fits
            l1 = max(l1, prefix_bytes(layout, chunk, new.system_tokens + new.turns * new.turn_tokens, smallest) / GIB)
    fixed = []
    for old, w in zip(scenario.workloads, workloads, strict=True):
        if isinstance(w, MultiTurn) and w.prefetch == "compare":
            # enough interleaved conversations to push each other out of the new L1, as before scaling
            first = prefix_bytes(layout, chunk, w.system_tokens + w.turn_tokens, smallest) / GIB
            w = msgspec.structs.replace(w, conversations=max(w.conversations, math.floor(l1 / first) + 2))
            l2 = max(l2, size(w, smallest))
        if isinstance(w, L1Pressure):
            if size(w, smallest) <= l1:
                doc = prefix_bytes(layout, chunk, w.prompt_tokens, smallest) / GIB
                w = msgspec.structs.replace(w, documents=math.ceil(1.5 * l1 / doc))
            if size(old, smallest) <= scenario.server.l2_gib:
                l2 = max(l2, size(w, smallest))
        fixed.append(w)
    server = msgspec.structs.replace(scenario.server, l1_gib=l1, l2_gib=l2)
    out = msgspec.structs.replace(scenario, workloads=tuple(fixed), server=server)
    validate(out, f"{scenario.name} scaled by {factor}")
    return out
