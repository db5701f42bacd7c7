"""One engine step's layer-wise loads: loads that feed the step's own forward pass.

When the scheduler answers ``load_async=False`` for a hit, vLLM runs the request in the
same step as its load: it calls ``start_load_kv`` before the forward pass, and every
attention layer calls ``wait_for_layer_load(layer)`` before it reads its KV cache
(``vllm/model_executor/layers/attention/kv_transfer_utils.py``). For a device cache the
loader thread fetches every block of the step into staging (whole objects, each checked
against its checksum and layout before any byte reaches the cache), then scatters them
into the cache one layer at a time, in the model's order, marking each layer ready as it
goes: layer i computes while the loader writes layers i+1, i+2, ...; and while the forward
waits on a layer the loader runs without competing for the interpreter. A host cache is
filled block by block straight from the store's segment (one copy, not two), and every
layer is ready when the fetch ends; its writes go through :attr:`LayerLoads.lock` as a
:class:`~connector.scatter_out.ScatterOut` gate.

Every wait has the step's deadline. When it lapses the step is cancelled: a layer's
scatter (or a block's copy) already running is waited out (:attr:`LayerLoads.lock`),
none starts after, and
the worker reports every block of the step as failed, so vLLM recomputes them (its
``kv_load_failure_policy``). No block is written after the step that loads it ends.

Pure threading state, no I/O: the copies are the caller's.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from time import monotonic


class LayerLoads:
    """Readiness of each layer for one step's layer-wise loads.

    ``layers``: the names of the layers the loads write (``wait`` on any other layer
    returns at once); ``deadline``: the monotonic time (seconds) after which the forward
    pass stops waiting and the step is cancelled."""

    def __init__(self, layers: Iterable[str], deadline: float) -> None:
        self.ready = {name: threading.Event() for name in layers}
        self.lock = threading.Lock()  # held by the loader for one layer's copies
        self.cancelled = False
        self.deadline = deadline
        self.waited_s = 0.0  # seconds the forward pass spent blocked in wait()

    def scatter(self, layer: str, copy: Callable[[], None]) -> bool:
        """Loader thread: run ``copy`` (the writes of ``layer``'s pages) unless the step
        was cancelled, then mark the layer ready. Returns whether ``copy`` ran."""
        with self.lock:
            ran = not self.cancelled
            if ran:
                copy()
        self.ready[layer].set()
        return ran

    def finish(self) -> None:
        """Loader thread, when it is done (or failed): release every waiter."""
        for ev in self.ready.values():
            ev.set()

    def wait(self, layer: str) -> bool:
        """Forward pass: block until ``layer`` is written or the deadline lapses (then the
        step is cancelled). Returns whether the layer's pages are in place."""
        ev = self.ready.get(layer)
        if ev is None:
            return not self.cancelled
        t0 = monotonic()
        ok = ev.wait(max(0.0, self.deadline - t0))
        self.waited_s += monotonic() - t0
        if not ok:
            self.cancel()
        return ok and not self.cancelled

    def cancel(self) -> None:
        """Stop the step's loads: returns once no layer's copy is running, and none starts
        after."""
        self.cancelled = True  # read by the loader under the lock before each copy
        with self.lock:  # a copy that started before is waited out
            pass
