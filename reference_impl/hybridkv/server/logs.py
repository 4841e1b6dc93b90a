"""The server's log lines: text for people, or JSON lines (`--log-format json`) for log pipelines.

A JSON line always has the fields `ts` (Unix seconds), `level`, `logger` and `msg`; `event` and `fields`
when the line is one of the server's structured ones (the headline every --headline-interval seconds:
`event` = "headline", `fields` = telemetry.HEADLINE_FIGURES), and `exc` when it carries a traceback. The
names are stable: dashboards and alerts key on them.
"""

from __future__ import annotations

import json
import logging
import sys

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                                  "logger": record.name, "msg": record.getMessage()}
        event = getattr(record, "event", None)
        if event is not None:
            out["event"] = event
            out["fields"] = getattr(record, "fields", {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


def setup_logging(level: str, fmt: str) -> None:
    """Log to stderr at `level` in format `fmt` (one of LOG_FORMATS)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
