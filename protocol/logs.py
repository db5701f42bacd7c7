"""The one log format of every kvpool process: a UTC timestamp, the level, the message.

``2025-01-02T03:04:05.678Z WARNING master: cannot campaign for leadership: ...``

Log records go to stderr; stdout carries only the machine-read lines
(``KVPOOL_READY ...``, ``KVPOOL_LEADER ...``, ``KVPOOL_METRICS ...``) that launchers scan.
Processes log under the ``kvpool`` logger tree (``kvpool.master``, ``kvpool.storenode``,
``kvpool.proxy``, ``kvpool.etcd``).
"""
from __future__ import annotations

import logging
import sys
import time

from kvpool.protocol.errors import ConfigError

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMAT = "%(asctime)s %(levelname)s %(message)s"


class _UTCFormatter(logging.Formatter):
    converter = time.gmtime

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        return time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created)) + f".{int(record.msecs):03d}Z"


def setup_logging(level: str = "info") -> None:
    """Send the ``kvpool`` loggers' records at ``level`` and above (other libraries': at
    warning and above) to stderr in :data:`FORMAT`. Called once by each process's entry point; calling it again
    replaces the handler (and the level). Raises ConfigError for an unknown level name
    (accepted: debug, info, warning, error)."""
    lv = LEVELS.get(str(level).lower())
    if lv is None:
        raise ConfigError(f"log level {level!r}; accepted: {', '.join(LEVELS)}", key="log_level")
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_kvpool", False):
            root.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(_UTCFormatter(FORMAT))
    h._kvpool = True  # type: ignore[attr-defined]
    root.addHandler(h)
    root.setLevel(max(lv, logging.WARNING))  # other libraries' loggers: warnings and worse
    logging.getLogger("kvpool").setLevel(lv)
