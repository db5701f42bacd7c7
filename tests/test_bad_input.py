"""Bad input gets a typed error and loses nothing (real cluster, real sockets)."""
import os
import socket
import struct

import msgspec
import pytest

from kvpool.connector.dataclient import DataPlane, WriteOp
from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from kvpool.protocol import rpcwire
from kvpool.protocol.dataplane import DataReply, DataRequest, frame, recv_reply
from tests.conftest import wait_for


_DEEP = b"\x91" * 60000 + b"\xc0"  # a 60,000-level nested array: under the frame limits, past msgspec's stack


def test_bad_keys(client):
    with pytest.raises(E.InvalidKey, match="513 bytes"):
        client.put("k" * 513, b"x")
    with pytest.raises(E.InvalidKey, match="UTF-8"):
        client.put(b"\xff\xfe", b"x")
    with pytest.raises(E.InvalidKey, match="empty"):
        client.get("")


def test_object_larger_than_any_node(client):
    big = bytearray(300 << 20)  # nodes have 256 MiB segments
    with pytest.raises(E.ObjectTooLarge, match="largest store node segment"):
        client.put("too/big", big)
    assert client.exists_batch(["too/big"]) == [False]
    st = client.stats()
    assert st.pending == 0


def test_malformed_rpc_frames_get_errors_and_master_survives(cluster, client):
    host, port = cluster.master_addr[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        frames = rpcwire.BlockingFrames(s)
        deep = msgspec.msgpack.encode({"type": "exists", "keys": ["a"], "zzz": None})[:-1] + _DEEP
        for i, body in enumerate((b"", b"\xc1\xc1\xc1", msgspec.msgpack.encode({"type": "lookup"}),
                                  msgspec.msgpack.encode({"type": "nope", "keys": []}),
                                  msgspec.msgpack.encode({"type": "lookup", "keys": [1, 2]}), deep), start=7):
            s.sendall(rpcwire.pack(i, body))
            rid, reply = frames.read()
            rep = msgspec.msgpack.decode(reply, type=M.Reply)
            assert rid == i and rep.error is not None and rep.error.code == "invalid_request"
        # a one-way garbage frame gets no reply; the next request's reply comes next
        s.sendall(rpcwire.pack(rpcwire.ONE_WAY, b"\xc1") + rpcwire.pack(99, M.encode(M.Exists(["x"]))))
        rid, reply = frames.read()
        assert rid == 99 and msgspec.msgpack.decode(reply, type=M.Reply).error is None
    # an impossible length: one error reply, then the master hangs up on that stream only
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(rpcwire.HEAD.pack(1 << 31, 5))
        rid, reply = rpcwire.BlockingFrames(s).read()
        rep = msgspec.msgpack.decode(reply, type=M.Reply)
        assert rid == 5 and rep.error.code == "invalid_request" and "outside" in rep.error.message
        assert s.recv(10) == b""
    client.put("after/garbage", b"ok")
    assert client.get("after/garbage") == b"ok"
    assert all(c.alive() for c in cluster.masters)


def test_rpc_pipelined_requests_answered_in_order_and_hangups_are_harmless(cluster, client):
    """Many requests in one send come back in order with their ids; a client that hangs up
    with requests and replies in flight costs the master nothing."""
    host, port = cluster.master_addr[len("tcp://"):].rsplit(":", 1)
    client.put("pipe/x", b"x")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"".join(rpcwire.pack(1000 + i, M.encode(M.Exists(["pipe/x", f"pipe/none{i}"])))
                           for i in range(200)))
        frames = rpcwire.BlockingFrames(s)
        for i in range(200):
            rid, reply = frames.read()
            assert rid == 1000 + i
            assert msgspec.msgpack.decode(msgspec.msgpack.decode(reply, type=M.Reply).result) == [True, False]
    for _ in range(20):  # hang up mid-request and with unread replies
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(rpcwire.pack(1, M.encode(M.Stats())) * 50 + rpcwire.HEAD.pack(100, 2) + b"partial")
    assert client.get("pipe/x") == b"x"
    assert all(c.alive() for c in cluster.masters)


def test_a_client_that_never_reads_replies_does_not_stall_the_others(cluster, client):
    """3000 listings of 3000 keys owe ~500 MB of replies and seconds of work: the master
    answers the flooder 64 requests per turn, stops reading it at 16 MiB of unsent replies,
    and keeps answering everyone else within their deadline."""
    client.put_batch([f"flood/{i}" for i in range(3000)], [b"v"] * 3000)
    host, port = cluster.master_addr[len("tcp://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(rpcwire.pack(1, M.encode(M.ListObjects("", 10000))) * 3000)
        for _ in range(30):
            assert client.rpc.call(M.Exists(["flood/7"]), timeout_s=5) == [True]  # Timeout if starved
    assert client.get("flood/7") == b"v"


def test_malformed_and_truncated_data_frames(cluster, client):
    client.put("data/keep", b"precious")
    node = client.lookup(["data/keep"])[0].replicas[0]
    host, port = node.data_addr[len("tcp://"):].rsplit(":", 1)
    # garbage header
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
        rep = recv_reply(s)
        assert not rep.ok and rep.error.code == "invalid_request"
    # an unknown trailing field nested deeper than the decoder's stack: refused, typed
    with socket.create_connection((host, int(port)), timeout=5) as s:
        d = msgspec.msgpack.encode(DataRequest("ping", ""))
        body = bytes([d[0] + 1]) + d[1:] + _DEEP  # one more array element than the request has fields
        s.sendall(struct.pack("<I", len(body)) + body)
        rep = recv_reply(s)
        assert not rep.ok and rep.error.code == "invalid_request" and "malformed" in rep.error.message
    # oversized header length: refused
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(struct.pack("<I", 1 << 30))
        rep = recv_reply(s)
        assert not rep.ok and "exceeds" in rep.error.message
    # write outside the segment and with a stale generation: typed errors
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(frame(DataRequest("write", node.incarnation, (1 << 40), 4, 1, "x")) + b"abcd")
        rep = recv_reply(s)
        assert not rep.ok and rep.error.code == "invalid_request"
        s.sendall(frame(DataRequest("read", node.incarnation, node.offset, node.size, node.gen + 99)))
        rep = recv_reply(s)
        assert not rep.ok and rep.error.code == "stale_extent"
        s.sendall(frame(DataRequest("read", "not-this-node", node.offset, node.size, node.gen)))
        assert recv_reply(s).error.code == "stale_extent"
    # truncated payload then hang-up: the node drops the connection, nothing else breaks
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(frame(DataRequest("write", node.incarnation, 0, 1 << 20, 1, "trunc")) + b"short")
    assert client.get("data/keep") == b"precious"


def test_store_node_dies_mid_write(make_cluster):
    lc = make_cluster(nodes=1, memory="64MiB", put_timeout="2s", quarantine="1s")
    with lc.client(transport="tcp") as c:
        grant = c.rpc.call(M.PutStart([M.PutItem("doomed", 8 << 20, 0)], c.host_id, 1))[0]
        ref = grant.replicas[0]
        # start the write by hand, send half the payload, then the node is SIGKILLed
        dp = DataPlane(c.host_id, "tcp", 5.0)
        lc.kill_node("node-0")
        op = WriteOp(ref, memoryview(bytearray(8 << 20)), "doomed", 0, None)
        dp.write([op])
        assert isinstance(op.error, E.NodeUnavailable)
        dp.close()
        # through the public API the put fails cleanly with the typed error
        with pytest.raises((E.NodeUnavailable, E.NoSpace)):
            c.put("doomed2", os.urandom(1 << 20))
        # the master drops the dead node and its pending extent
        from tests.conftest import wait_for
        wait_for(lambda: c.stats().nodes == [] and c.stats().pending == 0, 15, what="dead node dropped")
        # a new node joins; the key can be written again
        lc.start_node("node-1", "64MiB")
        lc.wait_nodes(1)
        c.put("doomed", os.urandom(1 << 20))
        assert c.exists_batch(["doomed"]) == [True]


def test_data_reply_decoder_rejects_garbage():
    class Fake:
        def __init__(self, data):
            self.data, self.pos = data, 0

        def recv_into(self, view, n):
            chunk = self.data[self.pos:self.pos + n]
            view[:len(chunk)] = chunk
            self.pos += len(chunk)
            return len(chunk)

    with pytest.raises(E.InvalidRequest):
        recv_reply(Fake(struct.pack("<I", 3) + b"\xc1\xc1\xc1"))
    with pytest.raises(E.NodeUnavailable):
        recv_reply(Fake(struct.pack("<I", 10) + b"abc"))  # truncated
    assert recv_reply(Fake(frame(DataReply(True, size=3)))).size == 3


def test_committed_but_never_written_key_heals(client):
    # a buggy client commits without writing the bytes
    g = client.rpc.call(M.PutStart([M.PutItem("poison/a", 4096, 12345)], client.host_id, 1))[0]
    assert client.rpc.call(M.PutEnd(["poison/a"], [g.put_id])) == [None]
    try:  # never the wrong bytes: an error, or a clean miss once the retry sees the healed index
        assert client.get("poison/a") is None
    except (E.StaleExtent, E.ChecksumMismatch):
        pass
    # the reader reported the bad replica; the master dropped it, so the key can be stored again
    from tests.conftest import wait_for
    wait_for(lambda: client.exists_batch(["poison/a"]) == [False], 5, what="bad replica dropped")
    assert client.put("poison/a", b"z" * 4096) is True
    assert client.get("poison/a") == b"z" * 4096


def test_put_rejects_bad_data_types_per_key(client):
    res = client.put_batch(["types/ok", "types/str", "types/none"], [b"fine", "text", None])
    assert res[0] is None and isinstance(res[1], E.InvalidRequest) and isinstance(res[2], E.InvalidRequest)
    assert client.get("types/ok") == b"fine"
    with pytest.raises(E.InvalidRequest, match="replicas"):
        client.put("types/r", b"x", replicas=-1)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: nested and sparse CSR tensors are prototypes
def test_buffers_that_cannot_be_stored_are_typed_errors_and_store_nothing(client):
    """Non-contiguous arrays, tensors and memoryviews, object arrays (pointers, not bytes),
    non-buffers and read-only outputs are InvalidRequest; nothing is stored for them. Any
    C-contiguous array of a plain dtype round-trips as its bytes."""
    import numpy as np
    import torch

    released = memoryview(bytearray(8))
    released.release()
    bad = {"strided-np": np.zeros((4, 4))[:, ::2], "object-np": np.array([object(), 1], dtype=object),
           "strided-torch": torch.zeros(4, 4).t(), "strided-mv": memoryview(bytearray(16))[::2], "int": 12345,
           "released-mv": released, "conj": torch.randn(4, dtype=torch.complex64).conj(),
           "neg": torch._neg_view(torch.randn(4)), "csr": torch.eye(3).to_sparse_csr(),
           "nested": torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)]),
           "meta": torch.empty(4, device="meta"), "masked": np.ma.masked_array([1, 2, 3], mask=[0, 1, 0])}
    for name, x in bad.items():
        res = client.put_batch([f"badbuf/{name}", f"badbuf/next-to-{name}"], [x, b"fine"])
        assert isinstance(res[0], E.InvalidRequest) and res[1] is None, (name, res)  # the bad one alone fails
        assert client.exists(f"badbuf/{name}") is False
    good = bytearray(8)
    client.put("badbuf/eight", b"12345678")
    res = client.get_into_batch(["badbuf/eight", "badbuf/eight"], [torch.zeros(1, dtype=torch.complex64).conj(), good])
    assert isinstance(res[0], E.InvalidRequest) and res[1] == 8 and good == b"12345678"
    client.put("badbuf/ok", b"12345678")
    with pytest.raises(E.InvalidRequest, match="read-only"):
        client.get_into("badbuf/ok", b"\0" * 8)
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(E.InvalidRequest, match="read-only"):
        client.get_into("badbuf/ok", ro)
    assert int(ro.sum()) == 0
    for i, x in enumerate([np.arange(12, dtype=np.float16).reshape(3, 4), np.array(["2020-01-01"], "datetime64[D]"),
                           np.array([(1, 2.5), (3, 4.5)], dtype=[("a", "i4"), ("b", "f8")]), np.zeros((0, 3)),
                           np.zeros(0, "(2,3)f4")]):
        client.put(f"badbuf/good{i}", x)
        back = np.empty_like(x)
        assert client.get_into(f"badbuf/good{i}", back) == x.nbytes and back.tobytes() == x.tobytes()


def test_a_second_store_node_under_a_live_nodes_name_stops_and_takes_nothing(make_cluster):
    """The name of a live store node cannot be taken over: a second process started under
    it waits for the name's lease to lapse (a crashed previous run's would), then stops
    with a config error; the first node keeps serving and keeps its data."""
    from kvpool.cli.cluster import Child, kvpool_argv

    lc = make_cluster(nodes=1, memory="64MiB", node_ttl="1s")
    with lc.client() as c:
        c.put("dup/k", b"v" * 1000)
        inc = c.stats().nodes[0].incarnation
        dup = Child("dup", kvpool_argv("storenode", *lc._common(), "--name", "node-0", "--memory", "64MiB",
                                       "--node-ttl", "1s"), lc.run_dir)
        assert dup.proc.wait(15) == 2
        log = open(dup.log_path).read() + "\n".join(dup.lines)
        assert "waiting up to" in log and "is held by a live node" in log and "another --name" in log
        st = c.stats()
        assert [(n.node_id, n.incarnation) for n in st.nodes] == [("node-0", inc)]
        assert c.get("dup/k") == b"v" * 1000


def test_a_restarted_store_node_takes_its_name_back_once_the_old_lease_lapses(make_cluster):
    lc = make_cluster(nodes=1, memory="64MiB", node_ttl="1s")
    with lc.client() as c:
        old = c.stats().nodes[0].incarnation
        lc.kill_node("node-0")  # SIGKILL: its registration stays until the lease lapses
        lc.start_node("node-0", "64MiB")  # READY once it holds the name
        wait_for(lambda: [n.incarnation for n in c.stats().nodes] not in ([], [old]), 10,
                 what="the master to see the new incarnation")
        c.put("restart/k", b"x")
        assert c.lookup(["restart/k"])[0].replicas[0].node_id == "node-0"
