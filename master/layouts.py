"""Layout encodings shared across the master's object index (pure, no I/O).

Objects of one model carry one of a few layouts; the index keeps each distinct encoding
once (a tenth of the memory of decoded layouts; lookups and node notices carry them as
they are) together with its wire form, the raw msgpack of a reply field.
"""
from __future__ import annotations

import msgspec

from kvpool.protocol.layout import NO_LAYOUT, LayoutSpec, layout_bytes

LAYOUTS_KEPT = 4096  # distinct layout encodings the index shares at most
LAYOUT_BYTES_KEPT = 64 << 20  # ... and their bytes at most


class Layouts:
    """The shared layout encodings of one :class:`~master.state.MasterState` (its
    ``layouts``): encoding -> (the shared copy, the same as a wire field). Given nothing;
    holds at most :data:`LAYOUTS_KEPT` encodings and :data:`LAYOUT_BYTES_KEPT` bytes."""

    __slots__ = ("_kept", "_bytes")

    def __init__(self) -> None:
        self._kept: dict[bytes, tuple[bytes, msgspec.Raw]] = {}
        self._bytes = 0

    def intern(self, layout: LayoutSpec | bytes | msgspec.Raw | None) -> bytes | None:
        """``layout``'s encoding (given as a LayoutSpec, its encoding, or a wire field's raw
        msgpack), one shared object per distinct layout. Past the bounds an object keeps
        its own copy."""
        if layout is None:
            return None
        b = layout.encode() if isinstance(layout, LayoutSpec) else layout_bytes(layout)
        if b is None:
            return None
        got = self._kept.get(b)
        if got is not None:
            return got[0]
        if len(self._kept) < LAYOUTS_KEPT and self._bytes + len(b) <= LAYOUT_BYTES_KEPT:
            self._kept[b] = (b, msgspec.Raw(b))
            self._bytes += len(b)
        return b

    def wire(self, layout: bytes | None) -> msgspec.Raw:
        """An object's layout as the raw msgpack of a reply field."""
        if layout is None:
            return NO_LAYOUT
        got = self._kept.get(layout)
        return got[1] if got is not None else msgspec.Raw(layout)
