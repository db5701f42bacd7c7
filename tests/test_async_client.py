"""The client inside asyncio programs: built and used from a running loop (etcd
bootstrap included), and the awaitable facade for proxies and async schedulers."""
import asyncio

from kvpool.connector.aclient import AsyncKVPoolClient
from kvpool.connector.client import KVPoolClient


def test_client_built_inside_a_running_loop_follows_etcd(cluster):
    async def main():
        # the etcd bootstrap used to call asyncio.run() and fail inside a running loop
        with KVPoolClient(etcd=cluster.etcd_endpoint, cluster=cluster.cfg.cluster) as c:
            c.put("aio/blocking", b"x" * 100)
            return c.get("aio/blocking")

    assert asyncio.run(main()) == b"x" * 100


def test_async_facade_runs_calls_off_the_loop(cluster):
    async def main():
        async with AsyncKVPoolClient(etcd=cluster.etcd_endpoint, cluster=cluster.cfg.cluster) as c:
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.create_task(ticker())
            assert await c.put("aio/k", b"v" * 4096)
            got, found = await asyncio.gather(c.get("aio/k"), c.exists_batch(["aio/k", "aio/none"]))
            t.cancel()
            return got, found, ticks

    got, found, ticks = asyncio.run(main())
    assert got == b"v" * 4096 and found == [True, False]
    assert ticks > 0  # the loop kept running while the calls waited on the network
