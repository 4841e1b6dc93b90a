"""Layouts and presets: vLLM's hybrid alignment rule reproduces the figures in ANCHORS.md; sliding-window groups
hold what vLLM's sliding-window rule keeps."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
from hybridkv.model import presets
from hybridkv.model.layout import GroupLayout, LayoutError, ModelLayout, vllm_group_size, vllm_groups
from hybridkv.model.presets import layout_preset_names, model_config, preset_layout, preset_names
from hybridkv.model.presets.gated_deltanet import QWEN3_NEXT_80B, QWEN36_27B


def test_qwen36_27b_tp1_matches_the_anchors():
    cfg = QWEN36_27B
    assert cfg.attn_page_per_token(1) == 4096  # per token per layer
    conv, ssm = cfg.recurrent_state_bytes(1)
    assert (conv, ssm, conv + ssm) == (61_440, 3_145_728, 3_207_168)
    lay = preset_layout("qwen3.6-27b")
    # vLLM's order (layer 0 is GDN, so GDN buckets come first) and grouping: GDN layer k of every period in group k
    assert [g.kind for g in lay.groups] == ["recurrent", "recurrent", "recurrent", "attention"]
    assert [g.layer_names[:3] for g in lay.groups] == [
        (f"model.layers.{k}", f"model.layers.{k + 4}", f"model.layers.{k + 8}") for k in range(4)]
    assert all(g.num_layers == 16 for g in lay.groups)
    assert {g.block_tokens for g in lay.groups} == {784}
    assert {g.page_bytes for g in lay.groups} == {3_211_264}
    assert lay.default_chunk_tokens() == 784
    assert lay.chunk_bytes(784) == 64 * 3_211_264 == 205_520_896  # ~205.5 MB per chunk
    # 56k prompt: attention of 71 chunks + the states at the last one (ANCHORS: 3.65 + 0.154 GB)
    attn = 71 * lay.object_bytes(3, 784)
    states = sum(lay.object_bytes(g, 784) for g in (0, 1, 2))
    assert round(attn / 1e9, 2) == 3.65 and round(states / 1e9, 3) == 0.154
    assert round(71 * lay.chunk_bytes(784) / 1e9, 1) == 14.6


def test_qwen35_has_qwen36_shapes_and_a_different_fingerprint():
    a, b = preset_layout("qwen3.5-27b"), preset_layout("qwen3.6-27b")
    assert [(g.kind, g.page_bytes, g.block_tokens) for g in a.groups] == [
        (g.kind, g.page_bytes, g.block_tokens) for g in b.groups]
    assert a.fingerprint() != b.fingerprint()  # the model id is part of the namespace


@pytest.mark.parametrize("tp,block,page", [(1, 784, 3_211_264), (2, 784, 1_605_632), (4, 784, 802_816),
                                           (8, 400, 409_600)])
def test_qwen36_tensor_parallel_ranks(tp, block, page):
    lay = preset_layout("qwen3.6-27b", tp)
    assert lay.tp_size == tp and {g.block_tokens for g in lay.groups} == {block}
    assert {g.page_bytes for g in lay.groups} == {page}
    # the padded recurrent page holds the rank's real state
    conv, ssm = QWEN36_27B.recurrent_state_bytes(tp)
    assert page >= conv + ssm and page - (conv + ssm) < 16 * QWEN36_27B.attn_page_per_token(tp)


@pytest.mark.parametrize("tp,block", [(1, 544), (2, 544), (4, 272), (8, 144)])
def test_qwen3_next_blocks(tp, block):
    lay = preset_layout("qwen3-next-80b-a3b", tp)
    assert len(lay.groups) == 4 and all(g.num_layers == 12 for g in lay.groups)
    assert {g.block_tokens for g in lay.groups} == {block}
    assert QWEN3_NEXT_80B.ssm_dtype == "bfloat16"


def test_group_size_rule():
    assert vllm_group_size([16, 48]) == 16   # ratio 3: the smaller count
    assert vllm_group_size([10, 12]) == 12   # under 1.5x: the larger
    assert vllm_group_size([10, 14]) == 14   # vLLM 0.33's bound is 1.5x (0.8's was 1.25x)
    assert vllm_group_size([10, 15]) == 10
    assert vllm_group_size([12]) == 12


def test_groups_are_vllms_interleaved_split_with_padding():
    # 10 GDN + 4 attention layers: size 4, so 3 GDN groups of layers i::3 (vLLM pads the short ones)
    kinds = ["recurrent"] * 10 + ["attention"] * 4
    assert vllm_groups(kinds) == [("recurrent", [0, 3, 6, 9]), ("recurrent", [1, 4, 7]), ("recurrent", [2, 5, 8]),
                                  ("attention", [10, 11, 12, 13])]
    # a model that starts with attention lists its attention group first
    assert vllm_groups(["attention", "recurrent", "recurrent"]) == [("attention", [0]), ("recurrent", [1]),
                                                                    ("recurrent", [2])]


def test_presets_fail_clearly():
    with pytest.raises(LayoutError, match="unknown model preset 'qwen9'"):
        preset_layout("qwen9")
    with pytest.raises(LayoutError, match="power of two"):
        preset_layout("qwen3.6-27b", 3)
    with pytest.raises(LayoutError, match="do not split"):
        preset_layout("tiny-hybrid", 8)
    assert "tiny-hybrid" in preset_names() and model_config("tiny-hybrid").num_layers == 8


def test_layouts_validate_themselves():
    g = GroupLayout(kind="attention", layer_names=("l0",), page_bytes=4096, block_tokens=16)
    with pytest.raises(LayoutError, match="page_bytes must be in"):
        GroupLayout(kind="attention", layer_names=("l0",), page_bytes=0, block_tokens=16)
    with pytest.raises(LayoutError, match="duplicate"):
        GroupLayout(kind="attention", layer_names=("l0", "l0"), page_bytes=64, block_tokens=16)
    with pytest.raises(LayoutError, match="unknown dtype"):
        GroupLayout(kind="attention", layer_names=("l0",), page_bytes=64, block_tokens=16, dtype="float7")
    with pytest.raises(LayoutError, match="more than one group"):
        ModelLayout(model="m", groups=(g, g))
    rec = GroupLayout(kind="recurrent", layer_names=("r0",), page_bytes=4096, block_tokens=16)
    with pytest.raises(LayoutError, match="at least one attention or sliding-window group"):
        ModelLayout(model="m", groups=(rec,))
    lay = ModelLayout(model="m", groups=(g, GroupLayout(kind="recurrent", layer_names=("r0",), page_bytes=4096,
                                                         block_tokens=32)))
    assert lay.default_chunk_tokens() == 32
    with pytest.raises(LayoutError, match="not a multiple of group 1's block size 32"):
        lay.check_chunk_tokens(48)
    # a chunk of 2 blocks: attention holds both blocks' pages, the recurrent group one state page
    assert lay.object_bytes(0, 32) == 2 * 4096 and lay.object_bytes(1, 32) == 4096


def vllm_keeps(t: int, window: int, block: int) -> set[int]:
    """vLLM's SlidingWindowManager at t computed tokens: it skips the first max(0, t - window + 1) tokens and
    frees (nulls) every block wholly among them, keeping blocks skipped // block .. t / block - 1."""
    skipped = max(0, t - window + 1)
    return set(range(skipped // block, t // block))


@pytest.mark.parametrize("block", [16, 32])
def test_a_sliding_chunk_s_tail_holds_every_block_vllm_keeps_for_a_resume(block):
    """Against vLLM's rule, over windows shorter and longer than a chunk and not a multiple of the block: a resume
    at any chunk boundary n needs exactly the blocks vLLM keeps, each of them is in the tail (`tail_blocks`) of a
    chunk from `window_start_chunk(n)` on, and every such chunk's tail holds at least one of them."""
    for window in [1, 2, 17, block, block + 1, 3 * block - 5, 100, 4 * block, 7 * block + 3]:
        for bpc in range(1, 7):
            chunk = bpc * block
            g = GroupLayout(kind="sliding", layer_names=("l0",), page_bytes=64, block_tokens=block, window=window)
            tail = g.tail_blocks(chunk)
            assert 1 <= tail <= bpc
            for n in range(1, 12):
                keeps = vllm_keeps(n * chunk, window, block)
                start = g.window_start_chunk(n, chunk)
                held = {j for c in range(start, n) for j in range((c + 1) * bpc - tail, (c + 1) * bpc)}
                assert keeps <= held, (window, bpc, n)
                assert all(keeps & set(range((c + 1) * bpc - tail, (c + 1) * bpc)) for c in range(start, n))
                assert start == 0 or not keeps & set(range(start * bpc)), (window, bpc, n)


def test_sliding_groups_validate_and_fingerprint_their_window():
    s = GroupLayout(kind="sliding", layer_names=("model.layers.0",), page_bytes=4096, block_tokens=16, window=100)
    a = GroupLayout(kind="attention", layer_names=("model.layers.1",), page_bytes=4096, block_tokens=16)
    with pytest.raises(LayoutError, match="window must be in 1.."):
        GroupLayout(kind="sliding", layer_names=("l0",), page_bytes=4096, block_tokens=16)
    with pytest.raises(LayoutError, match="attention groups have no window"):
        GroupLayout(kind="attention", layer_names=("l0",), page_bytes=4096, block_tokens=16, window=8)
    lay = ModelLayout(model="m", groups=(s, a))
    other = ModelLayout(model="m", groups=(GroupLayout(kind="sliding", layer_names=("model.layers.0",),
                                                       page_bytes=4096, block_tokens=16, window=101), a))
    assert lay.fingerprint() != other.fingerprint()  # the window decides which blocks an object holds
    assert lay.signature()[0] == ("sliding", [0], 4096, 16, "bfloat16", 100)
    assert lay.signature()[1] == ("attention", [1], 4096, 16, "bfloat16")  # other groups as before windows existed
    # a 64-token chunk (4 blocks) of a 100-token window: its last ceil(99 / 16) = 7 > 4 blocks, i.e. all of them;
    # a 256-token chunk keeps its last 7 of 16
    assert lay.object_bytes(0, 64) == 4 * 4096 and lay.object_bytes(0, 256) == 7 * 4096
    assert lay.object_bytes(1, 256) == 16 * 4096
    # a layout of sliding groups alone is one (Mistral-style models); recurrent groups alone are not
    assert ModelLayout(model="m", groups=(s,)).sliding_groups == [0]
    # defaults stay off the wire: a layout without sliding groups encodes as it did before the field existed
    assert "window" not in msgspec.to_builtins(a) and msgspec.to_builtins(s)["window"] == 100
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(lay), type=ModelLayout) == lay


@pytest.mark.parametrize("name,windows,page_tp1", [("gemma-3-27b", {1024}, 131_072), ("gpt-oss-120b", {128}, 32_768)])
def test_sliding_window_presets_at_every_tensor_parallel_size(name, windows, page_tp1):
    for tp in (1, 2, 4, 8):
        lay = preset_layout(name, tp)
        assert {g.window for g in lay.groups if g.kind == "sliding"} == windows
        assert {(g.block_tokens, g.page_bytes) for g in lay.groups} == {(16, page_tp1 // tp)}
        assert [g.kind for g in lay.groups][-1] == "attention" and lay.default_chunk_tokens() == 16
    with pytest.raises(LayoutError, match="power of two"):
        preset_layout(name, 3)


def test_a_preset_lookup_imports_only_the_families_it_looks_in():
    """The registry is lazy: a Gated DeltaNet preset (the first family) loads no other family's module."""
    code = ("import sys; from hybridkv.model.presets import preset_layout; preset_layout('tiny-hybrid'); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('hybridkv.model.presets'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["hybridkv.model.presets", "hybridkv.model.presets.aligned", "hybridkv.model.presets.gated_deltanet"]


def test_an_unknown_preset_is_one_line_naming_every_known_one():
    with pytest.raises(LayoutError) as e:
        preset_layout("qwen9")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("unknown model preset 'qwen9'; known: ")
    assert msg.endswith(", ".join(layout_preset_names()))
    assert {"tiny-hybrid", "jamba-v0.1", "nemotron-h-8b", "gemma-3-27b"} <= set(layout_preset_names())


def test_a_new_family_is_one_module_and_one_registration(tmp_path, monkeypatch):
    (tmp_path / "hkv_family_probe.py").write_text(
        "from dataclasses import replace\n"
        "from hybridkv.model.presets.gated_deltanet import TINY_HYBRID\n"
        "PRESETS = {'probe-12l': replace(TINY_HYBRID, name='probe/12-layers', num_layers=12)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(presets, "_FAMILIES", dict(presets._FAMILIES))
    presets.register_family("probe", "hkv_family_probe")
    assert preset_layout("probe-12l").model == "probe/12-layers"
    assert sum(g.num_layers for g in preset_layout("probe-12l").groups) == 12
    assert "probe-12l" in layout_preset_names() and "probe-12l" not in preset_names()
    with pytest.raises(ValueError, match="'probe' is registered already"):
        presets.register_family("probe", "hkv_family_probe")
