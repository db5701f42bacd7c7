"""The demo engine: a reference inference engine for `kvpool demo` and the tests.

A small deterministic torch decoder (:mod:`.model`) with a block-paged KV cache, a
byte-level tokenizer and public-domain prompts (:mod:`.tokenizer`), and the engine
worker process used by ``kvpool demo`` (:mod:`.worker`). No store is needed to use
the model; the worker talks to a running cluster through ``connector.blocks``.
"""
from kvpool.connector.demo_engine.model import ModelConfig, PagedKVCache, ReferenceModel
from kvpool.connector.demo_engine.tokenizer import decode, demo_requests, encode, load_text, system_prompt

__all__ = ["ModelConfig", "PagedKVCache", "ReferenceModel", "decode", "demo_requests", "encode",
           "load_text", "system_prompt"]
