"""Fixtures of the vLLM tier (the repository's tests/conftest.py provides ``cluster``)."""
import pytest


@pytest.fixture(scope="module")
def kv(cluster):
    """A client of the module's cluster, shared by its tests; its master calls wait out a
    re-election (engines loading the machine may cost the master its etcd lease)."""
    c = cluster.client(rpc_timeout_s=60)
    yield c
    c.close()
