"""The Mamba-2 hybrid family (Nemotron-H, Granite-4.0-H, Falcon-H1): their layouts, for a client or the connector's
preset check (the harness's scenarios model the Gated DeltaNet family only). Each preset's source is beside it;
what could not be cited has no preset."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.model.layout import DTYPE_BYTES, LayoutError, ModelLayout
from hybridkv.model.presets.aligned import check_config, check_heads, hybrid_layout


def _mamba2_groups(n_groups: int, tp: int) -> int:
    """vLLM's Mamba-2 group count per rank x tp: groups that do not split over the ranks are replicated, one per
    rank (`MambaStateShapeCalculator.extra_groups_for_head_shards`)."""
    return n_groups if n_groups % tp == 0 else tp


@dataclass(frozen=True, slots=True)
class Mamba2HybridConfig:
    """The fields of a Mamba-2 hybrid config (Nemotron-H, Granite-4.0-H, Falcon-H1) that decide the KV-cache
    layout. `pattern` holds one character per decoder layer, as Nemotron-H's `hybrid_override_pattern`: `M`
    Mamba-2, `*` attention, `-` MLP and `E` MoE (the last two keep no cache), and `H` a parallel hybrid layer
    (Falcon-H1: attention and Mamba-2 side by side in every layer). The Mamba-2 inner size is heads x head_dim
    (vLLM's Nemotron-H; Granite's expand x hidden and Falcon-H1's mamba_d_ssm equal it in every preset here)."""

    name: str
    pattern: str
    num_kv_heads: int
    head_dim: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    num_attention_heads: int = 0
    hidden_size: int = 0
    kv_dtype: str = "bfloat16"
    conv_dtype: str = "bfloat16"
    ssm_dtype: str = "float32"  # the SSM cache's dtype under `vllm serve` (Nemotron-H's mamba_ssm_cache_dtype)
    active_params: float = 0.0

    def __post_init__(self) -> None:
        p = self.pattern
        if not p or set(p) - set("M*-EH") or not set(p) & set("MH") or not set(p) & set("*H"):
            raise LayoutError(f"{self.name}: pattern must hold Mamba-2 (M) and attention (*) layers, or parallel "
                              f"hybrid ones (H), among - and E, got {self.pattern!r}")
        check_config(self, ("num_kv_heads", "head_dim", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                             "n_groups", "conv_kernel"))

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    def layer_kinds(self) -> list[str | None]:
        return [{"M": "recurrent", "*": "attention", "H": "parallel"}.get(c) for c in self.pattern]

    def cache_layers(self) -> list[tuple[int, str]]:
        """(decoder-layer index, kind) of each layer that keeps a cache, in vLLM's registration order. A parallel
        layer i registers its attention first, then its Mamba-2 mixer under index num_layers + i (vLLM's
        FalconH1ParallelHybrid: "all attention/ssm layers must have different index in prefix")."""
        out: list[tuple[int, str]] = []
        for i, c in enumerate(self.pattern):
            if c == "M":
                out.append((i, "recurrent"))
            elif c == "*":
                out.append((i, "attention"))
            elif c == "H":
                out += [(i, "attention"), (self.num_layers + i, "recurrent")]
        return out

    def check_tp(self, tp: int) -> None:
        check_heads(self, tp)
        if self.mamba_num_heads % tp or (self.n_groups % tp and self.n_groups != 1):
            raise LayoutError(f"{self.name}: Mamba-2 heads ({self.mamba_num_heads}) or groups ({self.n_groups}) do "
                              f"not split over tp={tp}")

    def attn_page_per_token(self, tp: int) -> int:
        return 2 * max(1, self.num_kv_heads // tp) * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def recurrent_state_bytes(self, tp: int) -> tuple[int, int]:
        """(conv state, SSM state) bytes of one Mamba-2 layer on one rank, as vLLM shapes them: conv
        (kernel - 1, (heads x head_dim + 2 x groups x state) / tp), SSM (heads / tp, head_dim, state); a group
        count the ranks do not divide is replicated to one per rank first."""
        groups = _mamba2_groups(self.n_groups, tp)
        conv_dim = (self.mamba_num_heads * self.mamba_head_dim + 2 * groups * self.ssm_state_size) // tp
        conv = (self.conv_kernel - 1) * conv_dim * DTYPE_BYTES[self.conv_dtype]
        ssm = self.mamba_num_heads // tp * self.mamba_head_dim * self.ssm_state_size * DTYPE_BYTES[self.ssm_dtype]
        return conv, ssm

    def layout(self, tp: int = 1) -> ModelLayout:
        """The layout of one tensor-parallel rank, with vLLM's alignment and grouping rules."""
        return hybrid_layout(self, tp)


# Nemotron-H-8B (nvidia/Nemotron-H-8B-Base-8K): 52 layers in the pattern below (24 Mamba-2, 4 attention,
# 24 MLP), hidden 4096, 32 query / 8 KV heads of 128, 128 Mamba heads of 64 with state 128 (NVIDIA's
# Megatron-Bridge model page, "Nemotron H 8B Specifications"); 8 groups, conv kernel 4 and an fp32 SSM cache
# are transformers' NemotronHConfig defaults, which describe this model.
NEMOTRON_H_8B = Mamba2HybridConfig(
    name="nvidia/Nemotron-H-8B-Base-8K", pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    num_kv_heads=8, head_dim=128, num_attention_heads=32, hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64,
    ssm_state_size=128, n_groups=8, conv_kernel=4, active_params=8e9,
)

# Granite-4.0-H (IBM): 40 layers, 4 attention and 36 Mamba-2, an MLP or MoE inside every layer (no cache). The
# sizes are IBM's model card table ("Model Architecture", the same in every Granite 4.0 card; read in a copy of
# the H-Tiny card: github.com/DocDBrown/IBMGranite4Tiny README.md): embedding, layers, attention head size,
# attention and KV heads, Mamba2 state size and heads. Mamba-2 head size 64, 1 group, conv kernel 4 and the
# attention layers at 5, 15, 25, 35 are the released configs' (mamba_d_head, mamba_n_groups, mamba_d_conv,
# layer_types): H-Micro in a re-upload of its config.json (huggingface.co/anuj6316/granite, config.json),
# H-Tiny in its FP8 copy's (huggingface.co/inference-optimization/granite-4.0-h-tiny-FP8-dynamic, config.json),
# H-Small in IBM's own GGUF metadata (ollama.com/ibm/granite4:small-h: ssm.inner_size 8192 = 128 heads x 64,
# ssm.group_count 1, ssm.conv_kernel 4); H-Small's layer_types were not seen: the family's arrangement is assumed.
# No mamba_ssm_cache_dtype in these configs: vLLM keeps the SSM state in the model dtype.
_GRANITE_4_H_PATTERN = "MMMMM*MMMMMMMMM*MMMMMMMMM*MMMMMMMMM*MMMM"
GRANITE_4_H_MICRO = Mamba2HybridConfig(
    name="ibm-granite/granite-4.0-h-micro", pattern=_GRANITE_4_H_PATTERN, num_kv_heads=8, head_dim=64,
    num_attention_heads=32, hidden_size=2048, mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=1,
    conv_kernel=4, ssm_dtype="bfloat16", active_params=3e9,
)
GRANITE_4_H_TINY = Mamba2HybridConfig(
    name="ibm-granite/granite-4.0-h-tiny", pattern=_GRANITE_4_H_PATTERN, num_kv_heads=4, head_dim=128,
    num_attention_heads=12, hidden_size=1536, mamba_num_heads=48, mamba_head_dim=64, ssm_state_size=128, n_groups=1,
    conv_kernel=4, ssm_dtype="bfloat16", active_params=1e9,
)
GRANITE_4_H_SMALL = Mamba2HybridConfig(
    name="ibm-granite/granite-4.0-h-small", pattern=_GRANITE_4_H_PATTERN, num_kv_heads=8, head_dim=128,
    num_attention_heads=32, hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128,
    n_groups=1, conv_kernel=4, ssm_dtype="bfloat16", active_params=9e9,
)
# Falcon-H1-0.5B (TII): 36 parallel hybrid layers (attention and Mamba-2 in every one), hidden 1024, 8 query / 2 KV
# heads of 64, 24 Mamba heads of 64, state 128 (transformers' FalconH1 model doc table,
# github.com/huggingface/transformers docs/source/en/model_doc/falcon_h1.md); 1 group, conv kernel 4 and
# mamba_d_ssm 1536 = 24 x 64 are in the config.json of a fine-tune of it with the same shapes
# (huggingface.co/MerlinSafety/HybridIntelligence-0.5B). The larger Falcon-H1 models (1.5B to 34B) are in the
# same table, but no config of theirs giving mamba_n_groups was found: no presets for them.
FALCON_H1_0_5B = Mamba2HybridConfig(
    name="tiiuae/Falcon-H1-0.5B-Instruct", pattern="H" * 36, num_kv_heads=2, head_dim=64, num_attention_heads=8,
    hidden_size=1024, mamba_num_heads=24, mamba_head_dim=64, ssm_state_size=128, n_groups=1, conv_kernel=4,
    ssm_dtype="bfloat16", active_params=0.5e9,
)
PRESETS: dict[str, Mamba2HybridConfig] = {
    "nemotron-h-8b": NEMOTRON_H_8B,
    "granite-4.0-h-micro": GRANITE_4_H_MICRO,
    "granite-4.0-h-tiny": GRANITE_4_H_TINY,
    "granite-4.0-h-small": GRANITE_4_H_SMALL,
    "falcon-h1-0.5b": FALCON_H1_0_5B,
}
