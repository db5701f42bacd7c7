"""One conformance suite run against every data-plane transport (tcp, unix, ucx), in the
manner of dask's ``distributed/comm/tests/test_comms.py``: raw stream semantics (partial
reads, scatter/gather sends, EOF) and the whole data plane (a DataServer over a real
segment, the client's pipelined reads and writes) over each scheme. ucx needs the
``[ucx]`` extra and is skipped cleanly without it."""
import os
import threading

import msgspec
import pytest
import xxhash

from kvpool.connector.dataclient import DataPlane, ReadOp, WriteOp, sendv
from kvpool.protocol import errors as E
from kvpool.protocol import transport
from kvpool.protocol.grants import grant_token
from kvpool.protocol.messages import ExtentRef
from kvpool.storenode.dataserver import DataServer
from kvpool.storenode.device_segment import STAGE_BYTES, DeviceSegment
from kvpool.storenode.extents import ExtentTable
from kvpool.storenode.segment import Segment


def _has_ucx() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no usable extra
        return False
    return True


SCHEMES = ["tcp", "unix",
           pytest.param("ucx", marks=[pytest.mark.ucx,
                                      pytest.mark.skipif(not _has_ucx(), reason="needs the [ucx] extra (ucxx)")])]


def _addr(scheme: str, tmp_path) -> str:
    return {"tcp": "tcp://127.0.0.1:0", "unix": f"unix://{tmp_path}/t.sock", "ucx": "ucx://127.0.0.1:0"}[scheme]


def _bound(addr: str, lst) -> str:
    if hasattr(lst, "bound_addr"):
        return lst.bound_addr
    if addr.startswith("tcp://"):
        return "tcp://%s:%d" % lst.getsockname()[:2]
    return addr


def _recv_exact(s, n: int) -> bytes:
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = s.recv_into(view[pos:], n - pos)
        assert got > 0, "unexpected EOF"
        pos += got
    return bytes(buf)


@pytest.fixture(params=SCHEMES)
def echo(request, tmp_path):
    """An echo server on the scheme: yields (address, list of bytes counts it saw per conn)."""
    addr = _addr(request.param, tmp_path)
    lst = transport.listen(addr)
    seen: list[int] = []

    def serve():
        try:
            conn, _ = lst.accept()
        except OSError:
            return
        buf = memoryview(bytearray(1 << 16))
        total = 0
        try:
            while True:
                n = conn.recv_into(buf, len(buf))
                if n == 0:
                    break
                total += n
                conn.sendall(buf[:n])
        except OSError:
            pass
        finally:
            seen.append(total)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield _bound(addr, lst), seen
    lst.close()
    t.join(5)


def test_stream_round_trip_partial_reads_and_eof(echo):
    addr, seen = echo
    s = transport.connect(addr, 10.0)
    s.settimeout(30)
    sent = 0
    for size in (1, 4096, 1 << 20, 5 << 20):
        data = os.urandom(size)
        s.sendall(data)
        sent += size
        assert _recv_exact(s, size) == data
    # scatter/gather: header + payload + trailer in one call, read back in small pieces
    parts = [b"head", memoryview(os.urandom(300_000)), b"tail"]
    sendv(s, parts)
    want = b"".join(bytes(p) for p in parts)
    sent += len(want)
    got = bytearray()
    piece = memoryview(bytearray(7000))
    while len(got) < len(want):
        n = s.recv_into(piece, len(piece))
        assert 0 < n <= len(piece)
        got += piece[:n]
    assert bytes(got) == want
    s.close()
    for _ in range(100):  # the server sees EOF and every byte
        if seen:
            break
        threading.Event().wait(0.05)
    assert seen == [sent]


def test_connect_to_nothing_is_node_unavailable(tmp_path):
    with pytest.raises(E.NodeUnavailable):
        transport.connect(f"unix://{tmp_path}/nobody.sock", 1.0)
    with pytest.raises(E.ConfigError, match="unknown transport"):
        transport.connect("carrier-pigeon://x", 1.0)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(params=["shm", "cpu", pytest.param("cuda:0", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _has_cuda(), reason="no CUDA device on this machine")])])
def segment(request):
    """A real 16 MiB segment: host shared memory, or a DeviceSegment (torch memory served
    through staging) on cpu (the same code as cuda:N, pageable staging) or on a GPU."""
    seg = (Segment(16 << 20, name="kvpool-test-transport") if request.param == "shm"
           else DeviceSegment(16 << 20, request.param))
    yield seg
    seg.close()


@pytest.fixture(params=SCHEMES)
def data_node(request, tmp_path, segment):
    """A DataServer over ``segment``, listening on the scheme."""
    seg = segment
    table = ExtentTable(seg.capacity)
    srv = DataServer(seg, table, [_addr(request.param, tmp_path)])
    srv.start()
    yield seg, table, srv.addrs[0]
    srv.stop()


def _ref(seg: Segment, addr: str, offset: int, size: int, gen: int, key: str = "") -> ExtentRef:
    """A grant of ``key`` (tokens name the object) for ``[offset, +size)`` at ``gen``."""
    return ExtentRef("n0", seg.incarnation, addr, "", "other-host", offset, size, gen,
                     grant_token(seg.grant_key, seg.incarnation, offset, size, gen, key))


def test_data_plane_over_transport(data_node):
    seg, table, addr = data_node
    dp = DataPlane("this-host", "tcp", 10.0)  # "tcp" mode: always the node's data address
    try:
        sizes = [1, 100, 64 << 10, 1 << 20, 3 << 20, STAGE_BYTES + 12345]  # the last: two staged pieces
        payloads = [os.urandom(n) for n in sizes]
        refs, off = [], 0
        for i, n in enumerate(sizes):
            refs.append(_ref(seg, addr, off, n, i + 1, f"k{i}"))
            off += (n + 63) // 64 * 64
        ops = [WriteOp(r, memoryview(p), f"k{i}", xxhash.xxh3_64_intdigest(p), None)
               for i, (r, p) in enumerate(zip(refs, payloads))]
        dp.write(ops)  # one pipelined stream: every header and payload with sendmsg
        assert [op.error for op in ops] == [None] * len(ops)
        assert seg.read(refs[3].offset, sizes[3]) == payloads[3]
        outs = [bytearray(n) for n in sizes]
        reads = [ReadOp(r, memoryview(o), digest=True) for r, o in zip(refs, outs)]
        dp.read(reads)
        assert [r.error for r in reads] == [None] * len(reads)
        assert [bytes(o) for o in outs] == payloads
        assert [r.digest for r in reads] == [xxhash.xxh3_64_intdigest(p) for p in payloads]
        # a stale generation is refused per op, and the stream stays usable
        stale = ReadOp(_ref(seg, addr, refs[0].offset, sizes[0], 99), memoryview(bytearray(1)))
        ok = ReadOp(refs[1], memoryview(bytearray(sizes[1])))
        dp.read([stale, ok])
        assert isinstance(stale.error, E.StaleExtent) and ok.error is None
        # a write without a valid grant is refused and its payload skipped; so is a grant
        # used for another key than the one it was made for
        bad = WriteOp(msgspec.structs.replace(refs[0], token=b"x" * 16), memoryview(payloads[0]), "k0", 0, None)
        other = WriteOp(refs[1], memoryview(payloads[1]), "not-k1", 0, None)
        good = WriteOp(refs[2], memoryview(payloads[2]), "k2", 0, None)
        dp.write([bad, other, good])
        assert isinstance(bad.error, E.InvalidRequest) and isinstance(other.error, E.InvalidRequest)
        assert good.error is None
    finally:
        dp.close()


def test_commit_copy_is_one_way_and_refused_without_grant_or_after_free(data_node):
    """The writer's ``commit`` frame has no reply (the stream stays in step); it marks the
    row committed only with the extent's grant, and never for a generation already freed."""
    from kvpool.protocol.dataplane import DataRequest, frame

    seg, table, addr = data_node
    dp = DataPlane("this-host", "tcp", 10.0)
    try:
        payload = os.urandom(4096)
        ref = _ref(seg, addr, 0, 4096, 5, "c/k")
        w = WriteOp(ref, memoryview(payload), "c/k", xxhash.xxh3_64_intdigest(payload), None)
        dp.write([w])
        assert w.error is None and table.committed() == []

        def commit(r, token=None, key="c/k"):
            s = dp.conns.stream(addr)
            s.sock.sendall(frame(DataRequest("commit", r.incarnation, r.offset, r.size, r.gen, key,
                                             w.checksum, None, r.token if token is None else token, replicas=2)))

        def in_step():  # a read after the commits: its reply is the first one (commits send none)
            probe = ReadOp(ref, memoryview(bytearray(4096)))
            dp.read([probe])
            assert probe.error is None and bytes(probe.out) == payload

        commit(ref, token=b"forged" * 3)
        commit(ref, key="victim")  # a real grant, but for another key
        in_step()
        assert table.committed() == []
        commit(ref)
        in_step()
        assert [(r.key, r.gen, r.committed, r.replicas) for r in table.committed()] == [("c/k", 5, True, 2)]
        table.free(0, 5)
        commit(ref)  # a late copy of the commit of a freed generation
        late = ReadOp(ref, memoryview(bytearray(4096)))
        dp.read([late])
        assert isinstance(late.error, E.StaleExtent) and table.committed() == []
    finally:
        dp.close()


def test_device_segment_is_not_mapped_and_serves_the_unix_socket(tmp_path):
    """Same host, transport auto: a device segment refuses ``map`` (typed error, no fd),
    so the client remembers it cannot map it and reads and writes through the node's Unix
    socket; a host segment on the same path is mapped."""
    seg = DeviceSegment(8 << 20, "cpu")
    table = ExtentTable(seg.capacity)
    srv = DataServer(seg, table, [f"unix://{tmp_path}/d.sock"])
    srv.start()
    dp = DataPlane("this-host", "auto", 10.0)
    try:
        payload = os.urandom(300 << 10)
        ref = ExtentRef("n0", seg.incarnation, "", srv.addrs[0], "this-host", 4096, len(payload), 1,
                        grant_token(seg.grant_key, seg.incarnation, 4096, len(payload), 1, "k"))
        assert dp.segmaps.uses_shm(ref) is False and dp.segmaps.maps[seg.incarnation] is None
        w = WriteOp(ref, memoryview(payload), "k", xxhash.xxh3_64_intdigest(payload), None)
        dp.write([w])
        assert w.error is None and seg.read(4096, len(payload)) == payload
        assert table.check_read(4096, len(payload), 1).key == "k"
        out = bytearray(len(payload))
        r = ReadOp(ref, memoryview(out), digest=True)
        dp.read([r])
        assert r.error is None and bytes(out) == payload and r.digest == xxhash.xxh3_64_intdigest(payload)
        assert set(dp.conns.thread_streams()) == {srv.addrs[0]}
    finally:
        dp.close()
        srv.stop()
        seg.close()


def test_device_that_is_not_here_is_a_config_error():
    import torch

    from kvpool.storenode.device_segment import check_device

    for bad in ("gpu0", "meta", "mps", "cpu:0", "CPU", "cuda:-1", "cuda:abc", "cuda:0 ", ""):
        with pytest.raises(E.ConfigError, match="accepted: cpu, cuda:N"):
            check_device(bad, 1 << 20)
    assert check_device("cpu", 1 << 40) == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(E.ConfigError, match="no CUDA device.*use --device cpu"):
            check_device("cuda:0", 1 << 20)
    else:
        assert check_device("cuda", 1 << 20) == "cuda:0"
        with pytest.raises(E.ConfigError, match="CUDA device"):
            check_device(f"cuda:{torch.cuda.device_count()}", 1 << 20)
        with pytest.raises(E.ConfigError, match="lower --memory"):
            check_device("cuda:0", 1 << 60)


def test_device_segment_staging_is_bounded_and_refuses_written(tmp_path):
    """Many connections share at most STAGE_BUFFERS staging buffers; a ``claim`` (a same-host
    client asking to copy into the mapping) is refused and a ``written`` notice records
    nothing, since nobody maps device memory."""
    from kvpool.storenode.device_segment import STAGE_BUFFERS

    seg = DeviceSegment(8 << 20, "cpu")
    table = ExtentTable(seg.capacity)
    srv = DataServer(seg, table, ["tcp://127.0.0.1:0"])
    srv.start()
    planes = [DataPlane("h", "tcp", 10.0) for _ in range(2 * STAGE_BUFFERS)]
    try:
        payload = os.urandom(4096)
        for i, dp in enumerate(planes):  # each plane: its own connection and server thread
            ref = _ref(seg, srv.addrs[0], i * 4096, 4096, i + 1, f"k{i}")
            w = WriteOp(ref, memoryview(payload), f"k{i}", 0, None)
            dp.write([w])
            assert w.error is None and seg.read(i * 4096, 4096) == payload
        assert seg._made == 1  # one at a time here: the first buffer was reused each time
        assert seg._free.qsize() == 1
        ref = _ref(seg, srv.addrs[0], 1 << 20, 4096, 99, "x")
        s = transport.connect(srv.addrs[0], 5.0)
        from kvpool.protocol.dataplane import DataRequest, frame, recv_reply
        s.sendall(frame(DataRequest("written", seg.incarnation, ref.offset, ref.size, ref.gen, "x", 0, None,
                                    ref.token)))  # one-way: no reply
        s.sendall(frame(DataRequest("claim", seg.incarnation, ref.offset, ref.size, ref.gen, "x", 0, None,
                                    ref.token)))
        rep = recv_reply(s)
        s.close()
        assert not rep.ok and "shared-memory segment" in rep.error.message
        with pytest.raises(E.StaleExtent):
            table.check_read(ref.offset, ref.size, ref.gen)
    finally:
        for dp in planes:
            dp.close()
        srv.stop()
        seg.close()


def test_missing_extra_is_a_clear_config_error(monkeypatch):
    """Without ucxx the ucx scheme fails with a ConfigError naming the extra to install."""
    import sys

    monkeypatch.setitem(sys.modules, "ucxx", None)
    monkeypatch.setitem(sys.modules, "ucxx._lib", None)
    monkeypatch.setitem(sys.modules, "ucxx._lib.libucxx", None)
    monkeypatch.delitem(sys.modules, "kvpool.protocol.ucx_transport", raising=False)
    monkeypatch.setattr(transport, "_CONNECT", {k: v for k, v in transport._CONNECT.items() if k != "ucx"})
    with pytest.raises(E.ConfigError, match=r"kvpool\[ucx\]"):
        transport.connect("ucx://127.0.0.1:1", 1.0)


@pytest.mark.parametrize("dst_offset", [0, 16, 48, 2048])
@pytest.mark.parametrize("size", [100, 4097, 64 << 10, 300 << 10, 1 << 20])
def test_shared_memory_copies_any_alignment(dst_offset, size):
    """The same-host copy paths, both ways (direct, bounced around 4K aliasing, chunked with
    a fused digest) land exactly the extent's bytes and the right xxh3, whatever the
    alignment."""
    import mmap

    seg_map = mmap.mmap(-1, 4 << 20)
    seg = memoryview(seg_map)
    payload = os.urandom(size)
    offset = 8192
    seg[offset:offset + size] = payload
    dp = DataPlane("h", "auto", 5.0)
    dp.segmaps.maps["inc"] = seg  # what mapping the node's memfd would give
    ref = ExtentRef("n0", "inc", "", "", "h", offset, size, 1)
    try:
        for digest in (False, True):
            host = bytearray(size + 8192)
            out = memoryview(host)[dst_offset:dst_offset + size]
            op = ReadOp(ref, out, digest=digest)
            dp.shm.copy_out(op)
            assert op.error is None and bytes(out) == payload
            assert op.digest == (xxhash.xxh3_64_intdigest(payload) if digest else None)
        src_host = bytearray(size + 8192)
        src = memoryview(src_host)[dst_offset:dst_offset + size]
        src[:] = payload[::-1]
        for digest in (False, True):
            seg[offset:offset + size] = bytes(size)
            got = dp.shm.copy_in(ref, seg[offset:offset + size], src, digest)
            assert bytes(seg[offset:offset + size]) == payload[::-1]
            assert got == (xxhash.xxh3_64_intdigest(payload[::-1]) if digest else None)
    finally:
        dp.segmaps.maps.clear()
        dp.segmaps._bases.clear()
        seg.release()
        seg_map.close()


@pytest.mark.ucx
@pytest.mark.skipif(not _has_ucx(), reason="needs the [ucx] extra (ucxx)")
def test_cluster_end_to_end_over_ucx(make_cluster):
    """A store node started with --ucx publishes a ucx:// address; a client with
    transport="ucx" puts and gets through it (the master hands the address out with every
    replica), and falls back to the node's other paths for nodes that serve no ucx."""
    import numpy as np

    lc = make_cluster(nodes=1, memory="64MiB")
    lc.start_node("ucx-node", "64MiB", ucx=True)
    lc.wait_nodes(2)
    rng = np.random.default_rng(7)
    with lc.client(transport="ucx") as c:
        c.drain("node-0")  # place only on the ucx node
        objs = {f"ucx/{n}": rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 65536, 4 << 20)}
        for k, v in objs.items():
            assert c.put(k, v) is True
        for k, v in objs.items():
            ref = c.lookup([k])[0].replicas[0]
            assert ref.node_id == "ucx-node" and ref.ucx_addr.startswith("ucx://")
            assert c.get(k) == v.tobytes()
        assert any(a.startswith("ucx://") for a in c.data.conns.thread_streams())
        c.drain("node-0", undo=True)
        c.drain("ucx-node")
        assert c.put("plain/1", b"no ucx here") is True  # node-0 serves no ucx: unix socket instead
        assert c.lookup(["plain/1"])[0].replicas[0].ucx_addr == ""
        assert c.get("plain/1") == b"no ucx here"
    with pytest.raises(E.ConfigError, match="accepted: auto, shm, unix, tcp, ucx"):
        lc.client(transport="rdma")


def test_window_pieces_split_extents_at_registration_windows():
    from kvpool.connector.device_buffer import PIN_WINDOW, window_pieces

    W = PIN_WINDOW
    assert window_pieces(0, W) == [(0, W)]
    assert window_pieces(10, 100) == [(0, 100)]
    assert window_pieces(W - 10, 30) == [(0, 10), (10, 30)]
    assert window_pieces(W - 10, 2 * W + 20) == [(0, 10), (10, W + 10), (W + 10, 2 * W + 10), (2 * W + 10, 2 * W + 20)]
    assert window_pieces(5, 0) == [(0, 0)]


@pytest.fixture
def host_direct(tmp_path, monkeypatch):
    """A shared-memory DataServer and a same-host DataPlane whose direct (DMA) path takes
    host tensors: registration is replaced by a hold on the mapping (as ``CudaDirect.direct`` takes),
    windows are 64 KiB, and stream sync fails on demand. The copies are torch ``copy_``
    as on a GPU; only registration and stream sync are CUDA's parts.
    Yields (segment, data plane, make_ref(offset, size, gen, key), state)."""
    from kvpool.connector import device_buffer as db

    monkeypatch.setattr(db, "PIN_WINDOW", 64 << 10)
    state = {"fail_sync": False, "pieces": [], "before_dma": None, "on_sync": None}
    real_pieces = db.window_pieces
    monkeypatch.setattr(db, "window_pieces", lambda o, n: state["pieces"].append(real_pieces(o, n)) or state["pieces"][-1])

    def sync(self):
        if state["fail_sync"]:
            raise RuntimeError("CUDA error: invalid argument")
        if state["on_sync"]:
            state["on_sync"]()

    monkeypatch.setattr(db.DeviceBuffer, "sync", sync)
    seg = Segment(8 << 20, name="kvpool-test-direct")
    table = ExtentTable(seg.capacity)
    srv = DataServer(seg, table, [f"unix://{tmp_path}/d.sock"])
    srv.start()
    dp = DataPlane("this-host", "auto", 10.0)
    dp.cuda.pins = db.PinnedWindows()

    def direct(ref, buf):
        if ref.incarnation in dp.cuda.pins._refused or dp.segmaps.segment(ref) is None:
            return False
        with dp.segmaps.lock:
            dp.cuda.pins.acquire(ref.incarnation)
        if state["before_dma"]:
            state["before_dma"](ref)
        return True

    monkeypatch.setattr(dp.cuda, "direct", direct)

    def make_ref(offset, size, gen, key):
        return ExtentRef("n0", seg.incarnation, "", srv.addrs[0], "this-host", offset, size, gen,
                         grant_token(seg.grant_key, seg.incarnation, offset, size, gen, key))

    yield seg, dp, make_ref, state
    dp.close()
    srv.stop()
    seg.close()


def _dev(data: bytes | int):
    import torch

    from kvpool.connector.device_buffer import DeviceBuffer

    t = torch.zeros(data, dtype=torch.uint8) if isinstance(data, int) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return DeviceBuffer(t)


def test_direct_transfer_bookkeeping_and_fallback_with_host_tensors(host_direct):
    """An extent crossing registration windows is copied piece by piece; a put's checksum
    is hashed from the segment, a get's from the segment once the DMA is known done;
    every hold on the mapping is given back. When a copy fails, the mapping is
    staged from then on and the bytes still arrive, with the right checksum."""
    seg, dp, make_ref, state = host_direct
    pieces = state["pieces"]
    payload = os.urandom(200 << 10)
    ref = make_ref((64 << 10) - 4096, len(payload), 1, "k")  # crosses four window edges
    w = WriteOp(ref, _dev(payload), "k", None, None)
    dp.write([w])
    assert w.error is None and seg.read(ref.offset, len(payload)) == payload
    assert w.checksum == xxhash.xxh3_64_intdigest(payload)
    assert pieces[-1] == [(0, 4096), (4096, 69632), (69632, 135168), (135168, 200704), (200704, len(payload))]
    out = _dev(len(payload) + 10)
    r = ReadOp(ref, out, digest=True)
    dp.read([r])
    assert r.error is None and r.digest == xxhash.xxh3_64_intdigest(payload)
    assert bytes(out.flat[:len(payload)].numpy()) == payload and out._host is None  # no staging
    assert dp.cuda.pins._busy == {}
    # a failing copy: the same bytes arrive through pinned (here: host) staging
    state["fail_sync"] = True
    out2 = _dev(len(payload))
    r2 = ReadOp(ref, out2, digest=True)
    dp.read([r2])
    assert r2.error is None and r2.digest == xxhash.xxh3_64_intdigest(payload)
    out2.finish()
    assert bytes(out2.flat.numpy()) == payload and seg.incarnation in dp.cuda.pins._refused
    state["fail_sync"] = False
    n = len(pieces)
    other = os.urandom(70 << 10)
    ref2 = make_ref(1 << 20, len(other), 2, "k2")
    w2 = WriteOp(ref2, _dev(other), "k2", None, None)
    dp.write([w2])  # refused mapping: staged, no direct copy attempted
    assert w2.error is None and seg.read(ref2.offset, len(other)) == other and len(pieces) == n
    assert w2.checksum == xxhash.xxh3_64_intdigest(other) and dp.cuda.pins._busy == {}


def test_staged_read_into_a_bigger_tensor_leaves_its_tail_alone(host_direct):
    """get_into a tensor larger than the object over a staged path (here: the refused
    mapping) writes the object's bytes and not one byte past them."""
    import torch

    seg, dp, make_ref, state = host_direct
    payload = os.urandom(10000)
    ref = make_ref(0, len(payload), 1, "k")
    dp.write([WriteOp(ref, memoryview(payload), "k", 0, None)])
    dp.cuda.pins.refuse(seg.incarnation)
    out = _dev(len(payload) + 4096)
    out.flat.fill_(0xAA)
    r = ReadOp(ref, out, digest=True)
    dp.read([r])
    out.finish()
    assert r.error is None and bytes(out.flat[:len(payload)].numpy()) == payload
    assert torch.all(out.flat[len(payload):] == 0xAA)


def test_a_segment_unmapped_before_its_direct_copy_is_a_typed_error(host_direct):
    """Another thread forgets the node between the direct-path decision and the copy (it
    died or restarted): the op fails with NodeUnavailable, nothing raises, the hold is
    given back."""
    seg, dp, make_ref, state = host_direct
    payload = os.urandom(4096)
    ref = make_ref(0, len(payload), 1, "k")
    dp.write([WriteOp(ref, memoryview(payload), "k", 0, None)])
    state["before_dma"] = lambda r: dp.segmaps.forget(r.node_id)
    r = ReadOp(ref, _dev(len(payload)), digest=True)
    dp.read([r])
    assert isinstance(r.error, E.NodeUnavailable) and "went away" in r.error.message
    assert dp.cuda.pins._busy == {}


def test_unregistration_waits_for_transfers_in_flight(monkeypatch):
    """Dropping a mapping that direct transfers still hold defers cudaHostUnregister until
    the last of them is released (unregistering memory a copy uses is undefined)."""
    from kvpool.connector import device_buffer as db

    done = []
    monkeypatch.setattr(db, "_unregister", lambda base, windows: done.append((base, sorted(windows))))
    pw = db.PinnedWindows()
    pw._done["inc"] = {0, 2}
    pw.acquire("inc")
    pw.acquire("inc")
    pw.drop("inc", 4096)
    assert done == [] and not pw.ready("inc", 0, 1)
    pw.release("inc")
    assert done == []
    pw.release("inc")
    assert done == [(4096, [0, 2])] and pw._busy == {} and pw._late == {}
    pw._done["other"] = {1}
    pw.drop("other", 8192)  # nothing in flight: at once
    assert done[-1] == (8192, [1])


def test_direct_get_hashes_the_segment_only_after_the_dma_ended(host_direct):
    """The direct path cannot hash the bytes that landed in the tensor (device memory), so
    it hashes the extent after the streams are synchronised: an extent rewritten (a forced
    remove and reuse) before the copies are known done fails the check, as a torn read
    must. Hashing while the copies ran, as before, passed it."""
    seg, dp, make_ref, state = host_direct
    payload = os.urandom(100 << 10)
    ref = make_ref(0, len(payload), 1, "k")
    w = WriteOp(ref, _dev(payload), "k", None, None)
    dp.write([w])
    assert w.error is None
    def reuse():  # the extent is rewritten under the reader
        seg.view[ref.offset:ref.offset + len(payload)] = bytes(len(payload))

    state["on_sync"] = reuse
    r = ReadOp(ref, _dev(len(payload)), digest=True)
    dp.read([r])
    assert r.error is None and r.digest != xxhash.xxh3_64_intdigest(payload)  # the caller reports ChecksumMismatch
    assert r.digest == xxhash.xxh3_64_intdigest(b"\x00" * len(payload))
