"""What one master round trip costs, by RPC carrier: zmq DEALER/ROUTER (what
``connector/rpc.py`` and ``master/server.py`` use) against a plain socket carrying the
same frames (``u32 length || msgpack``) over loopback TCP and a Unix socket.

The server is a child process holding a real :class:`~master.state.MasterState` with
``--objects`` committed objects; each request is a real ``Lookup`` (with a lease, as a get
does) of 1 or 64 keys, encoded and decoded with ``protocol.messages`` exactly as the real
client and master do. Only the carrier differs, so the gap is what the carrier costs.

    python benchmarks/rpc_latency.py [--calls 3000] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpool.protocol import messages as M  # noqa: E402

_LEN = struct.Struct("<I")


def _state(n: int):
    from kvpool.master.state import MasterSettings, MasterState
    from kvpool.protocol.messages import NodeDesc, PutItem

    st = MasterState(MasterSettings())
    st.node_up(NodeDesc("node-0", "inc0", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "unix:///tmp/x.sock", "h0",
                        1 << 40, grant_key=b"k" * 32), 0.0)
    keys = [f"ns/m/0:fp/blk-{i:08x}" for i in range(n)]
    for i in range(0, n, 64):
        g = st.put_start([PutItem(k, 4096, 1) for k in keys[i:i + 64]], "h0", 1, 0.0)
        st.put_end([x.key for x in g], [x.put_id for x in g], 0.0)
    st.take_outbox()
    return st, keys


def _raw(res):
    import msgspec

    return msgspec.Raw(M.encode(res))


def _reply(st, body: bytes) -> bytes:
    req = M.decode_request(body)
    now = time.time()
    res = st.lookup(req.keys, req.lease, now) if isinstance(req, M.Lookup) else None
    return M.encode(M.Reply(_raw(res)))


# ---- servers (child process) -------------------------------------------------------------------

def serve_zmq(addr_file: str, n: int) -> None:
    import zmq

    st, _ = _state(n)
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    with open(addr_file, "w") as f:
        f.write(f"tcp://127.0.0.1:{port}")
    while True:
        ident, rid, body = r.recv_multipart()
        if body == b"quit":
            return
        r.send_multipart([ident, rid, _reply(st, body)])


def serve_sock(kind: str, addr_file: str, n: int) -> None:
    st, _ = _state(n)
    if kind == "unix":
        path = addr_file + ".sock"
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(path)
        addr = path
    else:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        addr = "%s:%d" % ls.getsockname()
    ls.listen(1)
    with open(addr_file, "w") as f:
        f.write(addr)
    c, _ = ls.accept()
    if kind == "tcp":
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = c.makefile("rb", buffering=1 << 16)
    while True:
        head = f.read(4)
        if len(head) < 4:
            return
        body = f.read(_LEN.unpack(head)[0])
        out = _reply(st, body)
        c.sendall(_LEN.pack(len(out)) + out)


# ---- client (this process) ---------------------------------------------------------------------

def _spawn(kind: str, n: int) -> tuple[subprocess.Popen, str]:
    d = tempfile.mkdtemp(prefix="kvpool-rpc-")
    addr_file = os.path.join(d, "addr")
    p = subprocess.Popen([sys.executable, __file__, "--serve", kind, addr_file, str(n)])
    deadline = time.monotonic() + 30
    while not (os.path.exists(addr_file) and os.path.getsize(addr_file)):
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{kind} server did not start")
        time.sleep(0.02)
    time.sleep(0.05)
    with open(addr_file) as f:
        return p, f.read()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1)))]


def run(kind: str, calls: int, batch: int, n: int) -> dict:
    proc, addr = _spawn(kind, n)
    keys = [f"ns/m/0:fp/blk-{i:08x}" for i in range(n)]
    lat = []
    try:
        if kind == "zmq":
            import zmq

            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.connect(addr)
            for i in range(calls):
                body = M.encode(M.Lookup(keys[(i * batch) % (n - batch):][:batch], lease=True))
                t = time.perf_counter()
                s.send_multipart([i.to_bytes(8, "little"), body])
                _, rep = s.recv_multipart()
                M.decode_result(M.decode_result(rep, M.Reply).result, M.RESULT_TYPES[M.Lookup])
                lat.append(time.perf_counter() - t)
            s.send_multipart([b"x", b"quit"])
            s.close(0)
        else:
            if kind == "unix":
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(addr)
            else:
                host, port = addr.rsplit(":", 1)
                s = socket.create_connection((host, int(port)))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            f = s.makefile("rb", buffering=1 << 16)
            for i in range(calls):
                body = M.encode(M.Lookup(keys[(i * batch) % (n - batch):][:batch], lease=True))
                t = time.perf_counter()
                s.sendall(_LEN.pack(len(body)) + body)
                rep = f.read(_LEN.unpack(f.read(4))[0])
                M.decode_result(M.decode_result(rep, M.Reply).result, M.RESULT_TYPES[M.Lookup])
                lat.append(time.perf_counter() - t)
            s.close()
    finally:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return {"carrier": kind, "batch": batch, "calls": calls, "p50_us": _pct(lat, 0.5) * 1e6,
            "p90_us": _pct(lat, 0.9) * 1e6, "p99_us": _pct(lat, 0.99) * 1e6,
            "keys_per_s": calls * batch / sum(lat)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        kind, addr_file, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
        if kind == "zmq":
            serve_zmq(addr_file, n)
        else:
            serve_sock(kind, addr_file, n)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--objects", type=int, default=10000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = [run(kind, a.calls, b, a.objects) for b in (1, 64) for kind in ("zmq", "tcp", "unix")]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="master round trip by carrier (real Lookup+lease, real MasterState)")
    for col in ("carrier", "keys/call", "p50 µs", "p90 µs", "p99 µs", "keys/s"):
        t.add_column(col, justify="left" if col == "carrier" else "right")
    for r in rows:
        t.add_row(r["carrier"], str(r["batch"]), f"{r['p50_us']:.0f}", f"{r['p90_us']:.0f}", f"{r['p99_us']:.0f}",
                  f"{r['keys_per_s']:,.0f}")
    Console().print(t)


if __name__ == "__main__":
    main()
