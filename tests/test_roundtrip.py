"""Real cluster round trips: sizes, transports, concurrency, content addressing, tensors."""
import os
import threading

import numpy as np
import pytest
import torch
import xxhash

from kvpool.connector.parking import held
from kvpool.connector.blocks import BlockStore
from kvpool.protocol import copyhash
from kvpool.protocol import errors as E
from kvpool.protocol.keys import block_hashes
from kvpool.protocol.layout import LayoutSpec, TensorSpec


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("size", [1, 4096, 1 << 20, 64 << 20])
def test_round_trip_sizes(cluster, transport, size):
    with cluster.client(transport=transport) as c:
        data = os.urandom(size)
        key = f"rt/{transport}/{size}"
        c.put(key, data)
        got = c.get(key)
        assert got is not None and len(got) == size
        assert xxhash.xxh3_64_intdigest(got) == xxhash.xxh3_64_intdigest(data)
        assert got == data
        c.remove(key)
        assert c.get(key) is None


def test_same_host_clients_reach_the_master_over_its_unix_alias(cluster):
    """A client on the master's host asks Hello over TCP and moves to the abstract Unix
    socket it names, however the master's address is spelled; both reach the same master."""
    import socket

    from kvpool.connector.client import KVPoolClient

    with cluster.client() as c:
        c.put("alias/k", b"v")
        assert held(c.rpc._local, "conn").sock.family == socket.AF_UNIX
    port = cluster.master_addr.rsplit(":", 1)[1]
    with KVPoolClient(f"tcp://localhost:{port}") as c:
        assert c.get("alias/k") == b"v"
        assert held(c.rpc._local, "conn").sock.family == socket.AF_UNIX


@pytest.mark.parametrize("honest", [True, False])
def test_alias_is_used_only_when_its_peer_is_the_master(honest):
    """A Hello naming a Unix socket served by another process than the one that answered
    (an impostor, or a master that died and whose name was taken) is not followed: the
    client stays on TCP. The same answer from the serving process itself is followed."""
    import os
    import secrets
    import socket
    import threading

    import msgspec

    from kvpool.connector.rpc import MasterRPC
    from kvpool.protocol import messages as M
    from kvpool.protocol import rpcwire, transport

    name = f"unix://@kvpool-test-{secrets.token_hex(8)}"
    tcp = transport.listen("tcp://127.0.0.1:0")
    unix = transport.listen(name)
    pid = os.getpid() if honest else os.getppid()  # what the "master" claims to be

    def serve(lst):
        conn, _ = lst.accept()
        frames = rpcwire.BlockingFrames(conn)
        try:
            while True:
                rid, body = frames.read()
                req = M.decode_request(bytes(body))
                res = (M.HelloReply(name, pid, transport.default_host_id(), M.WIRE_VERSION) if isinstance(req, M.Hello)
                       else [lst is unix])  # Exists answers True over the alias, False over TCP
                conn.sendall(rpcwire.pack(rid, M.encode(M.Reply(msgspec.Raw(M.encode(res))))))
        except (OSError, E.KVPoolError):
            conn.close()

    for lst in (tcp, unix):
        threading.Thread(target=serve, args=(lst,), daemon=True).start()
    rpc = MasterRPC("tcp://127.0.0.1:%d" % tcp.getsockname()[1], timeout_s=5)
    try:
        assert rpc.call(M.Exists(["k"])) == [honest]
        assert (held(rpc._local, "conn").sock.family == socket.AF_UNIX) is honest
    finally:
        rpc.close()
        tcp.close()
        unix.close()


def test_lanes_split_a_nodes_batch_by_bytes():
    from types import SimpleNamespace as NS

    from kvpool.connector.client import lanes

    ops = [NS(ref=NS(size=n)) for n in (3 << 20, 1 << 20, 2 << 20, 2 << 20)]
    assert lanes(ops, 1) == [ops]
    assert lanes(ops[:1], 4) == [ops[:1]]
    small = [NS(ref=NS(size=1 << 20)) for _ in range(3)]
    assert lanes(small, 2) == [small]  # 3 MiB in all: not worth a second stream
    two = lanes(ops, 2)
    assert sorted(sum(o.ref.size for o in g) for g in two) == [4 << 20, 4 << 20]
    assert sorted(map(id, sum(two, []))) == sorted(map(id, ops))  # every op once
    assert len(lanes(ops, 8)) == 4  # never more lanes than ops


def test_streams_per_node_moves_one_nodes_batch_over_several_connections(cluster):
    """With streams_per_node=3 a batch bound for one node goes over more than one
    connection to it, and every object arrives whole; bad values are config errors."""
    import numpy as np

    with pytest.raises(E.ConfigError, match="streams_per_node"):
        cluster.client(streams_per_node=0)
    with cluster.client(transport="tcp", streams_per_node=3) as c:
        c.drain("node-1")
        try:
            rng = np.random.default_rng(3)
            objs = [rng.integers(0, 256, 2 << 20, dtype=np.uint8) for _ in range(6)]
            keys = [f"lanes/{i}" for i in range(6)]
            assert c.put_batch(keys, objs) == [None] * 6
            outs = [np.zeros(2 << 20, dtype=np.uint8) for _ in range(6)]
            assert c.get_into_batch(keys, outs) == [2 << 20] * 6
            assert all(np.array_equal(a, b) for a, b in zip(objs, outs))
            node0 = c.lookup(keys[:1])[0].replicas[0].data_addr
            assert sum(1 for s in c.data.conns.all_streams() if s.sock.getpeername() and
                       f"{s.sock.getpeername()[1]}" == node0.rsplit(":", 1)[1]) >= 2
            c.remove_batch(keys)
        finally:
            c.drain("node-1", undo=True)


def test_miss_is_none_and_exists_false(client):
    assert client.get("never/stored") is None
    assert client.get_into("never/stored", bytearray(8)) is None
    assert client.exists_batch(["never/stored"]) == [False]
    with pytest.raises(E.NotFound):
        client.remove("never/stored")


def test_existing_key_put_is_noop(client):
    client.put("same/key", b"first")
    client.put("same/key", b"second-different")  # content-addressed: first write wins, no error
    assert client.get("same/key") == b"first"


def test_two_clients_same_keys_concurrently(cluster):
    keys = [f"conc/{i}" for i in range(40)]
    payload = {k: os.urandom(64 << 10) for k in keys}
    errors = []

    def worker():
        with cluster.client() as c:
            try:
                for k in keys:
                    c.put(k, payload[k])
                for k in keys:
                    got = c.get(k)
                    # another client may still be writing the same key ("in_flight"): then a
                    # miss is allowed, wrong bytes never are
                    assert got is None or got == payload[k]
            except Exception as e:  # noqa: BLE001 - surfaced below
                errors.append(e)

    ts = [threading.Thread(target=worker) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    with cluster.client() as c:
        assert all(c.get(k) == payload[k] for k in keys)


def test_batch_forms_report_per_key(client):
    keys = ["batch/a", "batch/b", "x" * 600]
    res = client.put_batch(keys, [b"aa", b"bbb", b"c"])
    assert res[0] is None and res[1] is None and isinstance(res[2], E.InvalidKey)
    got = client.get_batch(["batch/a", "batch/missing", "batch/b"])
    assert got == [b"aa", None, b"bbb"]


def test_a_batch_get_of_many_keys_reads_slice_by_slice_with_every_answer_per_key(client):
    """A batch past two lookup slices (PIPELINE_KEYS) reads each slice while the next is
    looked up: every key still gets its own answer (bytes, a miss, a layout error) and
    every lease taken is released."""
    import time

    import msgspec

    from kvpool.connector.client import PIPELINE_KEYS

    lay = LayoutSpec(kind="full_attention", tokens_per_block=16,
                     tensors=(TensorSpec("kv", (2, 16, 2, 32), "float32"),), num_kv_heads=2, head_size=32)
    other = msgspec.structs.replace(lay, sliding_window=64)
    n = 3 * PIPELINE_KEYS + 5
    keys = [f"slices/{i}" for i in range(n)]
    blocks = [torch.full((2, 16, 2, 32), float(i)) for i in range(n)]
    assert client.put_batch(keys, blocks, lay) == [None] * n
    assert client.put("slices/other", torch.zeros(2, 16, 2, 32), other)
    ask = keys[:70] + ["slices/missing"] + keys[70:140] + ["slices/other"] + keys[140:]
    outs = [torch.empty(2, 16, 2, 32) for _ in ask]
    res = client.get_into_batch(ask, outs, lay)
    assert res[70] is None and isinstance(res[141], E.LayoutMismatch)
    got = [o for i, o in enumerate(outs) if i not in (70, 141)]
    assert all(r == lay.nbytes for i, r in enumerate(res) if i not in (70, 141))
    assert all(torch.equal(o, b) for o, b in zip(got, blocks))
    assert [len(b) if b is not None else None for b in client.get_batch(ask)][69:72] == [lay.nbytes, None, lay.nbytes]
    deadline = time.monotonic() + 30
    while any(m.leased for m in client.ls("slices/")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(m.leased for m in client.ls("slices/"))


def test_a_read_failing_inside_the_next_lookup_leaves_no_lease_held(make_cluster):
    """A read of a pipelined batch that raises while the next slice is being looked up
    propagates, and the leases of both slices are let go: released, not left to lapse
    (the leases here last far longer than the wait)."""
    import time

    from kvpool.connector.client import PIPELINE_KEYS

    keys = [f"slicefail/{i}" for i in range(3 * PIPELINE_KEYS)]
    bad = keys[PIPELINE_KEYS + 3]  # in the second slice: read while the third is looked up

    def hook(key):
        if key == bad:
            raise RuntimeError("injected read failure")

    cluster = make_cluster(nodes=1, memory="64MiB", lease_ttl="300s")
    with cluster.client() as w:
        assert w.put_batch(keys, [bytes([i % 251]) * 4096 for i in range(len(keys))]) == [None] * len(keys)
    with cluster.client(read_hook=hook) as c:
        with pytest.raises(RuntimeError, match="injected"):
            c.get_into_batch(keys, [bytearray(4096) for _ in keys])
        deadline = time.monotonic() + 30
        while any(m.leased for m in c.ls("slicefail/")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(m.leased for m in c.ls("slicefail/"))


def test_tensor_put_and_get_into(client):
    t = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    client.put("tensor/a", t)
    out = torch.empty_like(t)
    assert client.get_into("tensor/a", out) == t.numel() * 4
    assert torch.equal(out, t)
    bf = torch.randn(128, dtype=torch.bfloat16)
    client.put("tensor/bf16", bf)
    out = torch.empty_like(bf)
    client.get_into("tensor/bf16", out)
    assert torch.equal(out, bf)
    arr = np.arange(1000, dtype=np.int64)
    client.put("numpy/a", arr)
    out = np.zeros_like(arr)
    client.get_into("numpy/a", out)
    assert np.array_equal(out, arr)
    with pytest.raises(E.InvalidRequest, match="contiguous"):
        client.put("tensor/nc", t.t())
    with pytest.raises(E.InvalidRequest, match="holds"):
        client.get_into("tensor/a", torch.empty(10))


def test_group_blocks_and_layout_mismatch(client):
    lay = LayoutSpec(kind="full_attention", tokens_per_block=16,
                     tensors=(TensorSpec("kv", (2, 2, 4, 16, 32), "float32"),), num_kv_heads=4, head_size=32)
    store = BlockStore(client, model="tiny", group_id=0, layout=lay, namespace="t")
    toks = list(range(16 * 5 + 3))
    hashes = block_hashes(toks, 16)
    blocks = [torch.full((2, 2, 4, 16, 32), float(i)) for i in range(len(hashes))]
    assert store.lookup_prefix(hashes) == 0
    assert store.put_blocks(hashes[:3], blocks[:3]) == [None] * 3
    assert store.lookup_prefix(hashes) == 3
    outs = [torch.empty(2, 2, 4, 16, 32) for _ in range(3)]
    assert store.get_blocks(hashes[:3], outs) == [lay.nbytes] * 3
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    # the same bytes read through a different layout: typed error, no reinterpretation
    other = LayoutSpec(kind="full_attention", tokens_per_block=16,
                       tensors=(TensorSpec("kv", (2, 2, 4, 16, 32), "float32"),), num_kv_heads=4, head_size=32,
                       sliding_window=128)
    key = store.keys(hashes[:1])[0]
    with pytest.raises(E.LayoutMismatch, match="sliding_window"):
        client.get_into(key, torch.empty(2, 2, 4, 16, 32), other)
    # the wrong byte count for a layout is rejected at put time
    res = store.put_blocks(hashes[3:4], [torch.zeros(10)])
    assert isinstance(res[0], E.LayoutMismatch)


@pytest.mark.parametrize("reserve", [0, 64 << 20], ids=["put_start", "reserved"])
@pytest.mark.parametrize("size", [1 << 20, 4 << 20, (6 << 20) + 123])
def test_checksums_hashed_beside_the_copy_match_the_bytes_and_catch_corruption(make_cluster, size, reserve):
    """Same host: objects up to 4 MiB are hashed while put_start is in flight, or through a
    reservation while the node answers its claim (as for this first put; a put into an
    extent claimed ahead hashes as it copies), and copied without a hash; bigger ones are
    hashed on the helper thread beside their copy (with the native copy module, as they are
    copied, without the GIL). Either way the master's checksum is the
    xxh3_64 of the bytes, the bytes come back whole, and a byte flipped in the segment
    afterwards is caught (ChecksumMismatch; the replica is dropped, so the key then misses)."""
    lc = make_cluster(nodes=1)
    with lc.client(lease_retries=0, reserve_bytes=reserve) as c:
        data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        key = f"aside/{size}"
        assert c.put(key, data) is True
        # the helper hashed the put (the native copy hashes as it copies, without the GIL)
        assert (c.data.shm._hasher is not None) == (size > 4 << 20 and not copyhash.NATIVE)
        info = c.lookup([key])[0]
        assert info.checksum == xxhash.xxh3_64_intdigest(data)
        out = np.zeros(size, dtype=np.uint8)
        assert c.get_into(key, out) == size and np.array_equal(out, data)
        ref = info.replicas[0]
        seg = c.data.segmaps.segment(ref)
        seg[ref.offset + size - 1] = (seg[ref.offset + size - 1] + 1) % 256
        with pytest.raises(E.ChecksumMismatch):
            c.get_into(key, out)
        assert c.get_into(key, out) is None


def test_a_corrupt_only_replica_is_reported_as_corrupt_after_the_retry(make_cluster):
    """The reader reports a corrupt replica and retries with a fresh lookup; the master
    dropped the only replica, so the retry finds the key gone. The caller still gets the
    cause (ChecksumMismatch), not a miss; the next get is a plain miss."""
    lc = make_cluster(nodes=1)
    with lc.client() as c:
        assert c.lease_retries >= 1
        data = np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8)
        assert c.put("corrupt/a", data) is True
        ref = c.lookup(["corrupt/a"])[0].replicas[0]
        seg = c.data.segmaps.segment(ref)
        seg[ref.offset + 100] = (seg[ref.offset + 100] + 1) % 256
        out = np.zeros(data.size, dtype=np.uint8)
        res = c.get_into_batch(["corrupt/a"], [out])
        assert isinstance(res[0], E.ChecksumMismatch), res
        assert c.get_into_batch(["corrupt/a"], [out]) == [None]


def test_prehash_stops_when_the_answer_is_in():
    """The put_start wait hashes host buffers of at most 4 MiB in order and stops at the
    first look at the socket that finds the answer (it looks every 256 KiB hashed);
    bigger buffers and device buffers are left to the write."""
    from kvpool.connector.prehash import PREHASH_POLL, prehash

    small = [memoryview(bytes([i]) * (100 << 10)) for i in range(5)]  # 3 fit before the first look
    big = memoryview(bytes(5 << 20))
    bufs = [small[0], big, object(), *small[1:]]
    sums = [None] * len(bufs)
    looks = []
    prehash(bufs, sums, range(len(bufs)), lambda: looks.append(1) or True)
    hashed = [j for j, s in enumerate(sums) if s is not None]
    assert hashed == [0, 3, 4] and len(looks) == 1 and 3 * (100 << 10) >= PREHASH_POLL
    assert sums[3] == xxhash.xxh3_64_intdigest(small[1])
    sums = [None] * len(bufs)
    prehash(bufs, sums, range(len(bufs)), lambda: False)
    assert [j for j, s in enumerate(sums) if s is not None] == [0, 3, 4, 5, 6]
    sums = {}
    prehash(bufs, sums, [6, 0, 1])  # the reserved put's form: chosen positions, no answer to look for
    assert list(sums) == [6, 0]


def test_work_beside_a_master_call_runs_once_and_keeps_its_own_errors(client):
    """``MasterRPC.call(meanwhile=...)`` runs the work once after the send and returns the
    reply; the work may send one-way messages but not call (RuntimeError); an error of the
    work propagates as is (not taken for a broken connection and the request resent), and
    the reply it left unread does not confuse the next call."""
    from kvpool.protocol import messages as M

    runs, nested = [], []

    def work(answered):
        runs.append(answered() in (True, False))
        try:
            client.rpc.call(M.Exists(["beside/x"]))
        except RuntimeError as e:
            nested.append(str(e))
        client.rpc.send_nowait(M.ReleaseLeases(["beside/x"]))

    assert client.rpc.call(M.Exists(["beside/x"]), meanwhile=work) == [False]
    assert runs == [True] and len(nested) == 1 and "meanwhile" in nested[0]

    def boom(answered):
        runs.append("boom")
        raise E.InvalidRequest("the work's own error")

    with pytest.raises(E.InvalidRequest, match="own error"):
        client.rpc.call(M.Exists(["beside/x"]), meanwhile=boom)
    assert runs[-1] == "boom" and runs.count("boom") == 1
    client.put("beside/y", b"y")
    assert client.rpc.call(M.Exists(["beside/y"])) == [True]


def test_a_big_put_after_close_hashes_inline(cluster):
    """close() shuts the put-hashing helper thread down (so does interpreter exit, for the
    threads still running then): a later big put hashes as it copies instead of failing
    with the executor's untyped RuntimeError."""
    data = np.random.default_rng(5).integers(0, 256, (6 << 20) + 1, dtype=np.uint8)
    c = cluster.client()
    assert c.put("inline/a", data) is True and (c.data.shm._hasher is not None or copyhash.NATIVE)
    c.close()
    assert c.put("inline/b", data) is True
    assert c.lookup(["inline/b"])[0].checksum == xxhash.xxh3_64_intdigest(data)
    c.remove_batch(["inline/a", "inline/b"])
    c.close()


def test_reply_ready_on_a_closed_connection_says_read_it():
    """BlockingFrames.ready() on a socket closed meanwhile answers True (the read that
    follows raises the connection error the caller handles), not an untyped OSError."""
    import socket

    from kvpool.protocol.rpcwire import BlockingFrames

    a, b = socket.socketpair()
    frames = BlockingFrames(a)
    assert frames.ready() is False
    b.sendall(b"x")
    assert frames.ready() is True
    a.close()
    assert frames.ready() is True
    b.close()
