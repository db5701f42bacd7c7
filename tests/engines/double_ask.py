"""A connector that asks kvpool's scheduler side twice per vLLM question, as a wrapper
connector (or a scheduler of another vLLM version) may: ``get_num_new_matched_tokens``
is called twice in a row and vLLM gets the first answer. Loaded by engine_proc.py's
engines as ``kv_connector_module_path: double_ask`` (its directory is on sys.path).
Every pair of answers that differ is logged as ``double_ask: answers differ``."""
from __future__ import annotations

import logging

from kvpool.connector.vllm.connector import KVPoolConnector

log = logging.getLogger("kvpool.vllm")


class DoubleAskConnector(KVPoolConnector):
    """KVPoolConnector whose every lookup is asked twice; vLLM keeps the first answer."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        first = super().get_num_new_matched_tokens(request, num_computed_tokens)
        second = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if first != second:
            log.error("double_ask: answers differ for request %s: %s then %s", request.request_id, first, second)
        return first
