"""How the coordinator process logs: a level, plain text or JSON lines, and Ray kept apart.

Ray's driver-side loggers (`ray`, `ray.*`) keep Ray's own handler and format and stay quiet below
WARNING unless we run at DEBUG; the workers' output never reaches the driver (log_to_driver is
off), it stays in Ray's session logs.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

LOG_LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_RAY_LOGGERS = ("ray", "ray.data", "ray.tune", "ray.serve", "ray.train")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the `kvmesh` fields of the
    record (a request's facts) as top-level keys. Times are UTC."""

    converter = staticmethod(time.gmtime)  # type: ignore[assignment]

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "kvmesh", None)
        if isinstance(fields, dict):
            document.update({k: v for k, v in fields.items() if k not in document})
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "info"
    """debug, info (one line per request, from the logger `kvmesh.requests`), warning or error."""
    json_lines: bool = False
    """One JSON object a line (for log collectors) instead of text."""

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise ValueError(f"unknown log level {self.level!r}; choose from {LOG_LEVELS}")


def configure_logging(config: LogConfig, stream: IO[str] | None = None) -> None:
    """Replace the root handlers with one on `stream` (stderr) at the configured level."""
    handler = logging.StreamHandler(stream or sys.stderr)
    formatter = JsonFormatter() if config.json_lines else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level.upper())
    ray_level = logging.DEBUG if config.level == "debug" else logging.WARNING
    for name in _RAY_LOGGERS:
        logging.getLogger(name).setLevel(ray_level)
