"""Pure protocol pieces: keys, block hashes, layouts, config, units, wire errors."""
import msgspec
import numpy as np
import pytest

from kvpool.protocol import errors as E
from kvpool.protocol import messages as M
from kvpool.protocol import rpcwire
from kvpool.protocol.config import load_config
from kvpool.protocol.keys import ROOT_HASH, block_hashes, extra_bytes, group_key, validate_key
from kvpool.protocol.layout import NO_LAYOUT, LayoutSpec, TensorSpec, check_layout, layout_of, raw_layout
from kvpool.protocol.units import parse_duration, parse_size


def kv_layout(**kw):
    base = dict(kind="full_attention", tokens_per_block=16,
                tensors=(TensorSpec("kv", (2, 2, 4, 16, 32), "float32"),), num_kv_heads=4, head_size=32)
    base.update(kw)
    return LayoutSpec(**base)


def test_key_validation():
    assert validate_key("a/b") == "a/b"
    assert validate_key(b"abc") == "abc"
    with pytest.raises(E.InvalidKey, match="empty"):
        validate_key("")
    with pytest.raises(E.InvalidKey, match="513 bytes"):
        validate_key("x" * 513)
    assert validate_key("é" * 256) == "é" * 256  # 512 bytes exactly
    with pytest.raises(E.InvalidKey, match="UTF-8"):
        validate_key(b"\xff\xfe")
    with pytest.raises(E.InvalidKey, match="UTF-8"):
        validate_key("\udc80")


def test_block_hash_chain_names_prefix():
    toks = list(range(100))
    h = block_hashes(toks, 16)
    assert len(h) == 6  # only full blocks
    assert all(len(x) == 16 for x in h)
    # same prefix, different tail: shared leading hashes, divergent after
    other = toks[:40] + [999] * 60
    h2 = block_hashes(other, 16)
    assert h2[:2] == h[:2] and h2[2] != h[2]
    # a change in block 0 changes every later hash (chaining)
    h3 = block_hashes([1] + toks[1:], 16)
    assert all(a != b for a, b in zip(h, h3))
    # extra (model id) separates namespaces
    assert block_hashes(toks, 16, extra_bytes("m1")) != block_hashes(toks, 16, extra_bytes("m2"))
    # chaining is exactly the documented formula
    import xxhash
    first = xxhash.xxh3_128_digest(ROOT_HASH + np.asarray(toks[:16], "<i8").tobytes())
    assert h[0] == first
    assert block_hashes(np.array(toks), 16) == h


def test_layout_fingerprint_and_mismatch():
    a = kv_layout()
    assert a.nbytes == 2 * 2 * 4 * 16 * 32 * 4
    assert a.fingerprint() == kv_layout(tp_rank=0).fingerprint()
    assert a.fingerprint() != kv_layout(tokens_per_block=32).fingerprint()
    assert kv_layout(tp_size=2, tp_rank=1).fingerprint() == kv_layout(tp_size=2, tp_rank=0).fingerprint()
    assert LayoutSpec.decode(a.encode()) == a
    check_layout(a, a, "k")
    with pytest.raises(E.LayoutMismatch, match="tokens_per_block"):
        check_layout(a, kv_layout(tokens_per_block=32), "k")
    with pytest.raises(E.LayoutMismatch, match="raw bytes"):
        check_layout(a, None, "k")
    with pytest.raises(E.InvalidRequest, match="kind"):
        kv_layout(kind="bogus")
    with pytest.raises(E.InvalidRequest, match="REPLICATE"):
        kv_layout(kind="mla", parallel="split")
    with pytest.raises(E.InvalidRequest):
        LayoutSpec.decode(b"\x93garbage")


def test_group_key_format():
    lay = kv_layout()
    k = group_key("ns", "llama", 0, lay.fingerprint(), bytes(range(16)), 1)
    assert k == f"ns/llama/0:{lay.fingerprint()}/tp1/000102030405060708090a0b0c0d0e0f"
    assert "/tp" not in group_key("ns", "m", 1, "f", bytes(16), None)


def test_units_and_config(tmp_path):
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("64KiB") == 65536
    assert parse_size(7) == 7
    assert parse_duration("250ms") == 0.25
    assert parse_duration("10m") == 600
    with pytest.raises(E.ConfigError, match="memory"):
        parse_size("lots", key="memory")
    cfg = load_config(None, environ={})
    assert [n.memory for n in cfg.storenodes] == [1 << 30, 1 << 30] and cfg.etcd.endpoint is None
    cfg = load_config(None, environ={"KVPOOL_MASTER__REPLICAS": "2"})
    assert cfg.master.replicas == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("master:\n  high_watermark: 0.5\n  low_watermark: 0.9\n")
    with pytest.raises(E.ConfigError, match="low_watermark"):
        load_config(bad, environ={})
    bad.write_text("master:\n  nonsense: 1\n")
    with pytest.raises(E.ConfigError, match="nonsense"):
        load_config(bad, environ={})
    with pytest.raises(E.ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad.write_text("client:\n  transport: carrier-pigeon\n")
    with pytest.raises(E.ConfigError, match="accepted: auto, tcp, unix, shm"):
        load_config(bad, environ={})


def test_waits_are_finite_and_bounded_where_they_are_set(tmp_path):
    """A timeout a socket would refuse (NaN, infinite, past a day) or a negative one is a
    ConfigError where it is set: in the config file, or in KVPoolClient's arguments."""
    from kvpool.connector.client import KVPoolClient

    bad = tmp_path / "waits.yaml"
    for key in ("io_timeout", "rpc_timeout", "write_timeout", "replica_timeout", "hedge_after"):
        for v in ("99999999999999999999s", "300000000h", ".nan", ".inf", "-1"):
            bad.write_text(f"client:\n  {key}: {v}\n")
            with pytest.raises(E.ConfigError, match=f"client.{key}"):
                load_config(bad, environ={})
    bad.write_text("client:\n  io_timeout: 1d\n  write_timeout: null\n")
    assert load_config(bad, environ={}).client.io_timeout == 86400
    for kw in ({"io_timeout_s": float("nan")}, {"io_timeout_s": float("inf")}, {"io_timeout_s": 0},
               {"rpc_timeout_s": 1e300}, {"write_timeout_s": float("inf")}, {"replica_timeout_s": "1s"},
               {"hedge_after_s": -1}, {"in_flight_wait_s": float("inf")}, {"in_flight_wait_s": float("nan")},
               {"in_flight_wait_s": -1}):
        with pytest.raises(E.ConfigError, match=next(iter(kw))):
            KVPoolClient("tcp://127.0.0.1:9", **kw)
    KVPoolClient("tcp://127.0.0.1:9", in_flight_wait_s=0, write_timeout_s=None, replica_timeout_s=None).close()


def test_errors_round_trip_on_the_wire():
    err = E.HasLease("busy", key="k")
    info = msgspec.msgpack.decode(M.encode(err.to_wire()), type=E.ErrorInfo)
    back = E.from_wire(info)
    assert type(back) is E.HasLease and back.message == "busy" and back.fields == {"key": "k"}
    assert type(E.from_wire(E.ErrorInfo("no-such-code", "x"))) is E.KVPoolError
    with pytest.raises(E.InvalidRequest, match="malformed"):
        M.decode_request(b"\x00\x01garbage")
    with pytest.raises(E.InvalidRequest, match="malformed"):
        M.decode_request(M.encode({"type": "put_start"}))  # missing field
    deep = b"\x91" * 60000 + b"\xc0"  # nested past msgspec's stack (RecursionError inside)
    with pytest.raises(E.InvalidRequest, match="malformed"):
        M.decode_request(M.encode({"type": "put_start", "items": [["k", 10, 0, None]]})[:-1] + deep)
    with pytest.raises(E.InvalidRequest, match="malformed"):
        M.decode_node_request(deep)


def test_replicated_layout_keys_do_not_depend_on_tp():
    def mla(tp_size, tp_rank):
        return LayoutSpec(kind="mla", tokens_per_block=32, tensors=(TensorSpec("latent", (32, 576), "bfloat16"),),
                          num_kv_heads=1, latent_dim=576, tp_size=tp_size, tp_rank=tp_rank, parallel="replicate")

    assert mla(1, 0).fingerprint() == mla(2, 1).fingerprint() == mla(8, 5).fingerprint()
    check_layout(mla(2, 1), mla(1, 0), "k")  # one stored copy serves every TP size and rank
    assert kv_layout(tp_size=2).fingerprint() != kv_layout(tp_size=1).fingerprint()  # SPLIT: heads differ


def test_config_errors_name_their_source(tmp_path):
    with pytest.raises(E.ConfigError, match="KVPOOL_MASTER__REPLICAS"):
        load_config(None, environ={"KVPOOL_MASTER__REPLICAS": "abc"})
    with pytest.raises(E.ConfigError, match="KVPOOL_MASTER__REPLICAS"):
        load_config(None, environ={"KVPOOL_MASTER__REPLICAS": "[1"})
    assert load_config(None, environ={"KVPOOL_MASTER__LEASE_TTL": "5"}).master.lease_ttl == 5
    with pytest.raises(E.ConfigError, match="cannot be read"):
        load_config(tmp_path)
    bad = tmp_path / "b.yaml"
    bad.write_text("storenodes:\n  - name: a\n    memory: 1\n")
    with pytest.raises(E.ConfigError, match="at least 1MiB"):
        load_config(bad, environ={})
    bad.write_text("storenodes:\n  - name: a/b\n")
    with pytest.raises(E.ConfigError, match="name"):
        load_config(bad, environ={})
    bad.write_text("storenodes:\n  - name: a\n  - name: a\n")
    with pytest.raises(E.ConfigError, match="unique"):
        load_config(bad, environ={})


def test_rpc_frame_parser_reassembles_split_and_coalesced_frames():
    big = rpcwire.BIG_FRAME
    frames = [(1, M.encode(M.Exists(["a"]))), (0, b""), (2**64 - 1, b"x" * 70000), (3, b"b" * (big - 8)),
              (4, b"c" * (big - 9)), (5, b"d" * (2 * big)), (6, b"e")]  # big ones gathered in their own buffer
    wire = b"".join(rpcwire.pack(rid, body) for rid, body in frames)
    small = sum(12 + len(body) for _, body in frames[:3])
    for step, upto in ((1, small), (5, small), (12, None), (4099, None), (1 << 20, None), (len(wire), None)):
        p = rpcwire.FrameParser()  # byte by byte, mid-header, many per chunk
        got, part = [], memoryview(wire)[:upto]
        for i in range(0, len(part), step):
            got += p.feed(part[i:i + step])
        assert [(rid, bytes(body)) for rid, body in got] == frames[:len(got)] and not p.partial
        assert len(got) == (3 if upto else len(frames))


def test_rpc_frame_parser_refuses_impossible_lengths():
    good = rpcwire.pack(7, b"ok")
    for size in (0, 7, rpcwire.MAX_FRAME + 1):
        p = rpcwire.FrameParser()
        assert p.feed(good + rpcwire.HEAD.pack(size, 42) + good) == [(7, b"ok")]  # frames before it survive
        assert isinstance(p.error, E.InvalidRequest) and "outside" in p.error.message
        assert p.error.fields["rid"] == 42 and p.feed(good) == []  # nothing after it is trusted


def test_layouts_travel_raw_and_decode_once_per_encoding():
    """A wire item's layout is the raw msgpack of an embedded LayoutSpec (the bytes on the
    wire as before); equal encodings decode to one shared object; a malformed one is a
    typed InvalidRequest that refuses the whole request."""
    lay = LayoutSpec(kind="raw", tokens_per_block=1, tensors=(TensorSpec("t", (4,), "uint8"),))
    item = M.PutItem("k", 4, 0, raw_layout(lay))
    back = msgspec.msgpack.decode(M.encode(M.PutStart([item, M.PutItem("n", 4, 0)])), type=M.PutStart)
    assert back.items[0].layout == lay and back.items[1].layout is None and back.items[1].wire_layout == NO_LAYOUT
    again = msgspec.msgpack.decode(M.encode(M.PutStart([item])), type=M.PutStart)
    assert again.items[0].layout is back.items[0].layout  # decoded once, shared
    assert raw_layout(lay) is raw_layout(lay)  # encoded once per layout object
    with pytest.raises(E.InvalidRequest):
        layout_of(b"\x93\x01\x02\x03")
    bad = M.PutStart([item, M.PutItem("b", 4, 0, msgspec.Raw(b"\x93\x01\x02\x03"))])
    with pytest.raises(E.InvalidRequest):
        M.check_layouts(bad)
    many = M.PutStart([M.PutItem(f"k{i}", 4, 0, raw_layout(msgspec.structs.replace(lay, tokens_per_block=i + 1)))
                       for i in range(M.MAX_REQUEST_LAYOUTS + 1)])
    with pytest.raises(E.InvalidRequest, match="distinct layouts"):
        M.check_layouts(many)
    M.check_layouts(M.slice_request(many, 0, M.MAX_REQUEST_LAYOUTS))
    with pytest.raises(E.InvalidRequest, match="has 64 bytes but its raw layout describes 4"):
        M.check_layouts(M.PutStart([item, M.PutItem("small", 64, 0, raw_layout(lay))]))


def test_slice_request_cuts_every_per_key_list_alike():
    req = M.PutEnd([f"k{i}" for i in range(10)], list(range(10)), list(range(100, 110)))
    part = M.slice_request(req, 3, 6)
    assert (part.keys, part.put_ids, part.checksums) == (["k3", "k4", "k5"], [3, 4, 5], [103, 104, 105])
    assert M.slice_request(M.PutEnd(["a", "b"], [1, 2]), 1, 2).checksums == []  # an empty optional list
    assert M.slice_request(M.Remove(["a", "b", "c"], force=True), 0, 2) == M.Remove(["a", "b"], force=True)
    with pytest.raises(E.InvalidRequest, match="3 keys but 2 put_ids"):
        M.slice_request(M.PutRevoke(["a", "b", "c"], [1, 2]), 0, 2)
    with pytest.raises(E.InvalidRequest, match="3 keys but 0 put_ids"):  # only checksums may be left empty
        M.slice_request(M.PutEnd(["a", "b", "c"], []), 0, 2)


def test_a_sliced_batch_answers_in_order_or_with_its_first_error():
    from kvpool.master.batches import SLICE, SlicedBatch

    req = M.Exists([f"k{i}" for i in range(2 * SLICE + 5)])
    steps = []
    b = SlicedBatch(req, lambda part: (steps.append(len(part.keys)), [k[1:] for k in part.keys])[1], lambda r: r)
    while (out := b.step()) is None:
        pass
    assert out == [str(i) for i in range(2 * SLICE + 5)] and steps == [SLICE, SLICE, 5]

    def run(part):
        if part.keys[0] != "k0":
            raise E.NotLeader("moved")
        return [True] * len(part.keys)

    b = SlicedBatch(req, run, lambda r: r)
    assert b.step() is None and isinstance(b.step(), E.NotLeader)  # a read: the error alone
    b = SlicedBatch(req, run, lambda r: r, key_error=lambda e: e.code)  # per-key results: what was applied
    assert b.step() is None and b.step() == [True] * SLICE + [E.NotLeader.code] * (SLICE + 5)
    assert SlicedBatch(req, lambda part: 1 / 0, lambda r: r, key_error=lambda e: e).step().__class__ \
        is ZeroDivisionError  # nothing applied: the error alone


def test_durations_and_sizes_are_parsed_once_as_the_config_is_built():
    from kvpool.protocol.config import ClientConfig, MasterConfig, StoreNodeConfig

    cfg = load_config(None, {"master": {"lease_ttl": "250ms"}, "client": {"reserve": "2MiB", "hedge_after": None},
                             "storenodes": [{"name": "a", "memory": "64MiB"}]}, environ={})
    assert (cfg.master.lease_ttl, cfg.master.node_ttl, cfg.client.reserve) == (0.25, 3.0, 2 << 20)
    assert cfg.client.hedge_after is None and cfg.storenodes[0].memory == 64 << 20
    assert cfg.client.client_kwargs()["spin_wait_s"] == pytest.approx(100e-6)
    assert MasterConfig(lease_ttl="2s").lease_ttl == 2.0  # built in code: parsed alike
    assert msgspec.structs.replace(MasterConfig(), put_timeout="1m").put_timeout == 60.0
    assert StoreNodeConfig(memory=4096).memory == 4096 and ClientConfig(rpc_timeout=3).rpc_timeout == 3.0
    with pytest.raises(E.ConfigError, match="master.quarantine") as ei:
        MasterConfig(quarantine="soon")
    assert ei.value.fields["key"] == "master.quarantine"
    with pytest.raises(E.ConfigError, match=r"storenodes\[b\].memory"):
        load_config(None, {"storenodes": [{"name": "b", "memory": "lots"}]}, environ={})
    with pytest.raises(E.ConfigError, match="KVPOOL_CLIENT__IO_TIMEOUT"):
        load_config(None, environ={"KVPOOL_CLIENT__IO_TIMEOUT": "forever"})
    for bad in (".nan", ".inf", "-1"):  # YAML numbers that are no duration
        with pytest.raises(E.ConfigError, match="KVPOOL_MASTER__NODE_TTL"):
            load_config(None, environ={"KVPOOL_MASTER__NODE_TTL": bad})
    with pytest.raises(E.ConfigError, match="KVPOOL_MASTER__JOIN_TIMEOUT"):
        load_config(None, environ={"KVPOOL_MASTER__JOIN_TIMEOUT": ".inf"})
    with pytest.raises(E.ConfigError, match=r"set by --replicas"):  # a flag's value, not the file's
        load_config(None, {"master": {"replicas": "two"}}, environ={})
