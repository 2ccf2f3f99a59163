"""`--log-format json`: every log line as one JSON object, a request's fields included."""

from __future__ import annotations

import json
import logging
from typing import Any


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, then a request's fields or the message."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "request", None)
        if isinstance(fields, dict):
            line.update(fields)
        else:
            line["message"] = record.getMessage()
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def use_json_logs(root: logging.Logger | None = None) -> None:
    """`--log-format json`: every handler on the root logger writes JSON lines."""
    for handler in (root or logging.getLogger()).handlers:
        if not isinstance(handler.formatter, JsonLogFormatter):
            handler.setFormatter(JsonLogFormatter())
