"""Connections outlive the threads that opened them (connector/parking.py): a caller that
runs each request on a fresh thread reuses the master connection and the store-node
streams a finished thread left, instead of closing them and leaving a TIME_WAIT socket
per connection on this host. Real master and store node over TCP."""
from __future__ import annotations

import threading

import psutil

THREADS = 100


def _time_wait_to(ports: set[int]) -> int:
    return sum(1 for c in psutil.net_connections(kind="tcp")
               if c.status == psutil.CONN_TIME_WAIT and c.raddr and c.raddr.port in ports)


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def test_short_lived_threads_leave_no_time_wait_sockets(make_cluster):
    lc = make_cluster(nodes=1, memory="16MiB")
    with lc.client(host_id="another-host", transport="tcp") as c:  # TCP to both, as from another host
        assert c.put("reuse/x", b"x" * 4096) is True
        ports = {_port(lc.master_addr), *(_port(i.data_addr) for i in c.lookup(["reuse/x"])[0].replicas)}
        got: list = []
        before = _time_wait_to(ports)
        for i in range(THREADS):
            t = threading.Thread(target=lambda i=i: got.append((c.get("reuse/x"), c.put(f"reuse/{i}", b"y"))))
            t.start()
            t.join()
        assert got == [(b"x" * 4096, True)] * THREADS
        left = _time_wait_to(ports) - before
        assert left < THREADS // 10, f"{left} TIME_WAIT sockets after {THREADS} one-call threads"

