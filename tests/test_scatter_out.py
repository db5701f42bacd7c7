"""Gets into several pages at once (connector/scatter_out.py): one object read straight
into a list of buffers, as the vLLM worker loads a block into its layers' cache pages.
Real master, store node and clients over real sockets, same-host (shared memory) and
TCP (staged) paths; real torch tensors as the pages."""
import os
import threading

import pytest
import torch

from kvpool.connector.scatter_out import ScatterOut
from kvpool.connector.vllm_pages import PageRuns
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
        self.left -= 1
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
