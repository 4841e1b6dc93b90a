"""The transformers engine on CPU: tiny Qwen3.5 and Qwen3-Next caches through a real cache server and back,
the logits oracle passing on shm and pickle, and every control that breaks a restore failing it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from benchkit import SCENARIOS  # noqa: E402
from hybridkv.engine.transfer import KVTransfer, TransferConfig  # noqa: E402
from hybridkv.model.presets.gated_deltanet import TINY_HYBRID  # noqa: E402
from hybridkv.server.books.config import GIB, ServerConfig  # noqa: E402
from hybridkv.server.front.launch import start_server  # noqa: E402
from hybridkv_bench.engines.hf.engine import HFEngine  # noqa: E402
from hybridkv_bench.engines.hf.model import HFModelError, build_model  # noqa: E402
from hybridkv_bench.engines.hf.oracle import CONTROLS, judge  # noqa: E402
from hybridkv_bench.engines.hf.spec import TransformersSpec  # noqa: E402
from hybridkv_bench.engines.pools import EnginePools  # noqa: E402
from hybridkv_bench.scenario.load import decode_scenario
from hybridkv_bench.scenario.spec import ScenarioError  # noqa: E402

CFG = dataclasses.replace(TINY_HYBRID, kv_dtype="float32", conv_dtype="float32")
LAYOUT = CFG.layout()
CHUNK = LAYOUT.default_chunk_tokens()  # 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared CPU: one torch thread (two spinning ones are 10x slower under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def model(request):
    return build_model(TransformersSpec(arch=request.param), CFG, torch.device("cpu"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    # a private arena folder: another machine user's server start cannot take this arena for a dead one's
    srv = start_server(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=int(0.05 * GIB), l1_dir=str(d)))
    yield srv
    srv.stop()
    srv.close()


def _engine(server, model, fmt: str, policy: str, salt: str, **kw) -> HFEngine:
    pools = EnginePools.for_prompts(LAYOUT, 5 * CHUNK, torch.device("cpu"))
    kv = KVTransfer(server.endpoint, LAYOUT, pools.pages, TransferConfig(
        wire_format=fmt, retrieve_policy=policy, store_policy=policy, salt=salt))
    return HFEngine(kv, model, pools, lambda new, cached: 0.0, **kw)


def _doc(seed: int, n: int = 3 * CHUNK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 151_936, n)


def _tail(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed + 1000).integers(0, 151_936, n)


@pytest.mark.parametrize("fmt,policy", [("shm", "boundary"), ("pickle", "all")])
def test_warm_continuation_passes_the_oracle(server, model, fmt, policy):
    eng = _engine(server, model, fmt, policy, f"pass-{fmt}-{policy}-{model.spec.arch}")
    try:
        doc = _doc(1)
        cold = eng.run("cold", np.concatenate([doc, _tail(1, 7)]))
        assert cold.hit_tokens == 0 and cold.oracle_pass is None and cold.bytes_stored > 0
        assert cold.prefill_measured_s > 0 and cold.ttft_measured_s == cold.prefill_measured_s
        warm = eng.run("warm", np.concatenate([doc, _tail(2, 9)]))
        assert warm.hit_tokens == 3 * CHUNK and warm.bytes_loaded > 0
        v = eng.last_verdict
        assert v is not None and v.bitwise_equal and v.split_max_abs_diff == 0.0
        assert v.full_max_abs_diff <= 1e-5 and v.argmax_equal
        assert warm.oracle_pass is True and warm.logits_bitwise_equal is True
        assert warm.verified_chunks == 3 and warm.corrupt_chunks == 0
        assert warm.ttft_measured_s == pytest.approx(warm.lookup_s + warm.load_s + warm.prefill_measured_s)
    finally:
        eng.kv.close()


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_every_control_fails_the_oracle(server, model, control):
    # `all` stores and loads every chunk's state, so the wrong-boundary control has an earlier one to use
    eng = _engine(server, model, "shm", "all", f"control-{control}-{model.spec.arch}", control=CONTROLS[control])
    try:
        doc = _doc(2)
        eng.control = None
        eng.run("cold", np.concatenate([doc, _tail(3, 5)]))
        eng.control = CONTROLS[control]
        warm = eng.run("warm", np.concatenate([doc, _tail(4, 11)]))
        assert warm.hit_tokens == 3 * CHUNK
        assert warm.oracle_pass is False and warm.logits_bitwise_equal is False
        assert warm.corrupt_chunks == 3 and warm.verified_chunks == 0
    finally:
        eng.kv.close()


def test_full_prompt_hit_without_the_last_token_reserved_fails(server, model):
    eng = _engine(server, model, "shm", "boundary", f"full-{model.spec.arch}", reserve_last_token=False)
    try:
        doc = _doc(3, 2 * CHUNK)  # chunk-aligned: the whole prompt is cached after the first request
        eng.run("cold", doc)
        again = eng.run("again", doc)
        assert again.hit_tokens == len(doc)
        v = eng.last_verdict
        # the restored cache is the in-memory one (bitwise), but feeding the last token twice answers wrong
        assert v is not None and v.bitwise_equal and not v.passed
        assert v.full_max_abs_diff > 1e-3
    finally:
        eng.kv.close()


def test_the_reserved_last_token_keeps_a_full_prompt_resumable(server, model):
    eng = _engine(server, model, "shm", "all", f"reserve-{model.spec.arch}")
    try:
        doc = _doc(4, 2 * CHUNK)
        eng.run("cold", doc)
        again = eng.run("again", doc)
        assert again.hit_tokens == CHUNK  # capped below the prompt: the last chunk is recomputed
        assert again.oracle_pass is True
    finally:
        eng.kv.close()


def test_judge_rejects_mismatched_shapes_and_reports_bf16_without_judging():
    a = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="logits shapes differ"):
        judge(a, torch.zeros(3, 8), a, 1e-5)
    b = a.clone()
    b[0, 0] = 0.5
    v = judge(a, a.clone(), b, None)
    assert v.passed and v.full_max_abs_diff == 0.5 and v.tolerance is None
    assert not judge(a, a.clone(), b, 1e-5).passed


def test_model_and_layout_dtypes_must_agree():
    with pytest.raises(HFModelError, match="kv_dtype"):
        build_model(TransformersSpec(), TINY_HYBRID, torch.device("cpu"))  # bf16 K/V preset, fp32 weights
    text = (SCENARIOS / "hf_oracle.toml").read_text()
    with pytest.raises(ScenarioError, match="conv_dtype"):
        decode_scenario(text.replace('conv_dtype = "float32"', 'conv_dtype = "bfloat16"'))
    with pytest.raises(ScenarioError, match="runs workloads"):
        decode_scenario(text.replace('kind = "multi_turn"', 'kind = "fan_out"\nsystem_tokens = 96\nuser_tokens = 8\n'
                                     'requests = 2\n[[workloads]]\nkind = "multi_turn"'))
    with pytest.raises(ScenarioError, match="engine"):
        decode_scenario(text.replace('engine = "transformers"', 'engine = "tensorrt"'))


def test_hf_oracle_scenario_runs_through_the_runner(tmp_path: Path, capsys):
    from hybridkv.cli import main
    from hybridkv_bench.gate.checks import gate
    from hybridkv_bench.report.markdown import write_report
    from hybridkv_bench.results.folder import load_run

    out = tmp_path / "run"
    assert main(["bench", str(SCENARIOS / "hf_oracle.toml"), "--out", str(out), "--no-report",
                 "--cases", "long_doc_qa/shm-*"]) == 0
    assert "oracle PASS" in capsys.readouterr().err
    run = load_run(out).require_complete()
    (case,) = run.cases
    m = case.metrics
    assert m["oracle_pass"] is True and m["logits_bitwise_equal"] is True and m["logits_max_abs_diff"] <= 1e-5
    assert m["ttft_cold_measured_s"] > 0 and m["ttft_warm_measured_s"] > 0
    cold = min(m["ttft_cold_measured_s"], m["ttft_cold_s"])
    assert m["ttft_speedup_measured"] == pytest.approx(cold / m["ttft_warm_measured_s"])
    assert all(r.ttft_measured_s is not None for r in run.requests)
    assert not gate(run, None).failed
    write_report(out)
    report = (out / "report.md").read_text()
    assert "## Real model: measured beside modeled" in report and "| PASS |" in report
    # a failed oracle fails the gate
    bad = msgspec_replace_metrics(run, oracle_pass=False)
    assert any(c.check == "oracle_pass" for c in gate(bad, None).failed)


def msgspec_replace_metrics(run, **metrics):
    """The run with its cases' metrics changed (what a failed oracle would have recorded)."""
    import msgspec

    cases = [msgspec.structs.replace(c, metrics={**c.metrics, **metrics}) for c in run.record.cases]
    record = msgspec.structs.replace(run.record, cases=cases)
    return dataclasses.replace(run, record=record)


def test_a_layerwise_warm_start_passes_the_oracle_and_times_its_overlap(server, model):
    eng = _engine(server, model, "shm", "boundary", f"layerwise-{model.spec.arch}")
    eng.layerwise = True
    try:
        doc = _doc(5)
        eng.run("cold", np.concatenate([doc, _tail(5, 7)]))
        warm = eng.run("warm", np.concatenate([doc, _tail(6, 9)]))
        assert warm.hit_tokens == 3 * CHUNK and warm.bytes_loaded > 0
        assert warm.oracle_pass is True and warm.logits_bitwise_equal is True
        assert warm.warm_span_s is not None and warm.forward_alone_s is not None and warm.forward_alone_s > 0
        assert warm.ttft_measured_s == pytest.approx(warm.lookup_s + warm.warm_span_s)
        assert warm.warm_pipeline_ratio == pytest.approx(warm.ttft_measured_s / max(warm.load_s, warm.forward_alone_s))
    finally:
        eng.kv.close()


@pytest.mark.parametrize("blocks", [[0, 1, 2, 3, 4, 5], [5, 0, 1, 4, 3, 2], [7, 9, 2, 3, 11, 1]])
def test_kv_filled_from_runs_or_gathered_equals_the_pages(server, model, monkeypatch, blocks):
    """An attention layer's K/V read from its pages in place, run by run of consecutive blocks, or gathered first
    (more runs than `MAX_RUNS`), equal the pages' bytes laid out as transformers' cache holds them."""
    from hybridkv_bench.engines.hf import pages as hf_pages

    eng = _engine(server, model, "shm", "boundary", f"fill-{model.spec.arch}")
    try:
        codec = eng.codec
        g = LAYOUT.attention_groups[0]
        gen = torch.Generator().manual_seed(len(blocks))
        for t in codec.pages[g]:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
        B = LAYOUT.groups[g].block_tokens
        n = len(blocks) * B // CHUNK
        ids = torch.as_tensor(blocks)
        kv = codec._kv_view(g, 0).index_select(0, ids)  # (n, 2, B, kvh, hd): the pages, block by block
        want = kv.permute(1, 3, 0, 2, 4).reshape(2, 1, codec.kv_heads, -1, codec.head_dim)
        for max_runs in (8, 0):
            monkeypatch.setattr(hf_pages, "MAX_RUNS", max_runs)
            per_group = [blocks if i == g else [0] * len(blocks) for i in range(len(LAYOUT.groups))]
            got_ids = codec._attention_ids(per_group, g, n)
            assert (got_ids.runs is None) == (max_runs == 0 or len(got_ids.runs or ()) > max_runs)
            k, v = codec._empty_kv(g, len(blocks))
            codec._fill_kv(g, 0, got_ids, k, v)
            assert torch.equal(k.view(torch.uint8), want[0].view(torch.uint8))
            assert torch.equal(v.view(torch.uint8), want[1].view(torch.uint8))
    finally:
        eng.kv.close()


def test_the_cache_holds_the_filled_tensors_themselves(model):
    """`_hold_kv` makes the filled K/V the cache's own (no copy of every byte), at their full length: what the
    forward's masks and positions read before layer 0 runs."""
    from hybridkv_bench.engines.hf.pages import _hold_kv

    cache = model.new_cache()
    li = next(i for i, kind in enumerate(model.layer_kinds) if kind == "attention")
    k, v = torch.randn(1, CFG.num_kv_heads, 96, CFG.head_dim), torch.randn(1, CFG.num_kv_heads, 96, CFG.head_dim)
    _hold_kv(cache, li, k, v)
    assert cache.layers[li].keys.data_ptr() == k.data_ptr() and cache.layers[li].values.data_ptr() == v.data_ptr()
    assert cache.get_seq_length(li) == 96


def test_a_layerwise_cache_whose_layers_are_never_filled_fails_the_oracle(server, model, monkeypatch):
    """The control: the cache's attention tensors are allocated up front and filled by the layers' hooks;
    without the hooks the continuation reads unfilled K/V, and the oracle must say so."""
    eng = _engine(server, model, "shm", "boundary", f"layerwise-control-{model.spec.arch}")
    eng.layerwise = True
    read = eng.codec.read_cache_layerwise

    def without_hooks(*args, **kw):
        cache, hooks = read(*args, **kw)
        for hook in hooks:
            hook.remove()
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys.zero_()
        return cache, hooks

    monkeypatch.setattr(eng.codec, "read_cache_layerwise", without_hooks)
    try:
        doc = _doc(6)
        eng.run("cold", np.concatenate([doc, _tail(7, 7)]))
        warm = eng.run("warm", np.concatenate([doc, _tail(8, 9)]))
        assert warm.hit_tokens == 3 * CHUNK
        assert warm.oracle_pass is False and warm.logits_bitwise_equal is False
    finally:
        eng.kv.close()


def test_the_forward_alone_is_the_median_of_runs_around_the_warm_forward(server, model, monkeypatch):
    """`forward_alone_s` is the median of `forward_alone_repeats` timed continuations from the in-memory cache,
    the first before the load: one slow run (the eager forward varies by a quarter) moves it no more."""
    eng = _engine(server, model, "shm", "boundary", f"alone-{model.spec.arch}")
    try:
        doc = _doc(7)
        eng.run("cold", np.concatenate([doc, _tail(7, 7)]))
        real = eng._continue
        order: list[str] = []
        times = iter([0.5, 9.0, 0.3])  # before the load, the oracle's, one more: the median is 0.5

        def continued(*args, **kw):
            logits, t = real(*args, **kw)
            if len(args) == 5 and not kw:  # a forward-alone run: no boundary callback
                order.append("alone")
                return logits, next(times)
            order.append("warm")
            return logits, t

        monkeypatch.setattr(eng, "_continue", continued)
        assert eng.hf.spec.forward_alone_repeats == 3  # the default
        warm = eng.run("warm", np.concatenate([doc, _tail(8, 9)]))
        assert order == ["alone", "warm", "alone", "alone"]
        assert warm.oracle_pass is True and warm.forward_alone_s == 0.5
    finally:
        eng.kv.close()
