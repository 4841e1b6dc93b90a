"""The registry of L2 kinds (l2/specs.py): an unknown "type" is one line that lists the known kinds, a kind's spec
module is imported only when a configuration names it, a new kind is one module and one `register_spec` line, and
a Redis password_env is looked up in the variables the edge passes down, never in this process's environment."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hybridkv.server.l2.specs import L2ConfigError, kinds, parse_l2_adapter, register_spec


def test_an_unknown_kind_is_one_line_listing_the_known_ones():
    with pytest.raises(L2ConfigError) as ei:
        parse_l2_adapter('{"type": "s3", "bucket": "b"}', {})
    msg = str(ei.value)
    assert "\n" not in msg and "'s3'" in msg
    assert kinds() == ["fs", "redis", "valkey"]
    assert msg == '--l2-adapter "type" must be "fs", "redis" or "valkey", got \'s3\''
    with pytest.raises(L2ConfigError, match="got None"):
        parse_l2_adapter('{"base_path": "/d"}', {})


def test_a_kind_is_registered_once():
    with pytest.raises(ValueError, match="'fs' is registered already"):
        register_spec("fs", "elsewhere", "Spec")


def _python(code: str, tmp_path) -> str:
    """Run `code` in a fresh interpreter (its own sys.modules), with tmp_path importable; its stdout."""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_kinds_spec_is_imported_only_when_named(tmp_path):
    out = _python(f"""
        import sys
        from hybridkv.server.l2.specs import parse_l2_adapter
        spec = parse_l2_adapter('{{"type": "fs", "base_path": "{tmp_path}", "max_capacity_gb": 1}}', {{}})
        print(type(spec).__name__, "hybridkv.server.l2.redis_spec" in sys.modules, "redis" in sys.modules,
              "hybridkv.server.l2.fs" in sys.modules)
        spec.open().close()
        print("hybridkv.server.l2.fs" in sys.modules)
    """, tmp_path)
    assert out.split() == ["FsL2Spec", "False", "False", "False", "True"]


def test_a_new_kind_is_one_module_and_one_registration_line(tmp_path):
    (tmp_path / "null_spec.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        @dataclass(frozen=True)
        class NullL2Spec:
            json_keys = frozenset({"note"})
            note: str = ""

            @classmethod
            def from_json(cls, kind, d, env):
                return cls(d.get("note", ""))
    '''))
    out = _python("""
        from hybridkv.server.l2.specs import L2ConfigError, parse_l2_adapter, register_spec
        register_spec("null", "null_spec", "NullL2Spec")
        print(parse_l2_adapter('{"type": "null", "note": "hi"}', {}))
        try:
            parse_l2_adapter('{"type": "nul"}', {})
        except L2ConfigError as e:
            print(e)
        try:
            parse_l2_adapter('{"type": "null", "size": 1}', {})
        except L2ConfigError as e:
            print(e)
    """, tmp_path)
    lines = out.splitlines()
    assert lines[0] == "NullL2Spec(note='hi')"
    assert lines[1] == '--l2-adapter "type" must be "fs", "redis", "valkey" or "null", got \'nul\''
    assert lines[2] == "--l2-adapter type 'null' does not take ['size']; it takes ['note']"


def test_a_password_env_is_read_from_what_the_edge_passes_not_from_the_process(monkeypatch):
    monkeypatch.setenv("HKV_TEST_L2_PW", "in-the-process-only")
    text = '{"type": "redis", "url": "redis://127.0.0.1:6379/0", "password_env": "HKV_TEST_L2_PW"}'
    with pytest.raises(L2ConfigError, match="HKV_TEST_L2_PW: that environment variable is not set"):
        parse_l2_adapter(text, {})
    spec = parse_l2_adapter(text, {"HKV_TEST_L2_PW": "passed-down"})
    assert spec.password == "passed-down"  # type: ignore[attr-defined]
    assert spec.to_json()["password_env"] == "HKV_TEST_L2_PW" and "passed-down" not in repr(spec)
