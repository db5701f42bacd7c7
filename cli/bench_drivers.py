"""The systems ``kvpool bench`` measures, as seen from one worker process.

A driver wraps one client of one system and offers the same calls to the phase loop of
:mod:`cli.bench_worker`: ``put(keys, bufs)`` and ``get(keys, bufs)`` for one batch, their
checks (``check_put``, ``check_get``: counts of errors, misses and puts that stored
nothing), ``remove(keys)`` after a round and ``warm(prefix)`` before the clock starts.
``uses_ptrs``: the driver takes buffer addresses (ints) instead of buffer views.

* kvpool: ``KVPoolClient.put_batch_results`` (its ``stored`` flag tells a fresh put from a
  no-op on an existing key) and ``get_into_batch`` into the worker's buffers.
* redis: SET/GET for one object, MSET/MGET (one pipelined command) for a batch.
* Mooncake Store, two client paths: ``py`` takes Python buffers (``put``/``put_batch``,
  ``get``/``get_batch``, which return new ``bytes``); ``reg`` moves bytes from and into
  buffers registered with Mooncake's transfer engine (``register_buffer``;
  ``put_from``/``batch_put_from``, ``get_into``/``batch_get_into``). Mooncake answers 0 per
  key for a stored object, and also for a put of a key it already holds (a no-op), so the
  worker's verification of the bytes read back is what catches a re-put there.
"""
from __future__ import annotations

from typing import Any

MC_OBJECT_NOT_FOUND = -704  # Mooncake Store's ErrorCode::OBJECT_NOT_FOUND


class KvpoolDriver:
    uses_ptrs = False
    returns_values = False

    def __init__(self, system: dict, master: str, streams: int) -> None:
        from kvpool.connector.client import KVPoolClient

        s = system["settings"]
        extra = {k: v for k, v in s.items() if v is not None and k in ("spin_wait_s", "reserve_bytes")}
        self.client = KVPoolClient(master, transport=system["transport"], streams_per_node=streams, **extra)
        self.replicas = 1

    def configure(self, size: int, batch: int, replicas: int) -> None:
        self.replicas = replicas

    def warm(self, prefix: str, src) -> None:
        """Open connections and map segments (every node) before the clock starts."""
        keys = [f"{prefix}/warm/{i}" for i in range(4)]
        data = bytes(src[:min(len(src), 1 << 16)])
        self.client.put_batch(keys, [data] * len(keys))
        self.client.get_into_batch(keys, [bytearray(len(data)) for _ in keys])
        self.client.remove_batch(keys, force=True)

    def put(self, keys: list[str], bufs: list) -> Any:
        return self.client.put_batch_results(keys, bufs, replicas=self.replicas)

    @staticmethod
    def check_put(res, n: int) -> tuple[int, int, str]:
        """(errors, puts of ``n`` keys that stored nothing without an error, first error)."""
        errs = [r.error for r in res if r.error is not None]
        stale = sum(1 for r in res if r.error is None and not r.stored)
        return len(errs), stale, (f"{type(errs[0]).__name__}: {errs[0]}" if errs else "")

    def get(self, keys: list[str], bufs: list) -> Any:
        return self.client.get_into_batch(keys, bufs)

    @staticmethod
    def check_get(res, size: int) -> tuple[int, int, str]:
        """(misses, errors, first error)."""
        misses = errors = 0
        first = ""
        for r in res:
            if r is None:
                misses += 1
            elif not isinstance(r, int) or r != size:
                errors += 1
                first = first or f"{type(r).__name__}: {r}"
        return misses, errors, first

    def remove(self, keys: list[str]) -> int:
        bad = 0
        for i in range(0, len(keys), 1024):
            bad += sum(e is not None for e in self.client.remove_batch(keys[i:i + 1024], force=True))
        return bad

    def close(self) -> None:
        self.client.close()


class RedisDriver:
    uses_ptrs = False
    returns_values = True

    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port)

    def configure(self, size: int, batch: int, replicas: int) -> None:
        pass

    def warm(self, prefix: str, src) -> None:
        self.r.ping()

    def put(self, keys: list[str], bufs: list) -> Any:
        if len(keys) == 1:
            return self.r.set(keys[0], bufs[0])
        return self.r.mset(dict(zip(keys, bufs)))

    @staticmethod
    def check_put(res, n: int) -> tuple[int, int, str]:
        return (0, 0, "") if res is True else (n, 0, f"redis answered {res!r}")

    def get(self, keys: list[str], bufs: list) -> Any:
        return [self.r.get(keys[0])] if len(keys) == 1 else self.r.mget(keys)

    @staticmethod
    def check_get(res, size: int) -> tuple[int, int, str]:
        misses = sum(v is None for v in res)
        errors = sum(v is not None and len(v) != size for v in res)
        return misses, errors, ("a value of the wrong size" if errors else "")

    def remove(self, keys: list[str]) -> int:
        for i in range(0, len(keys), 1024):
            self.r.delete(*keys[i:i + 1024])
        return 0

    def close(self) -> None:
        self.r.close()


class MooncakeClient:
    """One Mooncake Store client per worker process (global_segment_size 0: it stores
    nothing itself; the store processes of :mod:`cli.bench_peers` do), shared by both
    client paths, and the worker's buffers registered with its transfer engine."""

    def __init__(self, metadata_url: str, master_addr: str, local_buffer: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", metadata_url, 0, local_buffer, "tcp", "", master_addr)
        if rc != 0:
            raise RuntimeError(f"Mooncake client setup returned {rc} (master {master_addr})")
        self.registered: dict[int, int] = {}  # buffer address -> bytes

    def register(self, arrays: list) -> None:
        """Register these numpy arrays (and unregister those registered before)."""
        want = {a.ctypes.data: a.nbytes for a in arrays}
        for ptr in [p for p in self.registered if p not in want]:
            self.store.unregister_buffer(ptr)
            del self.registered[ptr]
        for ptr, n in want.items():
            if ptr not in self.registered:
                rc = self.store.register_buffer(ptr, n)
                if rc != 0:
                    raise RuntimeError(f"Mooncake register_buffer of {n} bytes returned {rc}")
                self.registered[ptr] = n

    def close(self) -> None:
        for ptr in list(self.registered):
            self.store.unregister_buffer(ptr)
        self.registered.clear()
        self.store.close()


class MooncakeDriver:
    returns_values = True

    def __init__(self, client: MooncakeClient, variant: str) -> None:
        self.mc = client
        self.s = client.store
        self.variant = variant
        self.uses_ptrs = variant == "reg"
        self.returns_values = variant == "py"
        self.size = 0
        self.sizes: list[int] = []
        self.cfg = None

    def configure(self, size: int, batch: int, replicas: int) -> None:
        from mooncake.store import ReplicateConfig

        self.size = size
        self.sizes = [size] * batch
        self.cfg = ReplicateConfig()
        self.cfg.replica_num = replicas

    def warm(self, prefix: str, src) -> None:
        keys = [f"{prefix}/warm/{i}" for i in range(2)]
        data = bytes(src[:min(len(src), 1 << 16)])
        self.s.put_batch(keys, [data, data], self.cfg)
        self.s.get_batch(keys)
        self.s.batch_remove(keys, True)

    def put(self, keys: list[str], bufs: list) -> Any:
        if self.variant == "reg":
            if len(keys) == 1:
                return self.s.put_from(keys[0], bufs[0], self.size, self.cfg)
            sizes = self.sizes if len(keys) == len(self.sizes) else self.sizes[:len(keys)]
            return self.s.batch_put_from(keys, bufs, sizes, self.cfg)
        if len(keys) == 1:
            return self.s.put(keys[0], bufs[0], self.cfg)
        return self.s.put_batch(keys, bufs, self.cfg)

    @staticmethod
    def check_put(res, n: int) -> tuple[int, int, str]:
        if isinstance(res, int):  # put and put_batch answer one code for all ``n`` keys
            return (0, 0, "") if res == 0 else (n, 0, f"Mooncake put answered {res}")
        bad = [c for c in res if c != 0]
        return len(bad), 0, (f"Mooncake put answered {bad[0]}" if bad else "")

    def get(self, keys: list[str], bufs: list) -> Any:
        if self.variant == "reg":
            if len(keys) == 1:
                return [self.s.get_into(keys[0], bufs[0], self.size)]
            sizes = self.sizes if len(keys) == len(self.sizes) else self.sizes[:len(keys)]
            return self.s.batch_get_into(keys, bufs, sizes)
        if len(keys) == 1:
            return [self.s.get(keys[0])]
        return self.s.get_batch(keys)

    def check_get(self, res, size: int) -> tuple[int, int, str]:
        misses = errors = 0
        first = ""
        for v in res:
            n = v if isinstance(v, int) else len(v)
            if n == size:
                continue
            if n == 0 or n == MC_OBJECT_NOT_FOUND:  # get answers b"" for a missing key
                misses += 1
            else:
                errors += 1
                first = first or f"Mooncake get answered {n}"
        return misses, errors, first

    def remove(self, keys: list[str]) -> int:
        bad = 0
        for i in range(0, len(keys), 1024):
            bad += sum(c != 0 for c in self.s.batch_remove(keys[i:i + 1024], True))
        return bad

    def close(self) -> None:
        pass  # the MooncakeClient is closed by the worker
