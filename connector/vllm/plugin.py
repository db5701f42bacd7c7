"""vLLM general plugin (entry point ``vllm.general_plugins: kvpool``): registers
``KVPoolConnector`` with vLLM's connector factory, so that
``--kv-transfer-config '{"kv_connector": "KVPoolConnector", ...}'`` works without
``kv_connector_module_path``. vLLM may call a plugin several times in one process and
loads plugins in every engine process; registering twice is a no-op.
"""

from __future__ import annotations

NAME = "KVPoolConnector"
MODULE = "kvpool.connector.vllm.connector"


def register() -> None:
    """Register the connector by name; no-op when vLLM is absent or already has it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
