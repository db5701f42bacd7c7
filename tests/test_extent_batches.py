"""The store node's batch forms of the extent table (claim_many, settled_many, commit_many)
decide exactly as the single calls made one after another (storenode/extents.py)."""
from __future__ import annotations

import random

import pytest

from kvpool.protocol import errors as E
from kvpool.protocol.messages import ExtentEntry
from kvpool.protocol.terms import gen_term
from kvpool.storenode.extents import ExtentTable

KiB = 1 << 10


def _state(t: ExtentTable, names: dict[int, str]) -> tuple:
    """Everything the table decides on, owners named (they compare by identity)."""
    claims = {k: (size, names[id(o)]) for k, (size, o) in t._claims.items()}
    return (dict(t._rows), dict(t._floor), list(t._offs), claims, list(t._coffs), dict(t._claim_gen),
            t.max_gen, t._max_claim, t._max_size)


def _single_claims(t: ExtentTable, items, owner) -> list:
    out = []
    for off, size, gen in items:
        try:
            t.claim(off, size, gen, owner)
            out.append(None)
        except E.KVPoolError as e:
            out.append(e)
    return out


def _single_commits(t: ExtentTable, rows, writer) -> list:
    out = []
    for row in rows:
        try:
            if writer is not None:  # as the data server checks a writer's copy
                t.check_bounds(row.offset, row.size)
                t.check_write(row.offset, row.gen)
            t.commit(row, writer=writer)
            out.append(None)
        except E.KVPoolError as e:
            out.append(e)
    return out


def _verdicts(errs) -> list:
    return [e if e is None or isinstance(e, str) else (type(e), str(e)) for e in errs]


def _table() -> tuple[ExtentTable, object, object, dict[int, str]]:
    t = ExtentTable(64 * KiB)
    a, b = object(), object()
    return t, a, b, {id(a): "a", id(b): "b"}


def test_claim_many_gives_the_verdicts_of_single_claims():
    t, a, b, _ = _table()
    t.commit(ExtentEntry("new", 8 * KiB, 4 * KiB, 9, 1, None, True))  # a newer grant's row
    t.claim(16 * KiB, 4 * KiB, 5, b)  # another writer's live claim (older grant)
    t.claim(24 * KiB, 4 * KiB, 11, b)  # ... and a newer one
    t.free(32 * KiB, 6)  # the master freed generation 6 there
    t.claim(40 * KiB, 4 * KiB, 7, b)  # the same grant, held by b
    items = [(0, 4 * KiB, 8),  # free memory: claimed
             (8 * KiB, 4 * KiB, 8),  # under a newer row: PutRevoked
             (18 * KiB, 4 * KiB, 8),  # overlaps b's older claim: ExtentBusy
             (24 * KiB, 4 * KiB, 8),  # overlaps b's newer claim: PutRevoked
             (32 * KiB, 4 * KiB, 6),  # freed: PutRevoked
             (40 * KiB, 4 * KiB, 7),  # held by another writer: ExtentBusy
             (60 * KiB, 8 * KiB, 8),  # outside the segment: InvalidRequest
             (2 * KiB, 4 * KiB, 8),  # overlaps the first item's claim (same batch): ExtentBusy
             (0, 4 * KiB, 8),  # the first item again, same owner: accepted
             (48 * KiB, 0, 8)]  # an empty extent still owns its offset
    errs = t.claim_many(items, a)
    assert [type(e) if e else None for e in errs] == [
        None, E.PutRevoked, E.ExtentBusy, E.PutRevoked, E.PutRevoked, E.ExtentBusy, E.InvalidRequest,
        E.ExtentBusy, None, None]
    assert t.claims(a) == 2
    t.term = gen_term(9) + 1  # a newer leader: grants of the older term are refused
    assert [type(e) for e in t.claim_many([(52 * KiB, KiB, 9)], a)] == [E.StaleTerm]


@pytest.mark.parametrize("seed", range(30))
def test_batch_forms_match_single_calls_on_random_histories(seed):
    """Two tables fed the same random history, one through single calls, one through the
    batch forms: the same verdicts and the same table after every step."""
    rnd = random.Random(seed)
    (s, sa, sb, snames), (m, ma, mb, mnames) = _table(), _table()
    gen = 1

    def extent():
        off = rnd.randrange(0, 68) * KiB  # some past the end
        return off, rnd.choice([0, KiB, 2 * KiB, 4 * KiB, 9 * KiB])

    for _ in range(120):
        kind = rnd.random()
        if kind < 0.35:  # a batch of claims by one writer
            owner = rnd.randrange(2)
            items = []
            for _ in range(rnd.randrange(1, 8)):
                off, size = extent()
                g = rnd.choice([gen, max(1, gen - rnd.randrange(4))])
                items.append((off, size, g))
                gen += rnd.random() < 0.5
            assert _verdicts(_single_claims(s, items, (sa, sb)[owner])) == _verdicts(
                m.claim_many(items, (ma, mb)[owner]))
        elif kind < 0.7:  # commits: the master's (no writer) or a writer's copies
            owner = rnd.randrange(3)
            rows = []
            for _ in range(rnd.randrange(1, 8)):
                if rnd.random() < 0.6 and s._claims:
                    (off, g), (size, _) = rnd.choice(sorted(s._claims.items(), key=lambda kv: kv[0]))
                else:
                    off, size = extent()
                    g = max(1, gen - rnd.randrange(3))
                rows.append(ExtentEntry(f"k{off}", off, size, g, rnd.randrange(2), None, True))
            if owner < 2 and rnd.random() < 0.5 and len({r.offset for r in rows}) == len(rows):
                # the writer's path, as the data server takes a batch naming each offset once:
                # one row after the other (settled? else checked and committed) against every
                # settled check first, then every commit
                single = []
                for row in rows:
                    if s.settled(row.offset, row.gen, (sa, sb)[owner]):
                        single.append("settled")
                    else:
                        single += _single_commits(s, [row], (sa, sb)[owner])
                done = m.settled_many([(r.offset, r.gen) for r in rows], (ma, mb)[owner])
                errs = iter(m.commit_many([r for r, d in zip(rows, done) if not d], writer=(ma, mb)[owner]))
                batch = ["settled" if d else next(errs) for d in done]
                assert _verdicts(single) == _verdicts(batch)
                assert _state(s, snames) == _state(m, mnames)
                continue
            sw = None if owner == 2 else (sa, sb)[owner]
            mw = None if owner == 2 else (ma, mb)[owner]
            if sw is None and rnd.random() < 0.5:  # the master's notice stops at its first bad row
                single, batch = [], m.commit_many(rows, until_error=True)
                for row in rows:
                    try:
                        s.commit(row)
                        single.append(None)
                    except E.KVPoolError as e:
                        single.append(e)
                        break
                assert _verdicts(single) == _verdicts(batch)
            else:
                assert _verdicts(_single_commits(s, rows, sw)) == _verdicts(m.commit_many(rows, writer=mw))
        elif kind < 0.85:  # the master frees
            off, _ = extent()
            g = max(1, gen - rnd.randrange(4))
            s.free(off, g)
            m.free(off, g)
        else:  # a writer ends a claim
            if s._claims:
                (off, g), (_, o) = rnd.choice(sorted(s._claims.items(), key=lambda kv: kv[0]))
                name = snames[id(o)]
                s.release(off, g, o)
                m.release(off, g, ma if name == "a" else mb)
        assert _state(s, snames) == _state(m, mnames)


def test_commit_many_checks_a_writers_copy_and_ends_claims():
    t, a, b, _ = _table()
    t.claim(0, 4 * KiB, 3, a)
    t.claim(8 * KiB, 4 * KiB, 4, a)
    t.free(16 * KiB, 5)
    rows = [ExtentEntry("x", 0, 4 * KiB, 3, 1, None, True),
            ExtentEntry("y", 16 * KiB, 4 * KiB, 5, 1, None, True),  # freed: PutRevoked, nothing recorded
            ExtentEntry("z", 8 * KiB, 4 * KiB, 4, 1, None, True)]
    errs = t.commit_many(rows, writer=b)  # another writer's copy: recorded, but a's claims stay
    assert [type(e) if e else None for e in errs] == [None, E.PutRevoked, None]
    assert t.claims(a) == 2 and {r.key for r in t.committed()} == {"x", "z"}
    assert t.commit_many([rows[0]], writer=a) == [None]  # a's copy, committed already: ends a's claim
    assert t.claims(a) == 1
    same = ExtentEntry("z", 8 * KiB, 4 * KiB, 4, 1, None, True)
    assert t.commit_many([same]) == [None]  # the master's notice of the same row: the claim ends still
    assert t.claims(a) == 0 and t.check_read(8 * KiB, 4 * KiB, 4).key == "z"
    fixed = ExtentEntry("z", 8 * KiB, 4 * KiB, 4, 2, None, True)  # the master's row differs: it replaces
    assert t.commit_many([fixed]) == [None] and t.check_read(8 * KiB, 4 * KiB, 4).checksum == 2


def test_commit_many_until_error_stops_at_the_first_refusal():
    t, _, _, _ = _table()
    rows = [ExtentEntry("a", 0, KiB, 1, 0, None, True), ExtentEntry("out", 64 * KiB, KiB, 1, 0, None, True),
            ExtentEntry("b", 4 * KiB, KiB, 1, 0, None, True)]
    errs = t.commit_many(rows, until_error=True)
    assert len(errs) == 2 and errs[0] is None and isinstance(errs[1], E.InvalidRequest)
    assert [r.key for r in t.committed()] == ["a"]
    assert [type(e) if e else None for e in t.commit_many(rows)] == [None, E.InvalidRequest, None]
