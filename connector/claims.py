"""Write claims held across calls, for reserved extents (:mod:`master.reservations`).

A same-host writer claims a reservation's extent at the node when it receives the
reservation, long before it copies an object in (:mod:`storenode.extents` has the claim
rules; they do not care how long a claim lasts). A node owns claims per connection, and
any of the client's threads may use a reservation, so these claims live on one stream per
node shared by the client's threads (:class:`SharedClaims`, under one lock), not on the
per-thread streams: the claim, the ``written`` that ends it and the writer's ``commit``
copy all go on it. Should that stream break, the node keeps its claims until this process
exits (:mod:`storenode.writers`); the reservations are then given up.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

from kvpool.connector.datastream import Connections, _Stream, close_stream
from kvpool.protocol.dataplane import HeldExtent, batch_frames, sendv
from kvpool.protocol.errors import KVPoolError, NodeUnavailable, from_wire
from kvpool.protocol.messages import ExtentRef
from kvpool.protocol.spin import Spinner

_RELEASE_S = 0.5  # seconds the release of unanswered claims may wait to be sent


class SharedClaims:
    """The claims of a :class:`~connector.dataclient.DataPlane` held across calls: one shared
    stream per same-host node (by its Unix socket path), used under one lock. Given
    ``conns`` (the plane's :class:`~connector.datastream.Connections`, which dials these
    streams, closes them with its own and counts their redials), ``io_timeout_s`` (seconds:
    a stream's timeout outside a claim round) and ``spin`` (polls for a node's reply before
    the wait sleeps, :class:`~protocol.spin.Spinner`)."""

    def __init__(self, conns: Connections, io_timeout_s: float, spin: Spinner) -> None:
        self.conns = conns
        self.io_timeout_s = io_timeout_s
        self.spin = spin
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}

    def _stream(self, addr: str, incarnation: str) -> _Stream:
        """Caller holds ``_lock``."""
        s = self._streams.get(addr)
        if s is not None and s.incarnation != incarnation:  # opened to the node's earlier instance
            self._drop(addr)
            s = None
            self.conns.redials += 1
        if s is None:
            s = self._streams[addr] = self.conns.dial(addr, self.io_timeout_s, incarnation)
        return s

    def _drop(self, addr: str) -> None:
        s = self._streams.pop(addr, None)
        if s is not None:
            close_stream(s)

    def claim(self, refs: Sequence[ExtentRef], timeout_s: float,
              meanwhile: Callable[[], None] | None = None) -> list[KVPoolError | None]:
        """:meth:`claim_many` for the refs of one node."""
        return self.claim_many({refs[0].node_id: list(refs)}, timeout_s, meanwhile)[refs[0].node_id]

    def claim_many(self, by_node: dict[str, Sequence[ExtentRef]], timeout_s: float,
                        meanwhile: Callable[[], None] | None = None) -> dict[str, list[KVPoolError | None]]:
        """Claim ``by_node[node_id]`` (keyless reservation grants on that same-host node) on
        each node's shared stream: every node's claims are sent first, then the verdicts
        read, so the round trips overlap. Per node and ref None (claimed) or the node's
        refusal (PutRevoked, ExtentBusy, StaleTerm) or NodeUnavailable when it did not
        answer within ``timeout_s``. ``meanwhile()`` runs once, after the claims are sent
        and before their verdicts are read (a put hashes its buffers there)."""
        out: dict[str, list[KVPoolError | None]] = {n: [None] * len(refs) for n, refs in by_node.items()}
        with self._lock:
            sent: list[tuple[str, Sequence[ExtentRef], _Stream, int]] = []
            for nid, refs in by_node.items():
                r0 = refs[0]
                try:
                    s = self._stream(r0.shm_path, r0.incarnation)
                    s.sock.settimeout(timeout_s)
                    frames = batch_frames("claims", r0.incarnation, [HeldExtent(r.offset, r.size, r.gen, r.token)
                                                                     for r in refs])
                    sendv(s.sock, [b"".join(frames)])
                    sent.append((nid, refs, s, len(frames)))
                except (OSError, KVPoolError) as e:
                    self._claims_failed(refs, e, timeout_s, out[nid])
            if meanwhile is not None and sent:
                meanwhile()
                meanwhile = None
            for nid, refs, s, n_frames in sent:
                r0 = refs[0]
                got = out[nid]
                try:
                    self.spin.wait(s)
                    i = 0
                    for _ in range(n_frames):
                        rep = s.reply()
                        errs = rep.errors if rep.ok else [rep.error] * (len(refs) - i)
                        for e in errs[:len(refs) - i]:
                            got[i] = None if e is None else from_wire(e)
                            i += 1
                    if i < len(refs):
                        raise NodeUnavailable(f"store node {r0.node_id} answered {i} of {len(refs)} claims",
                                              node=r0.node_id)
                    s.sock.settimeout(self.io_timeout_s)
                except (OSError, KVPoolError) as e:
                    self._claims_failed(refs, e, timeout_s, got)
        if meanwhile is not None:  # the claims never went out: the work is still the caller's
            meanwhile()
        return out

    def _claims_failed(self, refs: Sequence[ExtentRef], e: BaseException, timeout_s: float,
                       out: list[KVPoolError | None]) -> None:
        """The claims of ``refs`` (one node) got no verdict: ``written`` for them (claims the node
        grants late end there: a node owns claims per connection), the stream dropped, and
        every ref without a verdict failed with NodeUnavailable. Caller holds ``_lock``."""
        r0 = refs[0]
        s = self._streams.get(r0.shm_path)
        if s is not None:
            with contextlib.suppress(OSError, KVPoolError):
                s.sock.settimeout(_RELEASE_S)
                sendv(s.sock, batch_frames("written_all", r0.incarnation,
                                           [HeldExtent(r.offset, r.size, r.gen, r.token) for r in refs]))
        self._drop(r0.shm_path)
        err = e if isinstance(e, NodeUnavailable) else NodeUnavailable(
            f"store node {r0.node_id} did not answer a claim within {timeout_s:g}s: {e}", node=r0.node_id)
        for i, o in enumerate(out):
            out[i] = o or err

    def end(self, done: Sequence[ExtentRef], commits: Sequence[tuple[ExtentRef, str, int, bytes | None, int]]
                 ) -> None:
        """One-way, on the shared stream of one same-host node: ``written`` for each of
        ``done`` (their copies are over or will not happen: the claims end), then the
        writer's ``commit`` copy of each ``(ref with the keyed token, key, checksum,
        layout, replicas wanted)``. Best effort: a broken stream keeps the claims until
        this process exits."""
        r0 = done[0] if done else commits[0][0]
        bufs = batch_frames("written_all", r0.incarnation, [HeldExtent(r.offset, r.size, r.gen, r.token) for r in done])
        bufs += batch_frames("commits", r0.incarnation, [HeldExtent(r.offset, r.size, r.gen, r.token, key, checksum,
                                                                    layout, wanted)
                                                         for r, key, checksum, layout, wanted in commits])
        with self._lock:
            try:
                s = self._stream(r0.shm_path, r0.incarnation)
                sendv(s.sock, [b"".join(bufs)])
            except (OSError, KVPoolError):
                self._drop(r0.shm_path)
