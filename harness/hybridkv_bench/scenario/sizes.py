"""Scenario sizes: bytes a prefix or a workload stores, the checks that need the model's layout (run at
load time: chunk size, L1 against one request, every workload's working set against L1 + L2), and
`scaled`, which shrinks a scenario for quick CPU runs ("shortened by a flag, not by separate files")."""

from __future__ import annotations

import math

import msgspec
from hybridkv.model.layout import LayoutError, ModelLayout

from hybridkv_bench.engines.hf.spec import transformers_problem
from hybridkv_bench.engines.registry import engine_kind
from hybridkv_bench.prefill import RooflinePrefill
from hybridkv_bench.scenario.spec import Scenario, ScenarioError, expand_matrix
from hybridkv_bench.server_spec import GIB
from hybridkv_bench.workloads.base import Shrink, Sizing, WorkloadKind

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


def request_prefix_tokens(w: WorkloadKind) -> int:
    """Tokens of the longest prefix one request of the workload expects to find cached."""
    return w.prefix_tokens()


def working_set_bytes(w: WorkloadKind, layout: ModelLayout, chunk_tokens: int, policy: str) -> int:
    """Bytes the workload stores into the cache (all documents, conversations, branches, ranks)."""
    return w.working_set(lambda tokens: prefix_bytes(layout, chunk_tokens, tokens, policy))


# ---- validation ----------------------------------------------------------------------------------

def validate(scenario: Scenario, source: str = "<scenario>") -> None:
    """Check what the types cannot: the model against the presets, sizes against the layout."""
    def fail(msg: str) -> ScenarioError:
        return ScenarioError(f"{source}: {msg}")

    try:
        cfg = scenario.model.config()
        layout = cfg.layout(scenario.model.tp)
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
    smallest = "boundary" if "boundary" in scenario.matrix.values("store_policy") else "all"
    sizing = Sizing(scenario.server, engine_kind(scenario.engine).sends_prefetch, layout, chunk,
                    lambda tokens: prefix_bytes(layout, chunk, tokens, smallest))
    for i, w in enumerate(scenario.workloads):
        where = f"workloads[{i}] ({w.label})"
        prefix = request_prefix_tokens(w)
        if prefix < chunk:
            raise fail(f"{where}: a {prefix}-token prefix is shorter than one {chunk}-token chunk, "
                       "so nothing would ever be cached")
        one = prefix_bytes(layout, chunk, prefix, smallest)
        if one > scenario.server.l1_bytes:
            raise fail(f"{where}: one request's {prefix}-token prefix needs {one / GIB:.3f} GiB, more than "
                       f"server.l1_gib {scenario.server.l1_gib}: no warm request could ever hit")
        if problem := w.problem(sizing):
            raise fail(f"{where}: {problem}")
        room = scenario.server.l1_bytes + scenario.server.l2_bytes
        if not w.spills or scenario.server.l2_gib > 0:
            # Hits are checked exactly, with no model of eviction: what a case stores must stay cached.
            # Under L1 alone it must fit L1; with an L2 behind it, L1 + L2 (evicted objects spill there).
            for policy in scenario.matrix.values("store_policy"):
                total = working_set_bytes(w, layout, chunk, policy)
                if total > room:
                    tiers = (f"server.l1_gib {scenario.server.l1_gib:g} + l2_gib {scenario.server.l2_gib:g}"
                             if scenario.server.l2_gib > 0 else f"server.l1_gib {scenario.server.l1_gib:g} (no L2)")
                    raise fail(f"{where}: its working set under store_policy {policy!r} is {total / GIB:.2f} GiB, "
                               f"more than {tiers} = {room / GIB:.2f} GiB hold; early prefixes would be evicted "
                               "and their hits lost (raise l1_gib, add an L2, or shrink the workload)")


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

    rule = Shrink(prefix=prefix, step=step, tail=tail, count=count)
    workloads = tuple(w.shrink(rule) for w in scenario.workloads)
    smallest = "boundary" if "boundary" in scenario.matrix.values("store_policy") else "all"
    size = lambda w, policy="all": working_set_bytes(w, layout, chunk, policy) / GIB  # noqa: E731
    ratio = max(size(w) for w in workloads) / max(size(w) for w in scenario.workloads)
    l1 = max(scenario.server.l1_gib * ratio, 4 * layout.chunk_bytes(chunk) / GIB)
    l2 = scenario.server.l2_gib * ratio
    one = lambda tokens: prefix_bytes(layout, chunk, tokens, smallest)  # noqa: E731
    for old, new in zip(scenario.workloads, workloads, strict=True):
        if new.spills:
            continue
        # What fitted before still fits; one request's prefix always fits (validate demands it).
        if size(old) <= scenario.server.l1_gib:
            l1 = max(l1, size(new))
        l1 = max(l1, new.least_l1_gib(one))
    fixed = []
    for old, w in zip(scenario.workloads, workloads, strict=True):
        w = w.refit(l1, one)
        if w.l2_holds(size(old, smallest) <= scenario.server.l2_gib):
            l2 = max(l2, size(w, smallest))
        fixed.append(w)
    server = msgspec.structs.replace(scenario.server, l1_gib=l1, l2_gib=l2)
    out = msgspec.structs.replace(scenario, workloads=tuple(fixed), server=server)
    validate(out, f"{scenario.name} scaled by {factor}")
    return out
