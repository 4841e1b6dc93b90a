"""The `vllm-replay` scenario files and what a replay derives without an engine: the shipped files decode, bad
values are refused naming them, chat turns grow from the previous answer, and the shared blocks and a workload's
figures come out of the requests as documented (the engines themselves: reference_impl/tests/vllm_engine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hybridkv_bench.replay.rows import Replayed, failure, summary
from hybridkv_bench.replay.run import History
from hybridkv_bench.replay.spec import Chat, Rag, load_replay_scenario

SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios" / "vllm_replay"


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_the_shipped_replay_scenarios_decode(path):
    sc = load_replay_scenario(path)
    assert sc.name == path.stem
    assert {type(w).__name__ for w in sc.workloads} == {"Rag", "Chat", "FanOut"}


ONE = '[[workloads]]\nkind = "rag"\n'


@pytest.mark.parametrize("text,needle", [
    ('name = "x"\nworkloads = []\n', "at least one workload"),
    ('name = "x"\n' + ONE + 'questons = 3\n', "questons"),
    ('name = "x"\nstep_token = 3\n' + ONE, "step_token"),
    ('name = "x"\n[[workloads]]\nkind = "rga"\n', "rga"),
    ('name = "x"\n' + ONE + "questions = 0\n", "questions must be >= 1"),
    ('name = "x"\n' + ONE + ONE, "unique"),
    ('name = "x"\nmax_model_len = 2000\n' + ONE, "max_model_len 2000"),
    ('name = "x"\nkv_cache_gib = inf\n' + ONE, "kv_cache_gib"),
    ('name = "x"\nstep_tokens = -1\n' + ONE, "step_tokens"),
    ('name = "x"\n[model]\nlayers = 6\n' + ONE, "full_attention_interval"),
    ('name = "x\n', "not a readable TOML"),
])
def test_bad_replay_scenarios_are_refused_by_name(tmp_path, text, needle):
    f = tmp_path / "s.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_replay_scenario(f)


def test_a_chat_turn_is_the_previous_prompt_its_answer_and_new_text():
    chat = Chat(first_tokens=10, answer_tokens=4, user_tokens=3, turns=3)
    first = chat.next_prompt(0, 5, 512, [], [])
    second = chat.next_prompt(1, 5, 512, first, [7, 8, 9, 10])
    assert len(first) == 10 and second[:14] == first + [7, 8, 9, 10] and len(second) == 17
    assert chat.longest() == 10 + 3 * 4 + 2 * 3


def test_rag_questions_share_the_document_and_nothing_else():
    rag = Rag(document_tokens=20, question_tokens=5, questions=2)
    a, b = (rag.next_prompt(i, 1, 512, [], []) for i in range(2))
    assert a[:20] == b[:20] and a[20:] != b[20:]


def test_shared_blocks_count_prompt_and_answer_never_the_last_token():
    h = History(block=4)
    h.add(list(range(2, 12)))  # 10 tokens computed: whole blocks 0-3 and 4-7
    assert h.shared(list(range(2, 12)) + [99]) == 8
    assert h.shared(list(range(2, 10))) == 4  # the request's own last token is always computed
    assert h.shared([5] + list(range(3, 12))) == 0


def _row(request: int, shared: int, hit: int, own: int, departure: str = "") -> Replayed:
    return Replayed(workload="w", kind="rag", request=request, prompt_tokens=100, shared_tokens=shared,
                    hit_tokens=hit, vllm_shared_tokens=shared, vllm_hit_tokens=own, ttft_cold_s=1.0,
                    ttft_hybridkv_s=0.5, ttft_vllm_s=0.25,
                    tokens_equal=not departure, vllm_tokens_equal=True, departure=departure)


def test_a_workload_s_figures_and_failures():
    rows = [_row(0, 0, 0, 0), _row(1, 64, 64, 0), _row(2, 64, 32, 64)]
    m = summary(rows)
    assert (m["hit_share"], m["vllm_hit_share"], m["warm_requests"]) == (96 / 128, 64 / 128, 2)
    assert (m["warm_vs_vllm_ratio"], m["cold_vs_warm"]) == (2.0, 2.0)
    assert failure(rows) is None
    # tokens that part at a near-tie are the recompute's continuation: equal is not asked, a departure fails
    assert failure([dataclasses.replace(_row(0, 64, 64, 0), tokens_equal=False)]) is None
    bad = failure([_row(0, 64, 128, 0), _row(1, 0, 0, 0, departure="at token 3 the logprob of 9 is -1.0")])
    assert bad is not None and "request 0: hit 128" in bad and "request 1: through hybridkv" in bad
    assert summary([_row(0, 64, 64, 0, departure="x")])["departures"] == 1
    assert summary([_row(0, 0, 0, 0)])["hit_share"] is None  # nothing to hit: not measurable, not 0
