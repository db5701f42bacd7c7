"""Fixtures of the vLLM tier (the repository's tests/conftest.py provides ``cluster``)."""
import pytest


@pytest.fixture(scope="module")
def kv(cluster):
    """A client of the module's cluster, shared by its tests."""
    c = cluster.client()
    yield c
    c.close()
