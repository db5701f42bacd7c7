"""Gets into several pages at once (connector/scatter_out.py): one object read straight
into a list of buffers, as the vLLM worker loads a block into its layers' cache pages.
Real master, store node and clients over real sockets, same-host (shared memory) and
TCP (staged) paths; real torch tensors as the pages."""
import os
import threading

import pytest
import torch

from kvpool.connector.scatter_out import ScatterOut
from kvpool.connector.vllm.pages import PageRuns
from kvpool.protocol.errors import InvalidRequest, LoadCancelled

KiB = 1 << 10


class _Gate:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_an_object_lands_in_its_pages_in_order(cluster, transport):
    keys = [f"so/{transport}/{i}" for i in range(6)]
    blobs = [os.urandom(3 * 20 * KiB) for _ in keys]
    layers = [torch.zeros((16, 4, 5, KiB // 4), dtype=torch.float32) for _ in range(3)]  # 20 KiB pages
    parts = [(t, i * 20 * KiB, (i + 1) * 20 * KiB) for i, t in enumerate(layers)]
    runs = PageRuns.of(parts, 16, 60 * KiB)
    assert runs is not None
    blocks = [11, 2, 7, 0, 15, 4]
    with cluster.client(transport=transport) as c:
        assert c.put_batch(keys, blobs) == [None] * 6
        outs = [ScatterOut(runs.pages(b), _Gate()) for b in blocks]
        assert c.get_into_batch(keys, outs) == [60 * KiB] * 6
    for blob, b in zip(blobs, blocks):
        got = b"".join(t[b].view(torch.uint8).numpy().tobytes() for t in layers)
        assert got == blob
    untouched = set(range(16)) - set(blocks)
    assert all(not t[b].any() for t in layers for b in untouched)


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_cancelled_gate_writes_nothing_and_says_so(cluster, transport):
    key = f"so-cancel/{transport}"
    page = torch.zeros(32 * KiB, dtype=torch.uint8)
    gate = _Gate()
    gate.cancelled = True
    with cluster.client(transport=transport) as c:
        c.put(key, os.urandom(32 * KiB))
        r = c.get_into_batch([key], [ScatterOut([memoryview(page.numpy())], gate)])[0]
    assert isinstance(r, LoadCancelled)
    assert not page.any()


def test_pages_smaller_than_the_object_are_refused_untouched(cluster):
    page = bytearray(8 * KiB)
    with cluster.client() as c:
        c.put("so-small", os.urandom(16 * KiB))
        r = c.get_into_batch(["so-small"], [ScatterOut([memoryview(page)])])[0]
        assert isinstance(r, InvalidRequest)
        with pytest.raises(InvalidRequest, match="destination"):
            c.put("so-put", ScatterOut([memoryview(page)]))
    assert page == bytearray(8 * KiB)


def test_page_runs_refuse_what_is_not_one_run_per_page():
    t = torch.zeros((8, 2, 64), dtype=torch.uint8)
    assert PageRuns.of([(t, 0, 128)], 8, 128) is not None
    assert PageRuns.of([(t, 0, 128)], 8, 256) is None  # parts do not cover the block
    assert PageRuns.of([(t.transpose(1, 2), 0, 128)], 8, 128) is None  # a strided page
    assert PageRuns.of([(t, 0, 128), (t, 64, 192)], 8, 192) is None  # a gap between parts
    assert PageRuns.of([(t, 0, 128)], 9, 128) is None  # fewer pages than blocks


class _CancelAfter(_Gate):
    """A gate whose owner cancels after ``n`` writes (as a lapsed step deadline would)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.left = n

    @property
    def cancelled(self) -> bool:
        if not self.lock.locked():  # a look before a read: cancelled once every write is used up
            return self.left <= 0
        self.left -= 1  # the look before a write, under the lock
        return self.left < 0

    @cancelled.setter
    def cancelled(self, v: bool) -> None:
        pass


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_no_block_is_written_after_the_cancel(cluster, transport):
    keys = [f"so-mid/{transport}/{i}" for i in range(12)]
    blobs = [os.urandom(16 * KiB) for _ in keys]
    pages = torch.zeros((12, 16 * KiB), dtype=torch.uint8)
    gate = _CancelAfter(5)
    with cluster.client(transport=transport) as c:
        assert c.put_batch(keys, blobs) == [None] * 12
        res = c.get_into_batch(keys, [ScatterOut([memoryview(pages[i].numpy())], gate) for i in range(12)])
    done = [i for i, r in enumerate(res) if r == 16 * KiB]
    assert len(done) == 5 and all(isinstance(res[i], LoadCancelled) for i in set(range(12)) - set(done))
    for i in range(12):
        assert pages[i].numpy().tobytes() == (blobs[i] if i in done else bytes(16 * KiB))


@pytest.fixture
def near_and_far(make_cluster):
    """Two nodes, one on this host (read from shared memory) and one on another host id
    (read over TCP), so every object put with two replicas has one of each."""
    lc = make_cluster(nodes=1)
    lc.start_node("node-far", "64MiB", host_id="far-host")
    lc.wait_nodes(2)
    return lc


def test_a_failed_network_attempt_never_overwrites_the_copy_that_passed(near_and_far):
    """The far replica is read first and fails (its node is dead); the same-host replica
    then lands in the pages and passes. The failed attempt's staging must not be copied
    over it."""
    lc = near_and_far
    blob = os.urandom(64 * KiB)
    pages = torch.zeros((2, 32 * KiB), dtype=torch.uint8)
    with lc.client() as c:
        assert c.put("so-two", blob, replicas=2)
        near = [r for r in c.lookup(["so-two"])[0].replicas if r.host_id == c.host_id]
        assert len(near) == 1
        c.replica_reads.failed(near[0].node_id)  # a recent failure: the near replica is read last
        lc.kill_node("node-far")
        out = ScatterOut([memoryview(pages[0].numpy()), memoryview(pages[1].numpy())], _Gate())
        assert c.get_into_batch(["so-two"], [out])[0] == 64 * KiB
    assert pages.numpy().tobytes() == blob


def test_a_cancelled_block_is_not_read_again_from_another_replica(near_and_far, monkeypatch):
    from kvpool.connector import dataclient

    lc = near_and_far
    reads: list[str] = []
    read = dataclient.DataPlane.read

    def counted(self, ops, deadline=None):
        reads.extend(op.ref.node_id for op in ops)
        return read(self, ops, deadline)

    monkeypatch.setattr(dataclient.DataPlane, "read", counted)
    page = torch.zeros(64 * KiB, dtype=torch.uint8)
    gate = _Gate()
    gate.cancelled = True
    with lc.client() as c:
        assert c.put("so-cancel-two", os.urandom(64 * KiB), replicas=2)
        r = c.get_into_batch(["so-cancel-two"], [ScatterOut([memoryview(page.numpy())], gate)])[0]
    assert isinstance(r, LoadCancelled) and len(reads) == 1 and not page.any()
