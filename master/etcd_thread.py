"""The master's etcd thread (asyncio, aetcd): :class:`EtcdThread`, a part owned by
:class:`master.server.MasterServer` (its ``etcd``).

It campaigns for leadership (create-if-absent on the ``leader`` key under a kept-alive
lease). On winning it reads what the RPC thread needs to lead (the published nodes, their
extent tables asked in parallel on the join workers, the hand-off and pin records, the
cluster settings) and hands it over as one ``lead`` event; while leading it polls ``nodes/``
for membership every ``membership_poll_s`` (``nodes`` events) and compacts etcd's history;
when the leadership ends it hands over ``step_down`` and deletes the ``leader`` key only if
it is still its own. Also the RPC thread's door to etcd: :meth:`EtcdThread.submit` starts a
coroutine there (the durable writes, :mod:`master.durable`, and the record deletes).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine

import msgspec

from kvpool.master.cluster_settings import _settings_of
from kvpool.master.joins import Table
from kvpool.master.records import decode_records
from kvpool.master.server_settings import MasterServerSettings
from kvpool.protocol import messages as M
from kvpool.protocol.errors import DECODE_ERRORS, EtcdFull, EtcdUnavailable, KVPoolError
from kvpool.protocol.etcd import Etcd, Keys, LeaseClock, kept_alive

log = logging.getLogger("kvpool.master")


class EtcdThread:
    """The etcd client of one master and the thread it runs on.

    Given: ``s`` (etcd endpoints and credentials, ``node_ttl_s`` for the leadership lease,
    ``membership_poll_s``, ``join_timeout_s``, the compaction settings, the flags that seed
    the cluster settings, the cluster secret that keys write grants), ``keys`` (the
    cluster's etcd keys), ``rpc_addr`` (what the ``leader`` key names while this master
    leads), ``stop`` (set to end the thread; this part sets it on a fatal error),
    ``post(event)`` (hands an event tuple to the RPC thread: ``("lead", nodes, handoffs,
    pins, settings, tables, term, clock)``, ``("nodes", nodes)``, ``("step_down",)``),
    ``fetch(desc, timeout_s, term)`` (asks a node for its extent table on a join worker: a
    concurrent Future of a :class:`~master.joins.Table`) and ``saw_leader(addr)`` (the
    leader's RPC address, "" when none, as read while campaigning).

    Owns: the thread, its event loop ``loop`` and connected ``client`` (None until
    connected), ``ok`` (False while the last membership poll failed: etcd is down),
    ``fatal`` (the error that ended the thread, else None) and the event that gives the
    current leadership up (:meth:`give_up_lead`).
    """

    def __init__(self, s: MasterServerSettings, keys: Keys, rpc_addr: str, stop: threading.Event,
                 post: Callable[[tuple], None],
                 fetch: Callable[[M.NodeDesc, float, int], concurrent.futures.Future],
                 saw_leader: Callable[[str], None]) -> None:
        self.s, self.keys, self.rpc_addr, self.stop = s, keys, rpc_addr, stop
        self.post, self.fetch, self.saw_leader = post, fetch, saw_leader
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: Etcd | None = None
        self.ok = True
        self.fatal: KVPoolError | None = None
        self._lost: asyncio.Event | None = None  # set to give the leadership up (a node saw a newer term)
        self._thread: threading.Thread | None = None

    # ---- the RPC thread's side ---------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="etcd", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def running(self) -> bool:
        """The thread is alive and its event loop started."""
        return self._thread is not None and self._thread.is_alive() and self.loop is not None

    def responsive(self, timeout_s: float) -> bool:
        """The event loop runs a callback within ``timeout_s`` seconds (any thread)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(fut.set_result, None)
        try:
            fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def connected(self) -> bool:
        return self.loop is not None and self.client is not None

    def give_up_lead(self) -> None:
        """End the current leadership (the campaign then starts again as a standby)."""
        lost, loop = self._lost, self.loop
        if lost is not None and loop is not None:
            loop.call_soon_threadsafe(lost.set)

    def submit(self, coro_fn: Callable[[Etcd], Coroutine], what: str, check: bool = True) -> concurrent.futures.Future:
        """Start ``coro_fn(client)`` on the etcd thread; its concurrent Future. Raises
        EtcdUnavailable at once when etcd is known to be down (``check``) or not connected;
        ``what`` names the records in that error."""
        if not self.connected() or (check and not self.ok):
            raise EtcdUnavailable(f"etcd is unavailable; {what} need etcd. Check the etcd endpoint (`kvpool "
                                  "status` still works), then retry")
        return asyncio.run_coroutine_threadsafe(coro_fn(self.client), self.loop)

    # ---- the etcd thread ---------------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except KVPoolError as e:  # logged once, by main(), when run() raises it again
            self.fatal = e
            self.stop.set()

    async def _run(self) -> None:
        self.loop = asyncio.get_running_loop()
        async with Etcd(self.s.etcd, auth=self.s.etcd_auth) as etcd:
            self.client = etcd
            print(f"KVPOOL_READY master {self.rpc_addr}", flush=True)
            told = 0.0
            while not self.stop.is_set():
                try:
                    await self._campaign_and_lead(etcd)
                except EtcdFull as e:  # no lease can be granted: campaign again once etcd has room
                    if time.monotonic() - told > 60:
                        log.warning("master: cannot campaign for leadership: %s", e)
                        told = time.monotonic()
                    await asyncio.sleep(1.0)
                except KVPoolError:
                    raise
                except Exception as e:  # noqa: BLE001 - no etcd endpoint answered: campaign again
                    if time.monotonic() - told > 60:
                        log.warning("master: cannot campaign for leadership, etcd did not answer (%s: %s); retrying",
                                    type(e).__name__, e)
                        told = time.monotonic()
                    await asyncio.sleep(1.0)

    async def _campaign_and_lead(self, etcd: Etcd) -> None:
        lost = self._lost = asyncio.Event()
        clock = LeaseClock()
        async with kept_alive(etcd, self.s.node_ttl_s, lost, clock) as lease:
            while not self.stop.is_set() and not lost.is_set():
                if await etcd.create_if_absent(self.keys.leader, self.rpc_addr.encode(), lease):
                    mine = await etcd.get_meta(self.keys.leader)
                    if mine is not None and mine.lease == lease.id:
                        break
                    continue  # gone again at once (our lease lapsed): campaign on
                cur = await etcd.get(self.keys.leader)
                self.saw_leader(cur.decode() if cur else "")
                await asyncio.sleep(self.s.membership_poll_s)
            else:
                return
            term = mine.create_revision  # protocol/terms.py: this leadership's term
            nodes = await self._read_nodes(etcd)
            tables = await self._fetch_tables(nodes, term)  # each node refuses older terms from now on
            handoffs, pins = decode_records((await etcd.get_prefix(self.keys.handoffs)).values(),
                                            (await etcd.get_prefix(self.keys.pins)).values())
            settings = await etcd.get(self.keys.config)
            if settings is None:  # the cluster's first leader: its flags become the cluster's settings
                settings = msgspec.json.encode(_settings_of(self.s.state))
                try:
                    await etcd.put(self.keys.config, settings)
                except Exception as e:  # noqa: BLE001 - the next leader writes them
                    log.warning("master: could not record the cluster settings in etcd (%s)", e)
            self.post(("lead", nodes, handoffs, pins, settings, tables, term, clock))
            compactor = asyncio.create_task(self._compact_history(etcd))
            try:
                while not self.stop.is_set() and not lost.is_set():
                    await asyncio.sleep(self.s.membership_poll_s)
                    try:
                        self.post(("nodes", await self._read_nodes(etcd)))
                        self.ok = True
                    except Exception:
                        self.ok = False  # etcd unavailable: membership changes wait (DESIGN.md §8)
            finally:
                compactor.cancel()
                self.post(("step_down",))
                if not lost.is_set():  # only our own key: a successor's must stay
                    with contextlib.suppress(Exception):
                        await etcd.delete_if_created(self.keys.leader, term)

    async def _fetch_tables(self, descs: dict[str, M.NodeDesc], term: int) -> dict[str, Table | Exception]:
        """The extent tables of the published nodes of this wire version, asked in parallel on
        the join workers, each within ``join_timeout_s`` (node id -> table, or the error), as
        leader of ``term``."""
        ask = [d for d in descs.values() if d.wire == M.WIRE_VERSION]
        got = await asyncio.gather(*(asyncio.wrap_future(self.fetch(d, self.s.join_timeout_s, term)) for d in ask),
                                   return_exceptions=True)
        return {d.node_id: r for d, r in zip(ask, got)}

    async def _compact_history(self, etcd: Etcd) -> None:
        """While leading: every ``etcd_compaction_interval_s`` seconds, compact etcd's history to
        its current revision minus ``etcd_compaction_retention`` revisions, so that an etcd
        without auto-compaction does not fill its quota with superseded pin and hand-off
        records. Runs on the etcd thread beside the durable writes; errors are logged (once a
        minute at most) and the next round tries again."""
        every, keep = self.s.etcd_compaction_interval_s, self.s.etcd_compaction_retention
        if every <= 0:
            return
        done, told = 0, 0.0
        while True:
            await asyncio.sleep(every)
            try:
                target = (await etcd.status()).revision - keep
                if target > done:
                    await etcd.compact(target)  # False: etcd's own compaction got there first
                    done = target
            except Exception as e:  # noqa: BLE001 - not fatal: etcd may be down or refuse for a while
                if time.monotonic() - told > 60:
                    log.warning("master: etcd compaction failed (%s: %s); retrying every %gs", type(e).__name__, e,
                                every)
                    told = time.monotonic()

    async def _read_nodes(self, etcd: Etcd) -> dict[str, M.NodeDesc]:
        out = {}
        for v in (await etcd.get_prefix(self.keys.nodes)).values():
            with contextlib.suppress(*DECODE_ERRORS):
                d = msgspec.msgpack.decode(v, type=M.NodeDesc)
                if self.s.security.secret is not None:  # write grants are keyed by the secret, never by etcd
                    d = msgspec.structs.replace(d, grant_key=self.s.security.grant_key(d.incarnation))
                out[d.node_id] = d
        return out
