"""The master's chains of durable etcd writes, driven with plain futures (no etcd)."""
from concurrent.futures import Future

import pytest

from kvpool.master import durable
from kvpool.protocol import errors as E


class Harness:
    def __init__(self) -> None:
        self.started: list[tuple[str, Future]] = []
        self.answers: dict[str, object] = {}
        self.retry: list[str] = []
        self.down = False
        self.w = durable.DurableWrites(self.submit, self.answer, self.retry.append)

    def submit(self, coro_fn, what, check):
        if self.down and check:
            raise E.EtcdUnavailable("etcd is down")
        f = Future()
        self.started.append((coro_fn, f))
        return f

    def answer(self, p, result, error):
        if p.client is not None and not p.answered:
            p.answered = True
            self.answers[p.client] = error if error is not None else result

    def write(self, name, key, then, undo=None):
        p = self.w.write(key, name, "pins", then, undo)
        p.client = name
        return p


def test_writes_to_one_record_apply_in_call_order_and_only_once_landed():
    h, state = Harness(), []
    h.write("pin", "k", lambda: state.append("pinned"))
    h.write("unpin", "k", lambda: state.append("unpinned"))
    assert [n for n, _ in h.started] == ["pin"]  # the second waits for the first
    h.w.advance()
    assert state == [] and h.answers == {}
    h.started[0][1].set_result(None)
    h.w.advance()
    assert state == ["pinned"] and [n for n, _ in h.started] == ["pin", "unpin"]
    h.started[1][1].set_result(None)
    h.w.advance()
    assert state == ["pinned", "unpinned"] and h.answers == {"pin": None, "unpin": None}
    assert not h.w


def test_refused_then_runs_undo_and_failed_write_changes_nothing():
    h, undone, state = Harness(), [], []
    h.write("pin", "k", lambda: (_ for _ in ()).throw(E.NotFound("gone")), undo=lambda: undone.append("k"))
    h.write("pin2", "j", lambda: state.append("x"))
    h.started[0][1].set_result(None)
    h.started[1][1].set_exception(RuntimeError("etcd said no"))
    h.w.advance()
    assert isinstance(h.answers["pin"], E.NotFound) and undone == ["k"]
    assert isinstance(h.answers["pin2"], E.EtcdUnavailable) and "nothing was changed" in str(h.answers["pin2"])
    assert state == []


def test_slow_write_is_outcome_unknown_then_applied_and_queued_ones_are_dropped(monkeypatch):
    h, state = Harness(), []
    first = h.write("pin", "k", lambda: state.append("pinned"))
    h.write("unpin", "k", lambda: state.append("unpinned"))
    clock = [first.deadline + 1]
    monkeypatch.setattr(durable.time, "monotonic", lambda: clock[0])
    h.w.advance()
    assert "outcome is unknown" in str(h.answers["pin"])
    assert "nothing was changed" in str(h.answers["unpin"])  # never started
    h.started[0][1].set_result(None)  # etcd answers late
    h.w.advance()
    assert state == ["pinned"] and len(h.started) == 1 and not h.w


def test_etcd_known_down_fails_at_once_and_background_deletes_retry():
    h = Harness()
    h.down = True
    with pytest.raises(E.EtcdUnavailable):
        h.w.write("k", "pin", "pins", lambda: None)
    h.down = False
    h.write("pin", "k", lambda: None)
    assert h.w.after("k", "delete", "etcd records") and not h.w.after("other", "delete", "etcd records")
    h.started[0][1].set_result(None)
    h.w.advance()
    h.started[1][1].set_exception(RuntimeError("etcd went away"))
    h.w.advance()
    assert h.retry == ["k"] and not h.w


def test_a_background_delete_waits_behind_a_stuck_write_and_is_never_dropped(monkeypatch):
    h = Harness()
    first = h.write("pin", "k", lambda: None)
    assert h.w.after("k", "delete", "etcd records")
    monkeypatch.setattr(durable.time, "monotonic", lambda: first.deadline + 10)
    h.w.advance()  # the pin is answered "outcome unknown"; the delete still waits its turn
    h.started[0][1].set_result(None)
    h.w.advance()
    assert [n for n, _ in h.started] == ["pin", "delete"]
