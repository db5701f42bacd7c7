"""Layer-wise loads (connector/vllm/layer_loads.py): a layer's wait ends when that layer is
written, not the whole load; a lapsed deadline cancels the step and no copy runs after
the cancel returns. Real threads, no sockets."""
import threading
import time

from kvpool.connector.vllm.layer_loads import LayerLoads

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def test_each_wait_ends_when_its_own_layer_is_written():
    ll = LayerLoads(LAYERS, time.monotonic() + 30)
    gate = threading.Event()
    written: list[str] = []

    def loader():
        for i, name in enumerate(LAYERS):
            if i == 2:
                assert gate.wait(30)  # layers 2 and 3 are held back until the forward has used 0 and 1
            ll.scatter(name, lambda name=name: written.append(name))
        ll.finish()

    t = threading.Thread(target=loader)
    t.start()
    assert ll.wait(LAYERS[0]) and ll.wait(LAYERS[1])
    assert written == LAYERS[:2] and not ll.ready[LAYERS[2]].is_set()
    gate.set()
    assert ll.wait(LAYERS[2]) and ll.wait(LAYERS[3])
    t.join(30)
    assert written == LAYERS and not ll.cancelled
    assert ll.wait("model.layers.9.mlp")  # a layer the loads do not write: no wait


def test_a_lapsed_deadline_cancels_and_no_copy_runs_after_the_cancel():
    ll = LayerLoads(LAYERS, time.monotonic() + 0.2)
    in_copy, release = threading.Event(), threading.Event()
    written: list[str] = []

    def slow_copy():
        in_copy.set()
        assert release.wait(30)
        written.append(LAYERS[0])

    def loader():
        ll.scatter(LAYERS[0], slow_copy)
        for name in LAYERS[1:]:
            ll.scatter(name, lambda name=name: written.append(name))
        ll.finish()

    t = threading.Thread(target=loader)
    t.start()
    assert in_copy.wait(30)
    t0 = time.monotonic()
    threading.Timer(0.5, release.set).start()
    assert not ll.wait(LAYERS[1])  # the deadline lapsed: cancelled, after the running copy ended
    assert ll.cancelled and written == [LAYERS[0]] and time.monotonic() - t0 >= 0.4
    t.join(30)
    assert written == [LAYERS[0]]  # the loader skipped every later layer
    assert not ll.wait(LAYERS[3]) and ll.waited_s > 0


def test_a_failed_loader_releases_every_waiter():
    ll = LayerLoads(LAYERS, time.monotonic() + 30)

    def loader():
        try:
            ll.scatter(LAYERS[0], lambda: None)
            raise RuntimeError("fetch failed")
        except RuntimeError:
            ll.cancel()
        finally:
            ll.finish()

    threading.Thread(target=loader).start()
    t0 = time.monotonic()
    assert not ll.wait(LAYERS[3])
    assert time.monotonic() - t0 < 10
