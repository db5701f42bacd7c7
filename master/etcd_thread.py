"""The master's etcd thread (asyncio, aetcd), mixed into :class:`master.server.MasterServer`.

It campaigns for leadership (create-if-absent on the ``leader`` key under a kept-alive
lease). On winning it reads what the RPC thread needs to lead (the published nodes, their
extent tables asked in parallel on the join workers, the hand-off and pin records, the
cluster settings) and hands it over as one ``lead`` event; while leading it polls ``nodes/``
for membership every ``membership_poll_s`` (``nodes`` events) and compacts etcd's history;
when the leadership ends it hands over ``step_down`` and deletes the ``leader`` key only if
it is still its own. Also the RPC thread's door to etcd: :meth:`_EtcdThread._etcd_submit`
starts a coroutine there (the durable writes, :mod:`master.durable`) and
:meth:`_EtcdThread._etcd_forget` deletes a record, retried until etcd answers.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec

from kvpool.master.cluster_settings import _settings_of
from kvpool.master.joins import Table, fetch_table
from kvpool.master.records import decode_records
from kvpool.protocol import messages as M
from kvpool.protocol.errors import EtcdFull, EtcdUnavailable, KVPoolError
from kvpool.protocol.etcd import Etcd, LeaseClock, kept_alive

log = logging.getLogger("kvpool.master")


class _EtcdThread:
    """The etcd thread of a :class:`~master.server.MasterServer` (mixed into it; talks to the
    RPC thread through its ``events`` deque, ``stop``, ``loop``, ``etcd`` and ``etcd_ok``)."""

    def _etcd_main(self) -> None:
        try:
            asyncio.run(self._etcd_async())
        except KVPoolError as e:  # logged once, by main(), when run() raises it again
            self.fatal = e
            self.stop.set()

    async def _etcd_async(self) -> None:
        self.loop = asyncio.get_running_loop()
        async with Etcd(self.s.etcd, auth=self.s.etcd_auth) as etcd:
            self.etcd = etcd
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
                self.leader_addr = cur.decode() if cur else ""
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
            self.events.append(("lead", nodes, handoffs, pins, settings, tables, term, clock))
            compactor = asyncio.create_task(self._compact_history(etcd))
            try:
                while not self.stop.is_set() and not lost.is_set():
                    await asyncio.sleep(self.s.membership_poll_s)
                    try:
                        self.events.append(("nodes", await self._read_nodes(etcd)))
                        self.etcd_ok = True
                    except Exception:
                        self.etcd_ok = False  # etcd unavailable: membership changes wait (DESIGN.md §8)
            finally:
                compactor.cancel()
                self.events.append(("step_down",))
                if not lost.is_set():  # only our own key: a successor's must stay
                    with contextlib.suppress(Exception):
                        await etcd.delete_if_created(self.keys.leader, term)

    async def _fetch_tables(self, descs: dict[str, M.NodeDesc], term: int) -> dict[str, Table | Exception]:
        """The extent tables of the published nodes of this wire version, asked in parallel on
        the join workers, each within ``join_timeout_s`` (node id -> table, or the error), as
        leader of ``term``."""
        ask = [d for d in descs.values() if d.wire == M.WIRE_VERSION]
        got = await asyncio.gather(*(asyncio.wrap_future(self._join_pool.submit(
            fetch_table, self.ctx, d, self.s.join_timeout_s, self.stop, term)) for d in ask),
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
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                d = msgspec.msgpack.decode(v, type=M.NodeDesc)
                if self.s.security.secret is not None:  # write grants are keyed by the secret, never by etcd
                    d = msgspec.structs.replace(d, grant_key=self.s.security.grant_key(d.incarnation))
                out[d.node_id] = d
        return out

    def _etcd_forget(self, key: str) -> None:
        """Delete an etcd record, after any write to it still in flight; a delete etcd
        refuses is retried once etcd answers again, so no stale pin or hand-off record stays."""
        async def delete(e: Etcd) -> None:
            try:
                await e.delete(key)
            except Exception:  # noqa: BLE001 - any failure: try again later
                self.events.append(("forget_failed", key))

        if self.durable.after(key, delete, "etcd records"):
            return
        try:
            self._etcd_submit(delete, "etcd records", False)
        except EtcdUnavailable:
            self._forget_retry.add(key)

    def _etcd_submit(self, coro_fn, what: str, check: bool = True):
        """Start ``coro_fn(etcd)`` on the etcd thread; its concurrent Future. Raises
        EtcdUnavailable at once when etcd is known to be down (``check``) or not connected."""
        if self.loop is None or self.etcd is None or (check and not self.etcd_ok):
            raise EtcdUnavailable(f"etcd is unavailable; {what} need etcd. Check the etcd endpoint (`kvpool "
                                  "status` still works), then retry")
        return asyncio.run_coroutine_threadsafe(coro_fn(self.etcd), self.loop)
