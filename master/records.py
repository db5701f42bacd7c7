"""The durable pin and hand-off records a new leader reads from etcd (DESIGN.md §8).

Records hold durations (``ttl_s``), never deadlines: the rebuild re-arms each one on the
leader's monotonic clock (see :class:`~protocol.messages.HandoffRecord`,
:class:`~protocol.messages.PinRecord`). Records written by a release of wire version 1
carry an absolute Unix-time deadline instead; they are converted conservatively to the
time left on this master's wall clock, ``max(0, deadline - time.time())`` (a record with
none left ends at the first tick, and its etcd record is deleted), and one line is logged.
Records that decode as neither are skipped.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import msgspec

from kvpool.protocol.errors import DECODE_ERRORS
from kvpool.protocol.layout import LayoutSpec
from kvpool.protocol.messages import HandoffRecord, PinRecord


class _HandoffRecordV1(msgspec.Struct, frozen=True):
    """A hand-off record of wire version 1: ``deadline`` in Unix seconds."""

    request_id: str
    keys: dict[str, list[str]]
    layouts: dict[str, LayoutSpec]
    producer: str
    deadline: float
    num_tokens: int = 0
    extra: dict[str, Any] = {}


def _left(deadline: float, wall: float) -> float:
    """Seconds left until the Unix-time ``deadline`` at wall-clock time ``wall`` (>= 0)."""
    left = deadline - wall
    return left if left > 0 else 0.0  # also NaN


def decode_records(handoff_values: Iterable[bytes], pin_values: Iterable[bytes]
                   ) -> tuple[list[HandoffRecord], list[PinRecord]]:
    """Decode the values under ``handoffs/`` and ``pins/``; older records converted (see
    the module docstring). Never raises for a bad record."""
    wall = time.time()
    handoffs: list[HandoffRecord] = []
    pins: list[PinRecord] = []
    old_h = old_p = 0
    for v in handoff_values:
        try:
            handoffs.append(msgspec.msgpack.decode(v, type=HandoffRecord))
            continue
        except DECODE_ERRORS:
            pass
        try:
            r = msgspec.msgpack.decode(v, type=_HandoffRecordV1)
        except DECODE_ERRORS:
            continue
        handoffs.append(HandoffRecord(r.request_id, r.keys, r.layouts, r.producer, _left(r.deadline, wall),
                                      r.num_tokens, r.extra))
        old_h += 1
    for v in pin_values:
        try:
            p = msgspec.msgpack.decode(v, type=PinRecord)
        except DECODE_ERRORS:
            continue
        if p.ttl_s is not None and not p.pinned_at:  # wire version 1: the field is a Unix-time deadline
            p = msgspec.structs.replace(p, ttl_s=_left(p.ttl_s, wall))
            old_p += 1
        pins.append(p)
    if old_h or old_p:
        logging.getLogger("kvpool.master").warning(
            "master: %d hand-off and %d soft pin record(s) in etcd are from an older kvpool (wall-clock deadlines); "
            "holding them for the time left on this master's wall clock", old_h, old_p)
    return handoffs, pins
