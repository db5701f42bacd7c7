"""kvpool's vLLM adapter: the KV connector vLLM loads by name.

``kvpool.connector.vllm.connector.KVPoolConnector`` is vLLM's ``kv_connector`` (set
``kv_connector_module_path: kvpool.connector.vllm.connector``; docs/vllm.md). Its
scheduler side (:mod:`.scheduler`, :mod:`.plan`, :mod:`.handoffs`, :mod:`.accounting`)
looks blocks up and plans loads and saves; its worker side (:mod:`.worker`, with
:mod:`.loads`, :mod:`.layer_loads` and :mod:`.pages`) moves group blocks between vLLM's
KV cache pages and the store through :class:`kvpool.connector.client.KVPoolClient`.
:mod:`.plugin` registers the connector (vLLM's ``vllm.general_plugins`` entry point).

Imported only by vLLM (or tests that run it): nothing else in kvpool imports this
package, so the store and the client need no vLLM installed.
"""
