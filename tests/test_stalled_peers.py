"""Authenticated peers that send frames slowly cannot hold a store node's data workers
(storenode/connpool.py, "patience"): with the default 30 s frame deadline and more
stalled connections than workers, an honest get still gets a worker, on real processes,
over plain TCP and over TLS (where a peer may also stop inside a TLS record)."""
from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

from kvpool.cli.cluster import LocalCluster
from kvpool.protocol import transport
from kvpool.protocol.config import load_config
from tests.test_auth import _descs, certs  # noqa: F401 - certs: a fixture


def _cfg(security: dict | None = None):
    return load_config(None, {"storenodes": [{"name": "node-0", "memory": "64MiB", "data_workers": 4}],
                              "master": {"replicas": 1}, "security": security or {}}, environ={})


def _stall(sock: socket.socket, how: str, stop: threading.Event) -> None:
    """Hold ``sock`` mid-frame: two bytes of a header, or a header then a byte at a time."""
    try:
        if how == "header":
            sock.sendall(b"\x00\x01")  # a length's first half, then nothing
            stop.wait(60)
            return
        if how == "record":  # under TLS: a record header announcing 64 bytes, then 10 of them
            os.write(sock.fileno(), b"\x17\x03\x03\x00\x40" + b"x" * 10)
            stop.wait(60)
            return
        sock.sendall(struct.pack("<I", 1000))  # a 1000-byte header, sent a byte every 0.2 s
        while not stop.wait(0.2):
            sock.sendall(b"\x90")
    except OSError:
        pass  # closed by the node


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_stalled_and_trickling_frames_do_not_starve_an_honest_get(tls, request):
    security = {}
    if tls:
        certs = request.getfixturevalue("certs")
        security = {"tls_cert": str(certs / "server.pem"), "tls_key": str(certs / "server.pem"),
                    "tls_ca": str(certs / "ca.pem")}
    hows = ("header", "trickle", "record") if tls else ("header", "trickle")
    with LocalCluster(_cfg(security), secure=True) as lc:
        data = b"v" * 65536
        with lc.client(transport="tcp") as c:
            assert c.put("honest", data)
        d = _descs(lc)[0]
        stop = threading.Event()
        socks = [transport.connect(d.data_addr, 5.0, lc.security) for _ in range(12)]  # 3x the workers
        threads = [threading.Thread(target=_stall, args=(s, hows[i % len(hows)], stop), daemon=True)
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
