"""The transfer axes (wire format, copy engine, streams, policies, commit) are declared once, in
`hybridkv.engine.config.TransferAxes`: an engine rank's `TransferConfig`, the connector's `ConnectorSettings` and a
bench case's settings are that struct or extend it, with its defaults and its checks."""

from __future__ import annotations

from dataclasses import fields

import pytest
from hybridkv.engine.config import TransferAxes, TransferConfig
from hybridkv.engine.vllm.settings import ConnectorSettings

AXES = [f.name for f in fields(TransferAxes)]


@pytest.mark.parametrize("cls", [TransferConfig, ConnectorSettings])
def test_every_setting_extends_the_one_axes_struct(cls):
    assert issubclass(cls, TransferAxes)
    assert [f.name for f in fields(cls)][:len(AXES)] == AXES  # inherited, not declared again
    assert cls().axes() == TransferAxes().axes()  # the same defaults


def test_the_axes_checks_hold_for_every_setting():
    for cls in (TransferAxes, TransferConfig):
        with pytest.raises(ValueError, match="streams must be one of"):
            cls(streams="sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="commit must be one of"):
        ConnectorSettings.from_extra({"commit": "later"}, environ={})


def test_a_connectors_axes_reach_its_engine_rank_as_they_are():
    s = ConnectorSettings.from_extra({"wire_format": "raw", "commit": "after_copies", "streams": "per_group",
                                      "copy_engine": "torch"}, environ={})
    rank = TransferConfig(**s.axes(), chunk_tokens=64, salt=s.salt)
    assert rank.axes() == s.axes() == {"wire_format": "raw", "copy_engine": "torch", "streams": "per_group",
                                       "retrieve_policy": "boundary", "store_policy": "boundary",
                                       "commit": "after_copies"}
