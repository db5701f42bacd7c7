"""The disk tier's files and mover on real files and a real segment (no processes):
the format, verification at start (torn, cut short, foreign format, other layout scheme,
unfinished writes), the directory lock, demotion and promotion through TierMover."""
import os
import struct

import msgspec
import pytest
import xxhash

from kvpool.protocol.config import load_config
from kvpool.protocol.errors import ConfigError, PutRevoked, StaleExtent, StaleTerm
from kvpool.protocol.layout import LayoutSpec, TensorSpec
from kvpool.protocol.messages import DISK, ExtentEntry, ExtentRef, NodeDemote, NodePromote
from kvpool.storenode import disk_tier
from kvpool.storenode.demotion import TierMover, _BufferReader
from kvpool.storenode.disk_tier import DiskTier, decode_header
from kvpool.storenode.extents import ExtentTable
from kvpool.storenode.segment import Segment

MiB = 1 << 20
LAYOUT = LayoutSpec(kind="full_attention", tokens_per_block=16, tensors=(TensorSpec("kv", (2, 16, 4, 8), "float16"),),
                    num_kv_heads=4, head_size=8)


def row(key, data, layout=None, replicas=1):
    return ExtentEntry(key, 0, len(data), 0, xxhash.xxh3_64_intdigest(data), layout, True, replicas)


def store(tier, key, data, layout=None):
    disk_id = tier.reserve(len(data))
    tmp = tier.write(disk_id, row(key, data, layout), memoryview(data))
    tier.publish([(disk_id, row(key, data, layout), tmp)])
    return disk_id


def test_write_read_and_restart_keep_objects(tmp_path):
    t = DiskTier(str(tmp_path), 10 * MiB)
    a, b = os.urandom(MiB + 3), os.urandom(4096)
    ia = store(t, "a/b:c/1", a, LAYOUT.encode())
    ib = store(t, "k", b)
    out = bytearray(len(a))
    r = t.read_into(ia, memoryview(out))
    assert bytes(out) == a and r.tier == DISK and r.gen == ia and r.layout == LAYOUT.encode()
    assert t.usage() == (2, len(a) + len(b))
    t.close()
    t2 = DiskTier(str(tmp_path), 10 * MiB)
    assert t2.scan() == (2, 0)
    assert {(x.key, x.gen, x.size) for x in t2.rows()} == {("a/b:c/1", ia, len(a)), ("k", ib, len(b))}
    assert t2.reserve(10) > max(ia, ib)  # new files never reuse an id held on disk
    out = bytearray(len(b))
    t2.read_into(ib, memoryview(out))
    assert bytes(out) == b
    t2.delete([ib])
    with pytest.raises(StaleExtent):
        t2.read_into(ib, memoryview(out))
    t2.close()


def test_scan_drops_every_file_that_fails_a_check(tmp_path, caplog):
    t = DiskTier(str(tmp_path), 10 * MiB)
    data = os.urandom(8192)
    ids = [store(t, f"k{i}", data, LAYOUT.encode() if i == 5 else None) for i in range(7)]
    path = lambda i: os.path.join(str(tmp_path), f"{ids[i]:016x}.kvd")  # noqa: E731
    with open(path(0), "r+b") as f:  # a flipped payload byte
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([b[0] ^ 1]))
    with open(path(1), "r+b") as f:  # cut short (torn)
        f.truncate(os.path.getsize(path(1)) - 10)
    with open(path(2), "r+b") as f:  # a flipped header byte
        f.seek(30)
        b = f.read(1)
        f.seek(30)
        f.write(bytes([b[0] ^ 1]))
    with open(path(3), "r+b") as f:  # written by a format this release does not read
        f.seek(4)
        f.write(struct.pack("<H", disk_tier.FORMAT + 1))
    os.rename(path(4), os.path.join(str(tmp_path), f"{ids[4] + 100:016x}.kvd"))  # named for another id
    # a layout whose fingerprint this release computes differently: rewrite the recorded one
    h = decode_header(open(path(5), "rb").read())
    good = disk_tier.encode_header(h.disk_id, h.size, h.checksum, h.replicas, h.key, h.layout)
    bad = bytearray(disk_tier.encode_header(h.disk_id, h.size, h.checksum, h.replicas, h.key, h.layout))
    struct.pack_into("<Q", bad, 44, 12345)  # the fingerprint field
    struct.pack_into("<Q", bad, disk_tier._HEAD.size, xxhash.xxh3_64_intdigest(
        bytes(bad[:disk_tier._HEAD.size]) + bytes(bad[disk_tier._HEAD.size + 8:])))
    with open(path(5), "r+b") as f:
        assert len(good) == len(bad)
        f.write(bad)
    open(os.path.join(str(tmp_path), "00000000000000ff.kvd.tmp"), "wb").write(b"half")  # an unfinished write
    t.close()
    t2 = DiskTier(str(tmp_path), 10 * MiB)
    with caplog.at_level("WARNING", logger="kvpool.storenode"):
        assert t2.scan() == (1, 7)
    assert [r.key for r in t2.rows()] == ["k6"]
    assert sorted(os.listdir(str(tmp_path))) == [".lock", f"{ids[6]:016x}.kvd"]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 7 and any("checksum" in m for m in msgs) and any("format" in m for m in msgs)
    assert any("fingerprint" in m for m in msgs) and any("unfinished" in m for m in msgs)
    t2.close()


def test_one_node_per_directory(tmp_path):
    t = DiskTier(str(tmp_path), MiB)
    with pytest.raises(ConfigError, match="in use"):
        DiskTier(str(tmp_path), MiB)
    t.close()
    DiskTier(str(tmp_path), MiB).close()


def _node(tmp_path, cap=4 * MiB):
    seg = Segment(cap)
    table = ExtentTable(cap)
    disk = DiskTier(str(tmp_path), 16 * MiB)
    return seg, table, disk, TierMover(seg, table, disk)


def _commit(seg, table, key, off, data, gen):
    seg.view[off:off + len(data)] = data
    table.commit(ExtentEntry(key, off, len(data), gen, xxhash.xxh3_64_intdigest(data), None, True, 1))


def test_mover_demotes_durably_and_promotes_back(tmp_path):
    seg, table, disk, mover = _node(tmp_path)
    try:
        datas = [os.urandom(64 * 1024 + i) for i in range(3)]
        for i, d in enumerate(datas):
            _commit(seg, table, f"k{i}", i * MiB, d, 10 + i)
        futs = [mover.demote(NodeDemote(i * MiB, 10 + i, len(d), f"k{i}")) for i, d in enumerate(datas)]
        done = [f.result(10) for f in futs]
        assert [x.key for x in done] == ["k0", "k1", "k2"] and len({x.disk_id for x in done}) == 3
        assert all(os.path.exists(os.path.join(str(tmp_path), f"{x.disk_id:016x}.kvd")) for x in done)
        assert table.check_read(0, len(datas[0]), 10).key == "k0"  # memory untouched: the master frees it
        # a stale or wrong source fails and writes nothing
        with pytest.raises(StaleExtent):
            mover.demote(NodeDemote(0, 99, len(datas[0]), "k0")).result(10)
        # promotion: file -> a fresh memory extent, recorded committed
        dst = ExtentRef("n", seg.incarnation, "", "", "", 3 * MiB, len(datas[1]), 50)
        p = mover.promote(NodePromote(done[1].disk_id, dst, "k1")).result(10)
        assert p.op == "promote" and bytes(seg.view[3 * MiB:3 * MiB + len(datas[1])]) == datas[1]
        assert table.check_read(3 * MiB, len(datas[1]), 50).committed
        # a promotion into an extent of a deposed leader's term is refused before a byte lands
        table.term = 1
        dst2 = ExtentRef("n", seg.incarnation, "", "", "", 2 * MiB + 512 * 1024, len(datas[2]), 7)
        with pytest.raises(StaleTerm):
            mover.promote(NodePromote(done[2].disk_id, dst2, "k2", term=1)).result(10)
        with pytest.raises((StaleTerm, PutRevoked)):
            mover.demote(NodeDemote(2 * MiB, 12, len(datas[2]), "k2", term=0)).result(10)
        assert mover.failures >= 2
    finally:
        mover.close()
        disk.close()
        seg.close()


def test_demotion_of_bytes_changed_under_it_writes_nothing(tmp_path):
    seg, table, disk, mover = _node(tmp_path)
    try:
        data = os.urandom(4096)
        seg.view[0:4096] = data
        table.commit(ExtentEntry("k", 0, 4096, 3, xxhash.xxh3_64_intdigest(data) ^ 1, None, True, 1))
        with pytest.raises(Exception, match="changed"):
            mover.demote(NodeDemote(0, 3, 4096, "k")).result(10)
        assert [n for n in os.listdir(str(tmp_path)) if n != ".lock"] == [] and disk.usage() == (0, 0)
    finally:
        mover.close()
        disk.close()
        seg.close()


def test_header_round_trip():
    hb = disk_tier.encode_header(7, 100, 42, 2, "key/ä", LAYOUT.encode(), created=1.0)
    h = decode_header(hb + b"payload")
    assert (h.disk_id, h.size, h.checksum, h.replicas, h.key, h.header_len) == (7, 100, 42, 2, "key/ä", len(hb))
    assert msgspec.msgpack.decode(h.layout, type=LayoutSpec) == LAYOUT


@pytest.mark.slow  # imports torch
def test_mover_on_a_device_segment_stages_through_host_memory(tmp_path):
    from kvpool.storenode.device_segment import DeviceSegment

    seg = DeviceSegment(2 * MiB, "cpu")  # the same code as cuda:N, with pageable staging
    table = ExtentTable(2 * MiB)
    disk = DiskTier(str(tmp_path), 16 * MiB)
    mover = TierMover(seg, table, disk)
    try:
        data = os.urandom(300 * 1024)
        seg.recv(_BufferReader(bytearray(data)), 0, len(data))
        table.commit(ExtentEntry("k", 0, len(data), 4, xxhash.xxh3_64_intdigest(data), None, True, 1))
        done = mover.demote(NodeDemote(0, 4, len(data), "k")).result(10)
        dst = ExtentRef("n", seg.incarnation, "", "", "", MiB, len(data), 9)
        mover.promote(NodePromote(done.disk_id, dst, "k")).result(10)
        assert seg.read(MiB, len(data)) == data
    finally:
        mover.close()
        disk.close()
        seg.close()


def test_bad_disk_settings_are_config_errors_naming_the_key(tmp_path):
    f = tmp_path / "file"
    f.write_text("not a directory")
    with pytest.raises(ConfigError, match="disk_dir"):
        DiskTier(str(f / "sub"), MiB)
    for node, key in (({"disk_capacity": "1KiB"}, "disk_capacity"), ({"disk_readers": 0}, "disk_readers"),
                      ({"disk_low_watermark": 0.99}, "disk_high_watermark"), ({"disk_dir": " "}, "disk_dir"),
                      ({"disk_port": 70000}, "disk_port"), ({"disk_write_rate": "fast"}, "disk_write_rate")):
        with pytest.raises(ConfigError) as e:
            load_config(None, {"storenodes": [{"name": "n", **node}]}, environ={})
        assert key in str(e.value), (node, e.value)
