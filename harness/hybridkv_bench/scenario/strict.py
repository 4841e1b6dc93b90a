"""The base of every scenario struct (the file's tables and each workload kind's): keyword-only, frozen, and
an unknown key is an error."""

from __future__ import annotations

import msgspec


class Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Keyword-only, frozen; an unknown key is an error naming it."""


def positive(struct: msgspec.Struct, *fields: str) -> None:
    """Raise ValueError naming the first of `fields` of `struct` below 1."""
    for f in fields:
        v = getattr(struct, f)
        if v < 1:
            raise ValueError(f"{f} must be >= 1, got {v}")
