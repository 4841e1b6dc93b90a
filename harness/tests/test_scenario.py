from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import msgspec
import pytest
from benchkit import SCENARIOS
from hybridkv.engine.config import TransferAxes
from hybridkv.model.presets import preset_layout
from hybridkv.model.presets.gated_deltanet import HybridModelConfig
from hybridkv_bench.model_shape import Overrides as ModelOverrides
from hybridkv_bench.scenario.load import decode_scenario, find_scenarios, load_scenario
from hybridkv_bench.scenario.sizes import prefix_bytes, request_prefix_tokens, scaled, working_set_bytes
from hybridkv_bench.scenario.spec import AXES, ScenarioError, expand_matrix
from hybridkv_bench.workloads import registry
from hybridkv_bench.workloads.l1_pressure import L1Pressure
from hybridkv_bench.workloads.multi_turn import MultiTurn

BASE = """
name = "t"
[model]
preset = "tiny-hybrid"
[server]
l1_gib = 0.01
[prefill]
kind = "tokens_per_s"
rate = 1000.0
[[workloads]]
kind = "long_doc_qa"
prompt_tokens = 800
question_tokens = 10
"""


def decode(extra: str = "", base: str = BASE, replace: dict | None = None):
    text = base
    for a, b in (replace or {}).items():
        assert a in text
        text = text.replace(a, b)
    return decode_scenario(text + extra, "scenarios/t.toml")


def error_of(**kw) -> str:
    with pytest.raises(ScenarioError) as e:
        decode(**kw)
    return str(e.value)


SCENARIO_FILES = find_scenarios(SCENARIOS)


def test_the_shipped_scenarios_are_there():
    names = {p.stem for p in SCENARIO_FILES}
    assert {"smoke", "seed_56k", "multi_turn", "fan_out", "divergence", "l1_pressure", "tp4_engines"} <= names


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=lambda p: p.stem)
def test_every_scenario_file_decodes_validates_and_scales_to_tiny(path: Path):
    sf = load_scenario(path)
    assert sf.scenario.name == path.stem and sf.scenario.description
    assert len(sf.sha256) == 64
    assert expand_matrix(sf.scenario)
    tiny = sf.scaled(0.01)
    assert tiny.scale == 0.01
    s = tiny.scenario
    layout = s.model.layout()
    chunk = s.model.resolved_chunk_tokens(layout)
    for old, new in zip(sf.scenario.workloads, s.workloads, strict=True):
        for f in ("prompt_tokens", "system_tokens"):
            if hasattr(new, f):
                v = getattr(new, f)
                assert v % chunk == 0 and v >= 2 * chunk and v <= getattr(old, f)
        if not isinstance(new, L1Pressure):
            size = lambda w: working_set_bytes(w, layout, chunk, "all")  # noqa: E731
            assert size(new) <= size(old)
    # tiny means tiny: no workload of a scaled scenario stores more than a few GB. A prefetch comparison
    # must overflow an L1 of at least 4 chunks three times over (fresh conversations per tier): for a
    # 27B layout that is 3 passes x 4 conversations of 8 boundary objects, 4.9 GB.
    def compare(w) -> bool:
        return isinstance(w, MultiTurn) and w.prefetch == "compare"

    assert max((working_set_bytes(w, layout, chunk, "all") for w in s.workloads if not compare(w)), default=0) < 3e9
    assert max((working_set_bytes(w, layout, chunk, "boundary") for w in s.workloads if compare(w)), default=0) < 6e9
    assert tiny.record()["scale"] == 0.01


def test_smoke_is_cpu_tiny_and_covers_the_asked_matrix():
    s = load_scenario(SCENARIOS / "smoke.toml").scenario
    assert s.device == "cpu" and s.model.preset == "tiny-hybrid"
    axes = {a: {c.axes[a] for c in expand_matrix(s)} for a in AXES}
    assert axes["wire_format"] == {"shm", "raw", "pickle", "torch_save"}
    assert axes["copy_engine"] == {"kernel", "dma"} and axes["streams"] == {"single"}
    assert axes["retrieve_policy"] == {"boundary", "all"}


def test_seed_56k_matches_the_anchor_figures():
    s = load_scenario(SCENARIOS / "seed_56k.toml").scenario
    layout = s.model.layout()
    (w,) = s.workloads
    assert s.model.chunk_tokens == 784 and w.prompt_tokens == 71 * 784 == 55_664
    all_bytes = prefix_bytes(layout, 784, w.prompt_tokens, "all")
    assert all_bytes == pytest.approx(14.6e9, rel=0.01)  # ANCHORS: all groups, all chunks
    assert prefix_bytes(layout, 784, w.prompt_tokens, "boundary") == pytest.approx(3.8e9, rel=0.01)
    assert 1.8 * all_bytes < s.server.l1_bytes < 2.2 * all_bytes
    names = {c.name for c in expand_matrix(s)}
    assert "pickle-dma-per_group-all-all" in names and "pickle-kernel-single-all-all" not in names


def test_unknown_field_names_the_key_path_and_file():
    assert error_of(extra="[matrix]\nwire_formt = ['shm']\n") == \
        "scenarios/t.toml: unknown field `wire_formt` at $.matrix"
    assert "unknown field `promt_tokens` at $.workloads[1]" in error_of(
        extra="[[workloads]]\nkind='l1_pressure'\ndocuments=3\npromt_tokens=800\n")


@pytest.mark.parametrize("kw, expected", [
    (dict(replace={'preset = "tiny-hybrid"': 'preset = "qwen9"'}), "unknown model preset 'qwen9'; known: "),
    (dict(replace={'preset = "tiny-hybrid"': 'preset = "tiny-hybrid"\nchunk_tokens = 100'}),
     "chunk_tokens 100 is not a multiple of group 0's block size 80"),
    (dict(replace={"l1_gib = 0.01": "l1_gib = 0.00001"}), "server.l1_gib 1e-05 is smaller than one chunk"),
    (dict(replace={'name = "t"': 'name = "t"\nrepeats = 0'}), "repeats must be >= 1, got 0"),
    (dict(extra="[matrix]\nwire_format = ['shm', 'rdma']\n"),
     "invalid enum value 'rdma' at $.matrix.wire_format[1]"),
    (dict(extra="[matrix]\nwire_format = ['shm', 'shm']\n"), "lists a value twice"),
    (dict(extra="[matrix]\nstreams = []\n"), "axis streams needs at least one value"),
    (dict(extra="[[workloads]]\nkind = 'chat'\n"), "invalid value 'chat' (known: divergence, fan_out, l1_pressure, "
                                                 "long_doc_qa, multi_engine, multi_turn, store_while_load) at "
                                                 "$.workloads[1].kind"),
    (dict(extra="[[workloads]]\nprompt_tokens = 800\n"), "missing required field `kind` at $.workloads[1]"),
    (dict(extra="[[workloads]]\nkind = 'fan_out'\nsystem_tokens = 'a'\nuser_tokens = 8\nrequests = 2\n"),
     "expected `int`, got `str` at $.workloads[1].system_tokens"),
    (dict(replace={'name = "t"': 'name = "t"\nengine = "tensorrt"'}),
     "unknown engine kind 'tensorrt'; known: sim, transformers, vllm"),
    (dict(extra="[[workloads]]\nkind = 'long_doc_qa'\nprompt_tokens = 800\nquestion_tokens = 1\n"),
     "workload names must be unique"),
    (dict(extra="[[workloads]]\nkind = 'l1_pressure'\ndocuments = 2\nprompt_tokens = 800\n"),
     "which fits in server.l1_gib 0.01: nothing would spill"),
    (dict(extra="[[workloads]]\nkind = 'l1_pressure'\ndocuments = 20\nprompt_tokens = 800\n"),
     "needs an L2 to spill to"),
    (dict(replace={"prompt_tokens = 800": "prompt_tokens = 40"}), "shorter than one 80-token chunk"),
    (dict(extra="[[workloads]]\nkind = 'divergence'\nprompt_tokens = 100\nat = 'chunk_edge'\n"),
     "must span at least 2 chunks"),
    (dict(replace={"l1_gib = 0.01": "l1_gib = 0.0005"}, extra=""), "no warm request could ever hit"),
    (dict(extra="[matrix]\nexclude = [{ wire_format = 'raw' }]\n"),
     "exclude entry {'wire_format': 'raw'} matches no case"),
    (dict(extra="[matrix]\nexclude = [{ copy_engine = 'auto' }]\n"), "removes every case"),
    (dict(extra="[matrix]\nexclude = [{}]\n"), "an exclude entry needs at least one axis"),
    (dict(extra="[matrix]\nexclude = [{ stream = 'single' }]\n"), "unknown field `stream` at $.matrix.exclude[0]"),
    (dict(extra="[matrix]\nexclude = [{ streams = 'both' }]\n"),
     "invalid enum value 'both' at $.matrix.exclude[0].streams"),
    (dict(extra="[matrix]\ncommit = ['fenced']\n"), "unknown field `commit` at $.matrix"),
    (dict(replace={'kind = "tokens_per_s"\nrate = 1000.0':
                   'kind = "roofline"\ndevice_tflops = 1.0\nefficiency = 2.0'}),
     "efficiency must lie in (0, 1], got 2.0 at $.prefill"),
    (dict(replace={'preset = "tiny-hybrid"': 'preset = "tiny-hybrid"\ntp = 3'}),
     "tensor-parallel size must be a power of two, got 3"),
    (dict(replace={'preset = "tiny-hybrid"': 'preset = "tiny-hybrid"\n[model.overrides]\nkv_dtyp = "x"'}),
     "unknown field `kv_dtyp` at $.model.overrides"),
    (dict(replace={'name = "t"': 'name = "t"\ndevice = "tpu"'}), "invalid enum value 'tpu' at $.device"),
    (dict(replace={'name = "t"': 'name = "t"\ncommit = "later"'}), "invalid enum value 'later' at $.commit"),
])
def test_bad_values_are_rejected_at_the_door(kw, expected):
    msg = error_of(**kw)
    assert msg.startswith("scenarios/t.toml: ")
    assert expected in msg


def test_invalid_toml_and_name_mismatch(tmp_path: Path):
    bad = tmp_path / "broken.toml"
    bad.write_text("name = \n")
    with pytest.raises(ScenarioError, match=r"broken.toml: invalid TOML"):
        load_scenario(bad)
    other = tmp_path / "other.toml"
    other.write_text(BASE)
    with pytest.raises(ScenarioError, match=r"name 't' must equal the file name 'other'"):
        load_scenario(other)
    with pytest.raises(ScenarioError, match="cannot read scenario file"):
        load_scenario(tmp_path / "missing.toml")


def test_overrides_cover_every_config_field_and_apply():
    fields = {f.name for f in dataclasses.fields(HybridModelConfig)} - {"name"}
    assert set(ModelOverrides.__struct_fields__) == fields
    s = decode(replace={'preset = "tiny-hybrid"': 'preset = "tiny-hybrid"\n[model.overrides]\nhead_dim = 32'})
    assert s.model.config().head_dim == 32
    assert s.model.layout().groups[0].page_bytes != preset_layout("tiny-hybrid").groups[0].page_bytes
    assert msgspec.to_builtins(s)["model"]["overrides"] == {"head_dim": 32}


def test_expand_matrix_order_names_and_excludes():
    s = decode(extra="""[matrix]
wire_format = ["shm", "pickle"]
copy_engine = ["kernel", "dma"]
retrieve_policy = ["boundary", "all"]
exclude = [{ wire_format = "pickle", copy_engine = "kernel" }]
""")
    names = [c.name for c in expand_matrix(s)]
    assert names == [
        "shm-kernel-single-boundary-all", "shm-kernel-single-all-all",
        "shm-dma-single-boundary-all", "shm-dma-single-all-all",
        "pickle-dma-single-boundary-all", "pickle-dma-single-all-all",
    ]
    assert expand_matrix(s)[0].axes == {"wire_format": "shm", "copy_engine": "kernel", "streams": "single",
                                        "retrieve_policy": "boundary", "store_policy": "all"}


def test_scaling_keeps_chunk_multiples_pressure_and_rejects_bad_factors():
    sf = load_scenario(SCENARIOS / "l1_pressure.toml")
    for factor in (0.5, 0.1, 0.01):
        s = scaled(sf.scenario, factor)
        layout, chunk = s.model.layout(), s.model.resolved_chunk_tokens()
        (w,) = s.workloads
        assert w.prompt_tokens % chunk == 0 and w.prompt_tokens >= 2 * chunk
        assert working_set_bytes(w, layout, chunk, "boundary") > s.server.l1_bytes  # still spills
        assert s.server.l1_bytes >= layout.chunk_bytes(chunk)
    assert scaled(sf.scenario, 1.0) == sf.scenario
    with pytest.raises(ScenarioError, match="scale factor must lie in"):
        scaled(sf.scenario, 0)
    mt = scaled(load_scenario(SCENARIOS / "multi_turn.toml").scenario, 0.01).workloads[0]
    assert mt.turns >= 3 and mt.turn_tokens == 784 and request_prefix_tokens(mt) == mt.system_tokens + 2 * 784


def test_the_matrix_axes_are_typed_as_the_transfer_config_types_them():

    from hybridkv.engine.config import TransferConfig
    from hybridkv_bench.scenario import matrix as spec

    # one declaration, the engine's: each matrix axis lists values of its TransferAxes type, an exclude gives one
    hints = typing.get_type_hints(TransferAxes)
    assert {f.name: f.type for f in msgspec.structs.fields(spec.Matrix)} == {
        **{a: tuple[hints[a], ...] for a in AXES}, "exclude": tuple[spec.Exclude, ...]}
    assert {f.name: f.type for f in msgspec.structs.fields(spec.Exclude)} == {a: hints[a] | None for a in AXES}
    import subprocess
    import sys

    no_torch = "import sys, hybridkv_bench.scenario.load; assert 'torch' not in sys.modules, 'reading imports torch'"
    assert subprocess.run([sys.executable, "-c", no_torch]).returncode == 0
    assert set(AXES) | {"commit"} == {f.name for f in dataclasses.fields(TransferAxes)}
    assert tuple(spec.Exclude.__struct_fields__) == AXES == tuple(spec.Matrix.__struct_fields__[:-1])
    with pytest.raises(KeyError, match="'commit' is not a matrix axis; the axes are wire_format, copy_engine"):
        spec.Matrix().values("commit")
    case = expand_matrix(decode_scenario(BASE))[0]
    assert isinstance(case.transfer, TransferConfig)
    assert {a: getattr(case.transfer, a) for a in AXES} == case.axes


def test_a_scenario_imports_only_the_workload_kinds_it_names():
    """The workload registry is lazy: decoding a scenario of one kind imports that kind's module alone."""
    code = ("import sys; from hybridkv_bench.scenario.load import decode_scenario; decode_scenario(sys.argv[1]); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('hybridkv_bench.workloads.'))))")
    out = subprocess.run([sys.executable, "-c", code, BASE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["hybridkv_bench.workloads.base", "hybridkv_bench.workloads.long_doc_qa",
                   "hybridkv_bench.workloads.registry"]


def test_a_new_workload_kind_is_one_module_and_one_registration(tmp_path, monkeypatch):
    (tmp_path / "hkv_workload_probe.py").write_text(
        "from hybridkv_bench.workloads.fan_out import FanOut\n\n\n"
        "class Probe(FanOut, frozen=True, tag='probe', kw_only=True):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "WORKLOAD_KINDS", dict(registry.WORKLOAD_KINDS))
    registry.register_workload("probe", "hkv_workload_probe:Probe")
    s = decode(extra="[[workloads]]\nkind = 'probe'\nsystem_tokens = 800\nuser_tokens = 8\nrequests = 2\n")
    assert type(s.workloads[1]).__name__ == "Probe" and s.workloads[1].kind == "probe"
    assert msgspec.to_builtins(s)["workloads"][1] == {"kind": "probe", "name": "", "system_tokens": 800,
                                                        "user_tokens": 8, "requests": 2}
    with pytest.raises(ValueError, match="'probe' is registered already"):
        registry.register_workload("probe", "hkv_workload_probe:Probe")
    registry.register_workload("probe2", "hkv_workload_probe:Probe")
    with pytest.raises(ScenarioError, match="tagged 'probe', registered as 'probe2'"):
        decode(extra="[[workloads]]\nkind = 'probe2'\nsystem_tokens = 800\nuser_tokens = 8\nrequests = 2\n")
