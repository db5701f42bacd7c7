"""One-key network gets whose read overlaps their lookup (connector/hinted_reads.py): the
early read is kept only when the lookup names the extent it read and its bytes match the
object's checksum; a moved, replaced or removed key, or a frozen node, falls back to the
usual read of the lookup's answer. Real etcd, master and store-node processes; clients read
over TCP."""
import os
import signal

import pytest

from tests.conftest import freeze, wait_for

KiB = 1 << 10


@pytest.fixture
def lc(make_cluster):
    return make_cluster(nodes=2, memory="64MiB")


def test_a_key_this_client_put_is_read_with_its_lookup(lc):
    blobs = {f"hr/{i}": os.urandom(64 * KiB) for i in range(6)}
    with lc.client(transport="tcp") as c:
        assert c.put_batch(list(blobs), list(blobs.values())) == [None] * 6
        out = bytearray(64 * KiB)
        for k, v in blobs.items():
            assert c.get_into(k, out) == 64 * KiB and bytes(out) == v
        assert (c.hints.kept, c.hints.dropped) == (6, 0)
        # leases are released as usual: a plain remove succeeds, and forgets the location
        c.remove("hr/0")
        assert c.get_into("hr/0", out) is None and (c.hints.kept, c.hints.dropped) == (6, 0)


def test_a_key_replaced_or_removed_by_another_client_is_never_served_stale(lc):
    old, new = os.urandom(64 * KiB), os.urandom(64 * KiB)
    with lc.client(transport="tcp") as a, lc.client(transport="tcp") as b:
        assert a.put("hr/k", old) is True
        out = bytearray(64 * KiB)
        assert a.get_into("hr/k", out) == 64 * KiB and a.hints.kept == 1
        b.remove("hr/k", force=True)
        assert b.put("hr/k", new) is True  # wherever it lands, a has the old extent in mind
        assert a.get_into("hr/k", out) == 64 * KiB and bytes(out) == new
        assert a.hints.dropped == 1
        # the usual read taught a the new place: the next get overlaps again
        assert a.get_into("hr/k", out) == 64 * KiB and bytes(out) == new and a.hints.kept == 2
        b.remove("hr/k", force=True)
        assert b.put("hr/other", old) is True  # may take the freed extent, with a new generation
        assert a.get_into("hr/k", out) is None and a.hints.dropped == 2
        assert a.get_into("hr/k", out) is None and a.hints.dropped == 2  # the stale location is forgotten


def test_a_wrong_layout_or_a_short_buffer_is_refused_as_without_the_overlap(lc):
    from kvpool import LayoutSpec, TensorSpec
    from kvpool.protocol.errors import InvalidRequest, LayoutMismatch

    lay = LayoutSpec(kind="full_attention", tokens_per_block=16, tensors=(TensorSpec("kv", (2, 16, 64), "float32"),),
                     num_kv_heads=1, head_size=64)
    other = LayoutSpec(kind="full_attention", tokens_per_block=16, tensors=(TensorSpec("kv", (2, 16, 64), "float16"),),
                       num_kv_heads=1, head_size=64)
    with lc.client(transport="tcp") as c:
        assert c.put("hr/lay", os.urandom(8 * KiB), layout=lay) is True
        with pytest.raises(LayoutMismatch):
            c.get_into("hr/lay", bytearray(8 * KiB), layout=other)
        with pytest.raises(InvalidRequest):
            c.get_into("hr/lay", bytearray(4 * KiB))
        out = bytearray(8 * KiB)
        assert c.get_into("hr/lay", out, layout=lay) == 8 * KiB


@pytest.mark.chaos
def test_a_frozen_node_behind_a_remembered_location_costs_one_replica_deadline(lc):
    blob = os.urandom(64 * KiB)
    with lc.client(transport="tcp", replica_timeout_s=0.5, hedge_after_s=None) as c:
        assert c.put_batch_results(["hr/two"], [blob], replicas=2)[0].replicas == 2
        ref = c.hints.where["hr/two"]
        frozen = lc.nodes[ref.node_id].proc.pid
        freeze(frozen)
        try:
            out = bytearray(64 * KiB)
            assert c.get_into("hr/two", out) == 64 * KiB and bytes(out) == blob
            assert c.hints.dropped == 1
        finally:
            os.kill(frozen, signal.SIGCONT)
        wait_for(lambda: c.get_into("hr/two", out) == 64 * KiB, 10, what="the thawed node to serve again")


def test_keys_with_a_same_host_replica_are_not_read_ahead(lc):
    with lc.client() as c:  # shared memory on this host: a get is one copy, nothing to overlap
        assert c.put("hr/local", os.urandom(64 * KiB)) is True
        out = bytearray(64 * KiB)
        assert c.get_into("hr/local", out) == 64 * KiB
        assert not c.hints.where and (c.hints.kept, c.hints.dropped) == (0, 0)
