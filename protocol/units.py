"""Parsing of sizes ("2GiB", bytes) and durations ("30s", seconds) used in configs and CLI."""
from __future__ import annotations

import math
import re

from kvpool.protocol.errors import ConfigError

_SIZE = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "tb": 10**12}
_DUR = {"": 1.0, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: str | int, *, key: str = "size") -> int:
    """Return a byte count from ``1048576``, ``"64KiB"``, ``"2GiB"`` or ``"1.5GB"``.

    Raises ConfigError naming ``key`` when the text is not a size.
    """
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}", key=key)
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE:
        raise ConfigError(
            f"{key}: {value!r} is not a size; use bytes or a unit such as 64KiB, 512MiB, 2GiB", key=key)
    return int(float(m.group(1)) * _SIZE[m.group(2).lower()])


def parse_duration(value: str | float | int, *, key: str = "duration") -> float:
    """Return seconds from ``5``, ``"100us"``, ``"250ms"``, ``"30s"``, ``"10m"``, ``"2h"``.

    Raises ConfigError naming ``key`` when the text is not a duration, or for a negative,
    infinite or NaN number.
    """
    if isinstance(value, (int, float)):
        if not 0 <= value < math.inf:  # NaN fails too
            raise ConfigError(f"{key}: a duration is a finite number of seconds >= 0, got {value}", key=key)
        return float(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _DUR:
        raise ConfigError(f"{key}: {value!r} is not a duration; use seconds or 250ms, 30s, 10m, 2h", key=key)
    return float(m.group(1)) * _DUR[m.group(2).lower()]


MAX_WAIT_S = 86400.0  # the longest wait a client accepts (1 day); sockets refuse timeouts past about 9.2e9 s


def check_wait(value, *, key: str, zero: bool = False, none: bool = False) -> float | None:
    """``value`` as a wait in seconds: a finite number > 0 (>= 0 with ``zero``; None allowed
    with ``none``), at most :data:`MAX_WAIT_S`. Raises ConfigError naming ``key`` otherwise,
    so that a bad timeout is refused where it is set, not by the socket at the first call."""
    if value is None and none:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        0 <= value if zero else 0 < value) and value <= MAX_WAIT_S  # NaN fails both comparisons
    if not ok:
        raise ConfigError(f"{key}: {value!r}; a wait is a number of seconds {'>= 0' if zero else '> 0'} and at most "
                          f"{MAX_WAIT_S:g} (1 day){' or null (off)' if none else ''}", key=key)
    return float(value)


def format_bytes(n: float) -> str:
    """Human form of a byte count with binary units: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
