"""`hybridkv vllm-replay` on its small scenario (scenarios/vllm_replay/replay_small.toml): RAG, chat and
system-prompt fan-out through real vLLM engines, each request through hybridkv (its engine's own cache dropped
before each request), from vLLM's own prefix cache, and recomputed. With vLLM's default settings every request hits
all the whole blocks it shares with what came before, chat turns into the previous answer, never past what is
shared, and every continuation is the recompute's; the run folder holds what the other runs hold."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from hybridkv_bench.replay.run import run_replay
from hybridkv_bench.replay.spec import load_replay_scenario

# two engines, 9 requests three ways: 110 s on the 2-core VM at load 7-14, 5.5 minutes at load 20-45
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCENARIO = Path(__file__).resolve().parents[3] / "scenarios" / "vllm_replay" / "replay_small.toml"


def test_replay_hits_every_shared_block_and_continues_as_the_recompute(tmp_path):
    sc = load_replay_scenario(SCENARIO)
    folder, rows = run_replay(sc, tmp_path / "run", SCENARIO.read_text())
    run = json.loads((folder / "run.json").read_text())
    assert run["complete"] and [c["status"] for c in run["cases"]] == ["ok"] * 3, [c["error"] for c in run["cases"]]
    assert not [r for r in rows if r.departure], [r.departure for r in rows if r.departure]
    by = {c["workload"]: c["metrics"] for c in run["cases"]}
    for kind, m in by.items():
        assert m["shared_tokens"] > 0 and m["hit_share"] == 1.0, (kind, m)
        assert m["vllm_hit_tokens"] <= m["shared_tokens"] and m["ttft_warm_s"] and m["ttft_warm_vllm_s"], (kind, m)
    chat = [r for r in rows if r.kind == "chat"]
    block = run["context"]["block_tokens"]
    # turn 2 resumes past turn 1's prompt, into its answer (turn 1 computed its prompt and all but one answer token)
    assert chat[1].hit_tokens == (chat[0].prompt_tokens + 140 - 1) // block * block > chat[0].prompt_tokens
    assert [r.hit_tokens for r in rows if r.request == 0] == [0, 0, 0]  # nothing stored before
    lines = list(csv.DictReader((folder / "replay.csv").read_text().splitlines()))
    assert len(lines) == sum(w.count() for w in sc.workloads) == len(rows)
    assert {"replay.png", "report.md", "run.json"} <= {p.name for p in folder.iterdir()}
    assert "vLLM's own hit / shared" in (folder / "report.md").read_text()
