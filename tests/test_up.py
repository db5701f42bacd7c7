"""`kvpool up` in the foreground: commands find it without flags; SIGINT tears it down."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil

from tests.conftest import wait_for


def test_up_status_and_clean_teardown(tmp_path):
    cluster = f"up-{uuid.uuid4().hex[:6]}"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cluster: {cluster}\nstorenodes:\n  - name: a\n    memory: 16MiB\n  - name: b\n    memory: 16MiB\n")
    p = subprocess.Popen([sys.executable, "-m", "kvpool.cli", "up", "--config", str(cfg)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        line = p.stdout.readline()  # the one-line ready message (flushed, not wrapped)
        assert f"cluster '{cluster}' up" in line and "Ctrl-C to stop" in line, line
        kids = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        assert len(kids) >= 4  # etcd, master, two store nodes
        base = [sys.executable, "-m", "kvpool.cli"]
        st = subprocess.run(base + ["status", "--json", "--cluster", cluster, "--config", str(cfg)],
                            capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stderr
        assert sorted(n["node_id"] for n in json.loads(st.stdout)["nodes"]) == ["a", "b"]
        src = tmp_path / "x"
        src.write_bytes(b"hello")
        r = subprocess.run(base + ["put", "k", str(src), "--config", str(cfg)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(base + ["get", "k", "--config", str(cfg)], capture_output=True, timeout=60)
        assert r.stdout == b"hello"
        # an engine's client credential, derived from the secret `up` made: commands prove it,
        # not the recorded secret, so operator requests are refused
        cred = tmp_path / "client.cred"
        r = subprocess.run(base + ["credential", "--role", "client", "-o", str(cred), "--cluster", cluster],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        env = {**os.environ, "KVPOOL_SECRET_FILE": str(cred)}
        r = subprocess.run(base + ["put", "k2", str(src), "--config", str(cfg)], capture_output=True, text=True,
                           timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        r = subprocess.run(base + ["settings", "--set", "lease_ttl=5", "--config", str(cfg)], capture_output=True,
                           text=True, timeout=60, env=env)
        assert r.returncode == 7 and "operator credential" in r.stderr, (r.returncode, r.stderr)
    finally:
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and "cluster stopped" in out
    for pid in kids:
        wait_for(lambda q=pid: not psutil.pid_exists(q) or psutil.Process(q).status() == "zombie", 10,
                 what=f"child {pid} gone")
    st = subprocess.run([sys.executable, "-m", "kvpool.cli", "status", "--config", str(cfg)], capture_output=True,
                        text=True, timeout=60)
    assert st.returncode == 2 and "kvpool up" in st.stderr
    assert not [f for f in os.listdir("/dev/shm") if "kvpool" in f]


def test_a_second_up_of_the_same_cluster_is_refused_and_a_stale_record_replaced(tmp_path):
    """`kvpool up` claims its cluster's local record before starting anything: a second one
    for the same name fails at once (exit 2, naming the first's pid) and leaves the first's
    record alone; a record left by a killed `kvpool up` is called gone by other commands and
    replaced by the next `up`."""
    from kvpool.cli.cluster import lock_run_dir
    from kvpool.cli.common import _remove_run_dir, state_file

    cluster = f"up2-{uuid.uuid4().hex[:6]}"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cluster: {cluster}\nstorenodes:\n  - name: a\n    memory: 16MiB\n")
    base = [sys.executable, "-m", "kvpool.cli"]
    rec = state_file(cluster)
    rec.parent.mkdir(parents=True, exist_ok=True)
    # a record whose pid is not visible here (another PID namespace) but whose run directory
    # is still locked by its owner: that cluster is up, so this one is refused, nothing deleted
    held = Path(tempfile.mkdtemp(prefix="kvpool-cluster-"))
    fd = lock_run_dir(held)
    rec.write_text(json.dumps({"pid": 2 ** 22 + 12345, "master": "tcp://127.0.0.1:1", "etcd": "",
                               "run_dir": str(held)}))
    try:
        r = subprocess.run(base + ["up", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "already up here" in r.stderr and held.is_dir()
    finally:
        os.close(fd)
        shutil.rmtree(held, ignore_errors=True)
    left = Path(tempfile.mkdtemp(prefix="kvpool-cluster-"))  # what a `kvpool up` killed with -9 leaves
    (left / "etcd.log").write_text("old")
    (left / "owner.lock").touch()  # its lock file, no longer held by anyone
    mine = tmp_path / "kvpool-cluster-not-a-run-dir"  # a recorded path elsewhere is never deleted
    mine.mkdir()
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"pid": 2 ** 22 + 12345, "run_dir": str(mine)}))
    _remove_run_dir(other)
    assert mine.is_dir()
    rec.write_text(json.dumps({"pid": 2 ** 22 + 12345, "master": "tcp://127.0.0.1:1", "etcd": "",
                               "run_dir": str(left)}))
    st = subprocess.run(base + ["status", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert st.returncode == 2 and "is gone" in st.stderr and "kvpool up" in st.stderr
    p = subprocess.Popen(base + ["up", "--config", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        assert f"cluster '{cluster}' up" in p.stdout.readline()
        assert not left.exists()  # the killed one's run directory went with its record
        assert Path(json.loads(rec.read_text())["run_dir"]).is_dir()
        second = subprocess.run(base + ["up", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and f"already up here (kvpool up, pid {p.pid})" in second.stderr
        assert json.loads(rec.read_text())["pid"] == p.pid
        st = subprocess.run(base + ["status", "--json", "--config", str(cfg)], capture_output=True, text=True,
                            timeout=60)
        assert st.returncode == 0 and [n["node_id"] for n in json.loads(st.stdout)["nodes"]] == ["a"]
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    assert not rec.exists()


def test_local_records_are_judged_by_their_run_dirs_lock(tmp_path):
    """Whether a recorded `kvpool up` still runs: its run directory's owner lock decides
    (held: up, whatever its pid looks like from here; free: gone, even if the pid now
    belongs to another process); a run dir without a lock file falls back to the pid.
    Probes share the lock, so a probe never makes a concurrent claim think the owner
    lives; odd records raise nothing."""
    import threading

    from kvpool.cli.cluster import RUN_DIR_LOCK, lock_run_dir, probe_run_dir
    from kvpool.cli.common import _recorded, _remove_run_dir

    dead = 2 ** 22 + 12345
    rec = tmp_path / "c.json"

    def record(pid, d):
        rec.write_text(json.dumps({"pid": pid, "run_dir": str(d)}))
        return rec

    d = Path(tempfile.mkdtemp(prefix="kvpool-cluster-"))
    try:
        fd = lock_run_dir(d)
        assert _recorded(record(dead, d)) is not None  # pid invisible, lock held: up
        assert _remove_run_dir(rec) is False and d.is_dir()
        os.close(fd)
        assert _recorded(record(os.getpid(), d)) is None  # a live pid, but the lock is free: gone
        state, shared = probe_run_dir(d)
        state2, other = probe_run_dir(d)
        assert state == state2 == "free"  # probes do not block each other
        os.close(other)
        threading.Timer(0.05, os.close, [shared]).start()
        assert _remove_run_dir(rec) is True and not d.exists()  # waited out the probe, then removed
        d.mkdir()  # no lock file (a run dir from before the lock): the pid decides
        assert _recorded(record(os.getpid(), d)) is not None and _recorded(record(dead, d)) is None
        (d / RUN_DIR_LOCK).mkdir()  # not a regular file: no lock, the pid decides
        assert probe_run_dir(d) == ("none", None) and _recorded(record(dead, d)) is None
        assert _remove_run_dir(record(dead, d)) is True and not d.exists()
        for odd in ({"pid": 1e30, "run_dir": str(d)}, {"pid": "x"}, [1, 2], {"pid": dead, "run_dir": 7}):
            rec.write_text(json.dumps(odd))
            assert _recorded(rec) is None
    finally:
        shutil.rmtree(d, ignore_errors=True)
