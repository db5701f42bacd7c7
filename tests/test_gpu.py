"""CUDA tensors through the host staging path. Runs on a machine with a GPU (the lent
device machine); skipped cleanly where torch sees no CUDA device."""
import pytest
import torch

from kvpool.protocol.errors import ChecksumMismatch, InvalidRequest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")]


def test_cuda_tensor_put_and_get_into(client):
    t = torch.randn(256, 1024, device="cuda")
    client.put("gpu/a", t)
    out = torch.empty_like(t)
    assert client.get_into("gpu/a", out) == t.numel() * 4
    torch.cuda.synchronize()
    assert torch.equal(out, t)
    host = torch.empty(256, 1024)
    client.get_into("gpu/a", host)
    assert torch.equal(host, t.cpu())


def test_cuda_segment_node_end_to_end(make_cluster):
    """A store node with a GPU segment (--device cuda:0): puts and gets of host and CUDA
    tensors go through its pinned staging buffer, over the Unix socket on this host and
    over TCP when forced; the node reports its device."""
    lc = make_cluster(nodes=0)
    lc.start_node("gpu-node", "256MiB", device="cuda:0")
    lc.wait_nodes(1)
    with lc.client() as c:
        assert c.stats().nodes[0].device == "cuda:0"
        t = torch.randn(1024, 1024, device="cuda")  # 4 MiB: one staged piece
        big = torch.randn(3, 1024, 1024)  # 12 MiB from host memory: three pieces
        assert c.put("gpuseg/t", t) is True
        assert c.put("gpuseg/big", big) is True
        out = torch.empty_like(t)
        assert c.get_into("gpuseg/t", out) == t.numel() * 4
        torch.cuda.synchronize()
        assert torch.equal(out, t)
        back = torch.empty_like(big)
        assert c.get_into("gpuseg/big", back) == big.numel() * 4 and torch.equal(back, big)
    with lc.client(transport="tcp") as c:
        assert c.get("gpuseg/big") == big.numpy().tobytes()


def _ref(c, key):
    return c.lookup([key])[0].replicas[0]


def test_cuda_tensors_move_by_dma_into_and_out_of_a_same_host_segment(cluster):
    """Same host: the segment mapping is registered with CUDA in windows on first use and
    CUDA tensors move by one DMA each way; the checksum is hashed from the segment, so a
    TCP reader (host bytes, its own checksum check) reads exactly what was DMA'd in. An
    object spanning two registration windows works; a staged client (cuda_direct=False)
    reads the same bytes without registering anything."""
    from kvpool.connector.device_buffer import PIN_WINDOW

    with cluster.client() as c, cluster.client(transport="tcp") as net, cluster.client(cuda_direct=False) as staged:
        small = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda")
        big = torch.randn(PIN_WINDOW // 4 + 12345, device="cuda")  # more than one window
        assert c.put("dma/small", small) is True and c.put("dma/big", big) is True
        for key, t in (("dma/small", small), ("dma/big", big)):
            ref = _ref(c, key)
            assert c.data.cuda.pins.ready(ref.incarnation, ref.offset, ref.size)
            assert net.get(key) == t.cpu().numpy().tobytes()
            out = torch.empty_like(t)
            assert c.get_into(key, out) == t.numel() * t.element_size() and torch.equal(out, t)
            back = torch.zeros_like(t)
            assert staged.get_into(key, back) == t.numel() * t.element_size() and torch.equal(back, t)
        assert staged.data.cuda.pins is None
        # a mixed batch: CUDA and host buffers, one round trip
        outs = [torch.empty_like(small), torch.empty(small.shape, dtype=torch.uint8), torch.empty_like(big)]
        assert c.get_into_batch(["dma/small", "dma/small", "dma/big"], outs) == [small.numel(), small.numel(),
                                                                                  big.numel() * 4]
        assert torch.equal(outs[0], small) and torch.equal(outs[1], small.cpu()) and torch.equal(outs[2], big)
        # an output tensor smaller than the object is a typed error, and the tensor is untouched
        short = torch.zeros(small.numel() - 1, dtype=torch.uint8, device="cuda")
        with pytest.raises(InvalidRequest, match="holds .* bytes"):
            c.get_into("dma/small", short)
        assert int(short.count_nonzero()) == 0


def test_direct_read_of_a_corrupted_extent_is_a_checksum_error(make_cluster):
    """The direct path verifies the segment bytes it DMA'd: flip a byte in the mapped
    extent and the read fails with ChecksumMismatch; the master drops the replica, so the
    key is then a clean miss (a later put stores it again)."""
    lc = make_cluster(nodes=1)
    with lc.client(lease_retries=0) as c:
        t = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
        c.put("dma/corrupt", t)
        ref = _ref(c, "dma/corrupt")
        seg = c.data.segmaps.segment(ref)
        seg[ref.offset + 777] = (seg[ref.offset + 777] + 1) % 256
        with pytest.raises(ChecksumMismatch):
            c.get_into("dma/corrupt", torch.empty_like(t))
        assert c.get_into("dma/corrupt", torch.empty_like(t)) is None
        assert c.put("dma/corrupt", t) is True


def test_forgetting_a_node_unregisters_its_windows(make_cluster):
    """A node the client forgets (it died, or restarted under a new incarnation) has its
    mapping unregistered from CUDA before it is unmapped; the next read registers again."""
    lc = make_cluster(nodes=1)
    with lc.client() as c:
        t = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
        c.put("dma/again", t)
        ref = _ref(c, "dma/again")
        assert c.data.cuda.pins.ready(ref.incarnation, ref.offset, ref.size)
        c.data.segmaps.forget(ref.node_id)
        assert not c.data.cuda.pins.ready(ref.incarnation, ref.offset, ref.size)
        out = torch.empty_like(t)
        assert c.get_into("dma/again", out) == t.numel() and torch.equal(out, t)
        assert c.data.cuda.pins.ready(ref.incarnation, ref.offset, ref.size)


def test_copies_run_on_the_callers_stream(cluster):
    """A tensor made on a side stream is copied on that stream (whichever client thread
    issues the copy), so the copy waits for the kernel that produced it: put right after a
    kernel on the side stream, with no synchronisation by the caller, stores its result."""
    from kvpool.connector.device_buffer import DeviceBuffer

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        src = torch.randn(4096, 1024, device="cuda")  # 16 MiB
        assert DeviceBuffer(src).stream == side
        t = src * 3 + 1  # queued on the side stream
        with cluster.client() as c, cluster.client(transport="tcp") as net:
            assert c.put("stream/t", t) is True and net.put("stream/t-net", t) is True
            out = torch.empty_like(t)
            assert c.get_into("stream/t", out) == t.numel() * 4
    side.synchronize()
    assert torch.equal(out, src * 3 + 1)
    back = torch.empty(t.shape)
    with cluster.client(transport="tcp") as net:
        net.get_into("stream/t-net", back)
    assert torch.equal(back, (src * 3 + 1).cpu())
