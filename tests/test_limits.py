"""Bounded cost per peer, on real processes: floods of idle, half-sent and over-cap
connections and of copy requests leave the master and the store nodes within memory bounds,
and honest clients keep working meanwhile. Figures are printed (``-s``) for the record; the
asserts are loose memory bounds, never speeds."""
from __future__ import annotations

import socket
import threading
import time

import msgspec
import psutil
import pytest
import zmq

from tests.conftest import wait_for
from kvpool.cli.cluster import LocalCluster
from kvpool.protocol import auth, rpcwire, transport
from kvpool.protocol import messages as M
from kvpool.protocol.config import load_config
from kvpool.protocol.dataplane import DataRequest, frame, recv_reply
from kvpool.protocol.errors import InvalidRequest, Overloaded
from kvpool.protocol.layout import MAX_LAYOUT_TENSORS, LayoutSpec, TensorSpec, raw_layout
from test_auth import _closed, _descs

MiB = 1 << 20


def _cfg(**security):
    return load_config(None, {"storenodes": [{"name": f"node-{i}", "memory": "64MiB"} for i in range(2)],
                              "security": security}, environ={})


@pytest.fixture(scope="module")
def lc():
    c = LocalCluster(_cfg(max_conns=64, frame_timeout="2s"), secure=True)
    c.__enter__()
    try:
        yield c
    finally:
        c.stop()


def _rss(child) -> int:
    return psutil.Process(child.proc.pid).memory_info().rss


def _hostport(addr: str) -> tuple[str, int]:
    host, port = addr[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


def _honest(lc, key: str) -> None:
    with lc.client(transport="tcp") as c:
        c.put(key, b"h" * 65536)
        assert c.get(key) == b"h" * 65536


def test_idle_and_junk_flood_is_bounded(lc):
    master, node = lc.masters[0], lc.nodes["node-0"]
    d = next(x for x in _descs(lc) if x.node_id == "node-0")
    before = _rss(master), _rss(node)
    t0 = time.monotonic()
    socks = []
    for addr in (lc.master_addr, d.data_addr):
        for i in range(60):  # under the cap: each waits out the handshake deadline
            s = socket.create_connection(_hostport(addr))
            if i % 2:
                s.sendall(auth.MAGIC + bytes([auth.VERSION]) + b"\0" * 32)  # a hello, then silence
            socks.append(s)
    _honest(lc, "during-idle-flood")  # while 120 peers sit in the handshake
    grown = _rss(master) - before[0], _rss(node) - before[1]
    for s in socks:
        s.settimeout(auth.HANDSHAKE_S + 15)
        assert _closed(s)
        s.close()
    closed_after = time.monotonic() - t0
    print(f"\nidle flood: 60+60 unauthenticated connections, master +{grown[0] / MiB:.1f} MiB, node "
          f"+{grown[1] / MiB:.1f} MiB, all closed after {closed_after:.1f}s")
    assert grown[0] < 64 * MiB and grown[1] < 128 * MiB
    _honest(lc, "after-idle-flood")


def test_connection_cap_refuses_with_a_clear_error(lc):
    """Authenticated connections fill the cap: one more is told Overloaded."""
    d = next(x for x in _descs(lc) if x.node_id == "node-1")
    holders = [transport.connect(d.data_addr, 5.0, lc.security) for _ in range(64)]
    try:
        wait_for(lambda: _refused(d.data_addr), 10, what="a connection over the cap to be refused")
        with pytest.raises(Overloaded, match="max_conns"):
            transport.connect(d.data_addr, 5.0, lc.security)
    finally:
        for s in holders:
            s.close()
    wait_for(lambda: _connects(d.data_addr, lc.security), 10, what="the data server to take connections again")
    _honest(lc, "after-cap")


def test_silent_peers_at_the_cap_do_not_lock_clients_out(lc):
    """Peers that connect and stay silent fill the master's and a node's cap (64): each new
    connection takes the place of the oldest one still in its handshake, so an honest client
    is served at once instead of being refused until the handshake deadline; connections
    past their handshake are never the ones closed."""
    d = next(x for x in _descs(lc) if x.node_id == "node-0")
    held = transport.connect(d.data_addr, 5.0, lc.security)  # authenticated before the flood
    socks = [socket.create_connection(_hostport(addr)) for addr in (lc.master_addr, d.data_addr) for _ in range(64)]
    try:
        _honest(lc, "during-cap-flood")
        held.sendall(frame(DataRequest("ping", "")))
        held.settimeout(5)
        assert recv_reply(held).ok
    finally:
        held.close()
        for s in socks:
            s.close()
    _honest(lc, "after-cap-flood")


def _refused(addr: str) -> bool:
    s = socket.create_connection(_hostport(addr))
    try:
        s.settimeout(2)
        return s.recv(5) == auth.MAGIC + auth.REFUSED
    except OSError:
        return False
    finally:
        s.close()


def _connects(addr: str, security) -> bool:
    try:
        transport.connect(addr, 5.0, security).close()
        return True
    except Overloaded:
        return False


def test_half_sent_frames_are_closed_at_the_deadline(lc):
    """Authenticated peers that start 64 MiB frames and stall: bounded by what they sent,
    and closed at security.frame_timeout (2 s here)."""
    master = lc.masters[0]
    before = _rss(master)
    socks = []
    for _ in range(12):
        s = transport.connect(lc.master_addr, 5.0, lc.security, auth.RPC)
        s.sendall(rpcwire.HEAD.pack(rpcwire.MAX_FRAME, 7) + b"\0" * MiB)  # 1 MiB of a 64 MiB frame
        socks.append(s)
    _honest(lc, "during-half-sent")
    grown = _rss(master) - before
    t0 = time.monotonic()
    for s in socks:
        s.settimeout(30)
        assert _closed(s)
        s.close()
    print(f"\nhalf-sent frames: 12 x 1 MiB of 64 MiB frames, master +{grown / MiB:.1f} MiB, closed "
          f"{time.monotonic() - t0:.1f}s after the flood")
    assert grown < 12 * 2 * MiB + 64 * MiB
    _honest(lc, "after-half-sent")


def test_copy_request_flood_is_refused_not_queued(lc):
    """An authenticated control peer (holding the secret) floods a node with copy requests
    whose destination never answers: at most storenode.server.COPY_MAX are taken, the rest
    are answered Overloaded at once; the node keeps its etcd lease and serves."""
    from kvpool.storenode.server import COPIERS, COPY_CONNECT_S, COPY_MAX

    with lc.client() as c:
        c.put("copy-src", b"c" * 4096, replicas=2)  # on both nodes, so node-0 holds a row to copy
    node = lc.nodes["node-0"]
    d = next(x for x in _descs(lc) if x.node_id == "node-0")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # keep every reply: past the high-water mark the node's ROUTER drops them
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = auth.curve_client_keys(lc.security)
    sock.connect(d.ctrl_addr)
    sock.send(M.encode(M.NodeList()))
    assert sock.poll(5000)
    rep = msgspec.msgpack.decode(sock.recv(), type=M.Reply)
    term = rep.error.fields.get("term", 0) if rep.error is not None else 0
    sock.send(M.encode(M.NodeList(term=term)))
    assert sock.poll(5000)
    rows = msgspec.msgpack.decode(msgspec.msgpack.decode(sock.recv(), type=M.Reply).result)[1]
    assert rows, "node-0 lists no committed extent of copy-src"
    row = rows[0]
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(4096)  # accepts into the backlog, never answers
    dst = M.ExtentRef("sink", "x", "tcp://127.0.0.1:%d" % sink.getsockname()[1], "", "h", 0, row[2], 1)
    before = _rss(node)
    n = 3000
    t0 = time.monotonic()
    for _ in range(n):
        sock.send(M.encode(M.NodeCopy(row[1], row[3], dst, row[0], row[4], term=term)))
    refused = 0
    deadline = time.monotonic() + 30
    while refused < n - COPY_MAX and time.monotonic() < deadline:
        if sock.poll(1000):
            r = msgspec.msgpack.decode(sock.recv(), type=M.Reply)
            refused += r.error is not None and r.error.code == "overloaded"
    took = time.monotonic() - t0
    grown = _rss(node) - before
    _honest(lc, "during-copy-flood")
    print(f"\ncopy flood: {n} requests, {refused} refused Overloaded in {took:.1f}s, node +{grown / MiB:.1f} MiB")
    # at most COPY_MAX taken at once; a taken copy ends (its destination never answers) after
    # COPY_CONNECT_S, freeing its slot, so a flood served slowly (a busy machine) may see a
    # few more taken over its span, never an unbounded queue
    assert n - refused <= COPY_MAX + COPIERS * (int(took / COPY_CONNECT_S) + 1), (refused, took)
    assert grown < 64 * MiB
    assert node.alive()
    assert "etcd lease lost" not in open(node.log_path).read(), "the copy flood cost the node its etcd lease"
    sink.close()
    sock.close()


def _prober(lc, key: str):
    """``(prober, latencies, stop)``: ``prober()`` (run it on a thread) times another
    client's ``exists_batch([key])`` every 10 ms into ``latencies`` (seconds) until ``stop``."""
    probe, lat, stop = lc.client(), [], threading.Event()
    probe.put(key, b"1")

    def prober() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            assert probe.exists_batch([key]) == [True]
            lat.append(time.perf_counter() - t)
            time.sleep(0.01)

    return prober, lat, stop


def test_a_batch_past_the_key_limit_is_refused_and_the_client_splits_it(lc):
    """A request carrying more than MAX_BATCH_KEYS keys (40 MB, 400k keys) is refused with
    a typed InvalidRequest naming the limit, and the master keeps answering another client
    meanwhile; KVPoolClient's batch calls split larger batches and answer every key. The
    other client's worst wait is printed (``-s``), never asserted."""
    keys = [("k%08d" % i) * 11 for i in range(400_000)]  # 99-byte keys
    prober, lat, stop = _prober(lc, "limit/x")
    refused: list[BaseException] = []

    def big() -> None:
        with lc.client(rpc_timeout_s=60) as c:
            for req in (M.Lookup(keys), M.Exists(keys), M.Remove(keys)):
                with pytest.raises(InvalidRequest, match=f"at most {M.MAX_BATCH_KEYS} keys per request") as ei:
                    c.rpc.call(req)
                refused.append(ei.value)

    t = threading.Thread(target=prober)
    t.start()
    try:
        bigs = [threading.Thread(target=big) for _ in range(3)]
        for b in bigs:
            b.start()
        for b in bigs:
            b.join(120)
    finally:
        stop.set()
        t.join(30)
    assert len(refused) == 9 and lat
    print(f"\nLIMITS three 400k-key requests: another client's worst exists {max(lat) * 1e3:.0f} ms "
          f"over {len(lat)} calls", flush=True)
    with lc.client(rpc_timeout_s=60) as c:  # a hand-off counts its record's keys over all groups
        rec = M.HandoffRecord("big", {"0": keys[:10_000], "1": keys[10_000:20_000]}, {}, "p", 60.0)
        with pytest.raises(InvalidRequest, match="HandoffPublish carries 20002 keys"):  # groups counted too
            c.rpc.call(M.HandoffPublish(rec))
        lay = LayoutSpec(kind="raw", tokens_per_block=1,  # a layout past its tensor limit: refused unread
                         tensors=tuple(TensorSpec(f"t{i}", (4,), "uint8") for i in range(8)))
        big = msgspec.structs.replace(lay)
        msgspec.structs.force_setattr(big, "tensors", lay.tensors * (MAX_LAYOUT_TENSORS // 8 + 1))  # unchecked
        t0 = time.monotonic()
        with pytest.raises(InvalidRequest, match=f"length <= {MAX_LAYOUT_TENSORS}"):
            c.rpc.call(M.PutStart([M.PutItem("limit/lay", 32, 0, raw_layout(big))], c.host_id, 1))
        refused_s = time.monotonic() - t0
        with pytest.raises(InvalidRequest, match="put_end: 1 keys but 3 put ids"):
            c.rpc.call(M.PutEnd(["limit/a"], [1, 2, 3]))
        rel = M.PutReserved([M.ReservedPut("limit/r", 1, 1, 0)],  # items and given-back reservations together
                            refill=M.Reserve(1, 1, release=list(range(M.MAX_BATCH_KEYS))))
        with pytest.raises(InvalidRequest, match="PutReserved carries"):
            c.rpc.call(rel)
        print(f"LIMITS a {len(big.tensors)}-tensor layout refused in {refused_s * 1e3:.0f} ms", flush=True)
        n = M.MAX_BATCH_KEYS * 2 + 5
        put_keys = [f"limit/split/{i}" for i in range(n)]
        assert c.put_batch(put_keys, [b"v%d" % (i % 7) for i in range(n)]) == [None] * n
        assert c.exists_batch([*put_keys, "limit/absent"]) == [True] * n + [False]
        assert [len(i.replicas) > 0 for i in c.lookup(put_keys[-3:])] == [True] * 3
        assert c.get_batch(put_keys) == [b"v%d" % (i % 7) for i in range(n)]
        assert c.remove_batch(put_keys) == [None] * n
        assert c.exists_batch(put_keys) == [False] * n


def test_a_big_batch_is_answered_in_slices_and_a_mismatched_one_refused_whole(lc):
    """A MAX_BATCH_KEYS-item put_start whose items carry a 100-tensor layout is answered in
    full (the master answers it a slice per loop turn, master/batches.py, so another client
    is served between slices; its worst wait is printed, never asserted); a batch carrying
    more than MAX_REQUEST_LAYOUTS distinct layouts is refused before any item is placed; a
    sliced put_end whose put ids do not match its keys is refused whole, committing nothing;
    a sliced lookup answers every key in order."""
    n = M.MAX_BATCH_KEYS
    lay = LayoutSpec(kind="raw", tokens_per_block=1, tensors=tuple(TensorSpec(f"layer.{i}.kv", (4,), "uint8")
                                                                   for i in range(100)))
    prober, lat, stop = _prober(lc, "slice/x")
    t = threading.Thread(target=prober)
    t.start()
    try:
        with lc.client(rpc_timeout_s=120) as c:
            keys = [f"slice/{i}" for i in range(n)]
            grants = c.rpc.call(M.PutStart([M.PutItem(k, 400, 0, raw_layout(lay)) for k in keys], c.host_id, 1))
            assert len(grants) == n and all(isinstance(g, M.PutGrant) for g in grants)
            ids = [g.put_id for g in grants]
            with pytest.raises(InvalidRequest, match=f"PutEnd: {n} keys but 1024 put_ids"):
                c.rpc.call(M.PutEnd(keys, ids[:1024]))
            assert c.rpc.call(M.PutRevoke(keys, ids)) == [None] * n
            assert c.exists_batch(keys[:1024]) == [False] * 1024  # the refused put_end committed nothing
            distinct = [M.PutItem(f"slice/d{i}", 400, 0, raw_layout(msgspec.structs.replace(lay, tokens_per_block=i + 1)))
                        for i in range(M.MAX_REQUEST_LAYOUTS + 1)]
            with pytest.raises(InvalidRequest, match=f"more than {M.MAX_REQUEST_LAYOUTS} distinct layouts"):
                c.rpc.call(M.PutStart(distinct * (n // len(distinct)), c.host_id, 1))
            assert not any(c.exists_batch([it.key for it in distinct]))
            c.put_batch(["slice/a", "slice/b"], [b"a", b"b"])
            asked = keys[:n - 2]
            asked[1500], asked[-1] = "slice/a", "slice/b"
            infos = c.rpc.call(M.Lookup(asked, lease=False))
            assert [i.key for i in infos if isinstance(i, M.ObjectInfo)] == ["slice/a", "slice/b"]
            assert isinstance(infos[1500], M.ObjectInfo) and isinstance(infos[-1], M.ObjectInfo)
    finally:
        stop.set()
        t.join(30)
    assert lat
    print(f"\nLIMITS a {n}-item put of 100-tensor layouts, answered in slices: another client's worst "
          f"exists {max(lat) * 1e3:.0f} ms over {len(lat)} calls", flush=True)


def test_batches_whose_layouts_fill_frames_are_split_to_fit(lc):
    """8,192 objects whose layout encodes to about 9 KB (a 200-tensor model layout): the put
    requests would carry about 70 MB and a lookup's answer as much, past the 64 MiB frame.
    KVPoolClient cuts the puts by bytes, and halves a lookup the master answers with
    ReplyTooLarge: every object is stored, looked up and read back."""
    lay = LayoutSpec(kind="raw", tokens_per_block=1, tensors=tuple(
        TensorSpec(f"model.language_model.layers.{i}.self_attn.kv_cache.key_value", (4,), "uint8")
        for i in range(200)))
    assert len(lay.encode()) > 8000
    n = 8192
    keys = [f"fat/{i}" for i in range(n)]
    vals = [i.to_bytes(4, "little") * 200 for i in range(n)]
    with lc.client(rpc_timeout_s=120) as c:
        assert c.put_batch(keys, vals, lay) == [None] * n
        with pytest.raises(InvalidRequest, match="frame limit"):  # the master's answer to one such request
            c.rpc.call(M.Lookup(keys, lease=False))
        infos = c.lookup(keys)
        assert all(i is not None and i.layout == lay for i in infos)
        assert c.get_batch(keys[:2048], lay) == vals[:2048]
        assert c.remove_batch(keys) == [None] * n
