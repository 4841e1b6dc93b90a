"""Model presets: one registry of preset families, each a module beside this one holding its config type (with a
`layout(tp)` method) and a `PRESETS` dict of name -> config. A family's module is imported only when a name is
looked up in it (families in registration order, the scenarios' Gated DeltaNet family first). Adding a family is
one module plus one `register_family` line below.

`preset(name)` is any preset's config, `preset_layout(name, tp)` its layout on one rank; `model_config(name)` a
Gated DeltaNet preset, the family the harness's scenarios model (its config is the one model shape the harness
derives vLLM planning shapes, scenario overrides and tiny real models from).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, cast

from hybridkv.model.layout import LayoutError, ModelLayout

if TYPE_CHECKING:
    from hybridkv.model.presets.gated_deltanet import HybridModelConfig


class PresetConfig(Protocol):
    """What every family's config offers."""

    @property
    def name(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    def layout(self, tp: int = 1) -> ModelLayout: ...


_FAMILIES: dict[str, str] = {}  # family -> module holding its PRESETS
SCENARIO_FAMILY = "gated-deltanet"


def register_family(family: str, module: str) -> None:
    """Registers a family: `module` (imported when first looked in) holds `PRESETS: dict[str, config]`."""
    if family in _FAMILIES:
        raise ValueError(f"preset family {family!r} is registered already ({_FAMILIES[family]})")
    _FAMILIES[family] = module


register_family(SCENARIO_FAMILY, "hybridkv.model.presets.gated_deltanet")
register_family("mamba2", "hybridkv.model.presets.mamba2")
register_family("mamba1", "hybridkv.model.presets.mamba1")
register_family("sliding-window", "hybridkv.model.presets.sliding")


def family_presets(family: str) -> Mapping[str, PresetConfig]:
    """The presets of one family, its module imported now."""
    try:
        module = _FAMILIES[family]
    except KeyError:
        raise LayoutError(f"unknown preset family {family!r}; known: {', '.join(_FAMILIES)}") from None
    return cast("Mapping[str, PresetConfig]", importlib.import_module(module).PRESETS)


def preset_names() -> list[str]:
    """The Gated DeltaNet presets, which scenarios can model."""
    return sorted(family_presets(SCENARIO_FAMILY))


def layout_preset_names() -> list[str]:
    """Every preset of every family: each has a layout."""
    return sorted(name for family in _FAMILIES for name in family_presets(family))


def preset(name: str) -> PresetConfig:
    """The config of preset `name`, looked up family by family; LayoutError naming the known ones."""
    for family in _FAMILIES:
        if (cfg := family_presets(family).get(name)) is not None:
            return cfg
    raise LayoutError(f"unknown model preset {name!r}; known: {', '.join(layout_preset_names())}")


def model_config(name: str) -> HybridModelConfig:
    """A Gated DeltaNet preset's config (the family scenarios model)."""
    try:
        return cast("HybridModelConfig", family_presets(SCENARIO_FAMILY)[name])
    except KeyError:
        raise LayoutError(f"unknown model preset {name!r}; known: {', '.join(preset_names())}") from None


def preset_layout(name: str, tp: int = 1) -> ModelLayout:
    """The layout of preset `name` (any family) on one rank at tensor-parallel size `tp`."""
    return preset(name).layout(tp)
