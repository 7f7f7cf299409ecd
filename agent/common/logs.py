"""Structured logs: one JSON object a line when stderr is not a terminal (the DaemonSet),
readable text on a terminal. Extra fields (pod, namespace, container_id…) ride along."""

from __future__ import annotations

import json
import logging
import sys
import time

_STD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(
            f"{k}={v}" for k, v in record.__dict__.items() if k not in _STD and not k.startswith("_")
        )
        base = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} " \
               f"{record.levelname:<7} {record.name}: {record.getMessage()}"
        if extras:
            base += f"  [{extras}]"
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


def setup(level: str = "info", fmt: str = "auto") -> None:
    handler = logging.StreamHandler(sys.stderr)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
