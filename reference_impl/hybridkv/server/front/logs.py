"""The server's log lines: text for people, or JSON lines (`--log-format json`) for log pipelines.

A text line starts with its time in UTC (ISO 8601 with `Z`). A JSON line always has the fields `ts` (Unix
seconds), `level`, `logger` and `msg`; `event` and `fields` when the line is one of the server's structured ones
(the headline every --headline-interval seconds: `event` = "headline", `fields` = telemetry.HEADLINE_FIGURES),
and `exc` when it carries a traceback. The names are stable: dashboards and alerts key on them.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOG_FORMATS = ("text", "json")
# ISO 8601 in UTC, with its zone: servers of several hosts (one Redis L2) and their engines' logs line up
TEXT_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s"
TEXT_DATES = "%Y-%m-%dT%H:%M:%S"


class UtcText(logging.Formatter):
    """TEXT_FORMAT lines, their time in UTC (2026-12-07T18:09:19.123Z) whatever the machine's zone."""

    converter = staticmethod(time.gmtime)

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT, TEXT_DATES)


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
    handler.setFormatter(JsonLines() if fmt == "json" else UtcText())
    logging.basicConfig(level=level.upper(), handlers=[handler])
