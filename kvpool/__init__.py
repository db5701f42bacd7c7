"""kvpool: a distributed KV-cache store for LLM inference.

The public API, imported lazily so that ``import kvpool.master`` or ``kvpool.storenode``
stays free of the client's and vLLM's dependencies:

- :class:`KVPoolClient` / :class:`AsyncKVPoolClient`: put, get, pin and hand-off by key
  (``kvpool.client``);
- :class:`LayoutSpec` / :class:`TensorSpec`: the layout a group block is tagged with;
- :class:`PutResult`: what a put landed (replicas written vs asked);
- the typed errors (:class:`KVPoolError` and its subclasses, ``kvpool.errors``).

Subpackages: ``kvpool.protocol`` (wire contract), ``kvpool.master``, ``kvpool.storenode``,
``kvpool.connector`` (the client library; ``kvpool.connector.vllm``, the vLLM adapter, whose
``kvpool.connector.vllm.connector`` holds ``KVPoolConnector``; ``kvpool.connector.demo_engine``,
the demo's engine), ``kvpool.cli`` (the ``kvpool`` command), ``kvpool.configs`` (the default
config, data only).
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "KVPoolClient": "kvpool.connector.client",
    "PutResult": "kvpool.connector.client",
    "AsyncKVPoolClient": "kvpool.connector.aclient",
    "LayoutSpec": "kvpool.protocol.layout",
    "TensorSpec": "kvpool.protocol.layout",
}
_ERRORS = ("KVPoolError", "NotFound", "InvalidKey", "InvalidRequest", "LayoutMismatch", "LeaseExpired", "Pinned",
           "NoSpace", "ObjectTooLarge", "NodeUnavailable", "ChecksumMismatch", "PutRevoked", "HandoffNotFound",
           "HandoffExpired", "HandoffLoadFailed", "NotLeader", "Timeout", "ConfigError", "EtcdUnavailable",
           "EtcdFull")
_EXPORTS.update({name: "kvpool.protocol.errors" for name in _ERRORS})

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    value = getattr(import_module(mod), name)
    globals()[name] = value
    return value
