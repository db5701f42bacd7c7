"""The connection rules every server port shares (protocol/admission.py), as pure state;
the same rules on real ports are attacked in test_limits.py, test_auth.py and
test_port_attacks.py."""
from kvpool.protocol import auth
from kvpool.protocol.admission import Admission, not_tls, overloaded
from kvpool.protocol.errors import Overloaded


def test_at_the_cap_the_oldest_handshake_makes_room_else_the_new_one_is_refused():
    a: Admission[str] = Admission(max_conns=3, handshake_s=5.0)
    assert a.admit(2) == (True, None)
    a.start("slow-1", 0.0)
    a.start("slow-2", 1.0)
    a.start("honest", 2.0)
    a.done("honest")  # authenticated: no longer a candidate
    assert a.admit(3) == (True, "slow-1") and a.admit(3) == (True, "slow-2")
    assert a.admit(3) == (False, None)  # none left in a handshake
    assert a.refusals["handshake_evicted"] == 2 and a.refusals["max_conns"] == 1


def test_handshakes_expire_in_accept_order():
    a: Admission[int] = Admission(max_conns=10, handshake_s=auth.HANDSHAKE_S)
    for i in range(4):
        a.start(i, float(i))
    a.done(1)
    assert a.deadline(2) == 2.0 + auth.HANDSHAKE_S
    assert a.expired(2.0 + auth.HANDSHAKE_S) == [0, 2] and a.handshaking() == 1
    assert a.expired(100.0) == [3] and a.refusals["handshake_timeout"] == 3 and a.deadline(3) is None


def test_refusals_name_their_server_and_fix():
    err = overloaded("the master", 7)
    assert isinstance(err, Overloaded) and err.fields["max_conns"] == 7 and "security.max_conns" in err.message
    assert b"does not serve TLS" in not_tls("master") and b"security.tls_cert" in not_tls("master")
