"""Authenticated peers that send frames slowly cannot hold a store node's data workers
(storenode/connpool.py, "patience"): with the default 30 s frame deadline and more
stalled connections than workers, an honest get still gets a worker, on real processes."""
from __future__ import annotations

import socket
import struct
import threading

from kvpool.cli.cluster import LocalCluster
from kvpool.protocol import transport
from kvpool.protocol.config import load_config
from tests.test_auth import _descs


def _cfg():
    return load_config(None, {"storenodes": [{"name": "node-0", "memory": "64MiB", "data_workers": 4}],
                              "master": {"replicas": 1}}, environ={})


def _stall(sock: socket.socket, how: str, stop: threading.Event) -> None:
    """Hold ``sock`` mid-frame: two bytes of a header, or a header then a byte at a time."""
    try:
        if how == "header":
            sock.sendall(b"\x00\x01")  # a length's first half, then nothing
            stop.wait(60)
            return
        sock.sendall(struct.pack("<I", 1000))  # a 1000-byte header, sent a byte every 0.2 s
        while not stop.wait(0.2):
            sock.sendall(b"\x90")
    except OSError:
        pass  # closed by the node


def test_stalled_and_trickling_frames_do_not_starve_an_honest_get():
    with LocalCluster(_cfg(), secure=True) as lc:
        data = b"v" * 65536
        with lc.client(transport="tcp") as c:
            assert c.put("honest", data)
        d = _descs(lc)[0]
        stop = threading.Event()
        socks = [transport.connect(d.data_addr, 5.0, lc.security) for _ in range(12)]  # 3x the workers
        threads = [threading.Thread(target=_stall, args=(s, "header" if i % 2 else "trickle", stop), daemon=True)
                   for i, s in enumerate(socks)]
        for t in threads:
            t.start()
        try:
            # a stalled frame holds its worker up to the 30 s frame deadline unless others wait;
            # the get below must be served within its own 10 s deadline, every round
            with lc.client(transport="tcp", rpc_timeout_s=10) as c:
                for _ in range(3):
                    assert c.get("honest") == data
        finally:
            stop.set()
            for s in socks:
                s.close()
