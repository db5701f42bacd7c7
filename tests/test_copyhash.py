"""Copies that hash what they copy (protocol/copyhash.py): the native extension and the
pure-Python fallback copy the same bytes and give the xxhash package's digests, on aligned,
misaligned (4K-aliased) and odd-sized buffers; and a client running on the fallback
(``KVPOOL_NATIVE=0``) puts and gets through a real cluster."""
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvpool.protocol import copyhash

IMPLS = {"python": (copyhash.py_copy_hash, copyhash.py_copy_hash_many, copyhash.py_hash_many,
                    copyhash.py_scatter_hash, copyhash.py_gather_hash)}
if copyhash._native is not None:
    n = copyhash._native
    IMPLS["native"] = (n.copy_hash, n.copy_hash_many, n.hash_many, n.scatter_hash, n.gather_hash)

SIZES = [0, 1, 63, 4096, 65535, 65536 + 17, (256 << 10) + 5, (1 << 20) + 4096 * 3 + 9]


def _page_buf(n: int, offset: int) -> memoryview:
    """A writable buffer of ``n`` bytes starting ``offset`` bytes into a page."""
    raw = np.empty(n + 2 * 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096 + offset
    return memoryview(raw[start:start + n])


def test_the_native_module_is_built():
    """CI builds it (.ci/setup): a missing build must not pass unnoticed as the fallback."""
    assert os.environ.get("KVPOOL_NATIVE") == "0" or copyhash.NATIVE


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dst_off", [0, 16])  # 16: 4K-aliased against a page-aligned source
def test_copy_hash_copies_and_hashes_what_landed(impl, size, dst_off):
    copy_hash = IMPLS[impl][0]
    src = _page_buf(size, 0)
    src[:] = os.urandom(size)
    dst = _page_buf(size + 7, dst_off)
    assert copy_hash(dst, src, True) == xxhash.xxh3_64_intdigest(src)
    assert bytes(dst[:size]) == bytes(src)
    dst2 = _page_buf(size, dst_off)
    assert copy_hash(dst2, bytes(src), False) is None and bytes(dst2) == bytes(src)


STORE = {"python": (copyhash.py_copy_hash, copyhash.py_copy_hash_many)}
if copyhash._native is not None:
    STORE["native"] = (copyhash._native.store_hash, copyhash._native.store_hash_many)


@pytest.mark.parametrize("impl", list(STORE))
@pytest.mark.parametrize("size", SIZES + [(4 << 20) + 3])
@pytest.mark.parametrize("offs", [(0, 0), (16, 0), (0, 16), (5, 3)])  # (dst, src) bytes into a page
def test_store_hash_copies_and_hashes_like_copy_hash(impl, size, offs):
    """store_hash (puts into a segment; natively streamed past the caches from 256 KiB up)
    lands the same bytes and digest as copy_hash, at any alignment of either buffer."""
    one, many = STORE[impl]
    src = _page_buf(size, offs[1])
    src[:] = os.urandom(size)
    dst = _page_buf(size + 7, offs[0])
    dst[size:] = b"\xee" * 7
    assert one(dst, src, True) == xxhash.xxh3_64_intdigest(src)
    assert bytes(dst[:size]) == bytes(src) and bytes(dst[size:]) == b"\xee" * 7  # nothing past the end
    dsts = [_page_buf(size, offs[0]), _page_buf(3, 0)]
    assert many(dsts, [src, b"abc"], True) == [xxhash.xxh3_64_intdigest(src), xxhash.xxh3_64_intdigest(b"abc")]
    assert bytes(dsts[0]) == bytes(src) and one(_page_buf(size, offs[0]), src, False) is None


@pytest.mark.parametrize("impl", list(IMPLS))
def test_batch_scatter_and_gather_forms(impl):
    _, many, hash_many, scatter, gather = IMPLS[impl]
    srcs = [os.urandom(s) for s in (0, 10, 70000, 300001)]
    dsts = [bytearray(len(s)) for s in srcs]
    assert many(dsts, srcs, True) == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    assert [bytes(d) for d in dsts] == srcs
    assert many([bytearray(3)], [b"abc"], False) is None
    assert hash_many(srcs) == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    whole = b"".join(srcs)
    pages = [bytearray(100000) for _ in range(4)]
    assert scatter(whole, pages, True) == xxhash.xxh3_64_intdigest(whole)
    assert b"".join(pages)[:len(whole)] == whole
    out = bytearray(len(whole) + 5)
    assert gather(out, srcs, True) == xxhash.xxh3_64_intdigest(whole) and bytes(out[:len(whole)]) == whole


@pytest.mark.parametrize("impl", list(IMPLS))
def test_bad_arguments_are_errors_not_overruns(impl):
    copy_hash, many, _, scatter, gather = IMPLS[impl]
    with pytest.raises(ValueError):
        copy_hash(bytearray(3), b"abcd", True)
    with pytest.raises((TypeError, BufferError)):
        copy_hash(b"read-only", b"ab", True)  # bytes are not writable
    with pytest.raises(ValueError):
        many([bytearray(4)], [b"ab", b"cd"], True)
    with pytest.raises(ValueError):
        scatter(b"abcdef", [bytearray(2), bytearray(2)], True)
    with pytest.raises(ValueError):
        gather(bytearray(3), [b"ab", b"cd"], True)


_CLIENT = r"""
import os, sys
from kvpool.connector.client import KVPoolClient
from kvpool.connector.scatter_out import ScatterOut
from kvpool.protocol import copyhash
assert copyhash.NATIVE is (os.environ["KVPOOL_NATIVE"] == "1"), copyhash.NATIVE
master = sys.argv[1]
with KVPoolClient(master) as c:
    data = {f"ch/{os.environ['KVPOOL_NATIVE']}/{i}": os.urandom(n) for i, n in enumerate((1, 4097, 65536, 5 << 20))}
    keys = list(data)
    assert c.put_batch(keys, list(data.values())) == [None] * len(keys)
    assert c.put_batch(keys[:2], [data[k] for k in keys[:2]]) == [None, None]
    for k, v in data.items():
        assert c.get(k) == v
        pages = [memoryview(bytearray(1000)) for _ in range(-(-len(v) // 1000))]
        assert c.get_into_batch([k], [ScatterOut(pages)])[0] == len(v)
        assert b"".join(pages)[:len(v)] == v
print("OK")
"""


@pytest.mark.parametrize("native", ["0", "1"])
def test_puts_and_gets_on_either_implementation(cluster, native):
    if native == "1" and copyhash._native is None:
        pytest.skip("the native module is not built here")
    sec = cluster.security
    env = {**os.environ, "KVPOOL_NATIVE": native, **({"KVPOOL_SECRET_FILE": sec.secret_file} if sec.secret_file else {})}
    p = subprocess.run([sys.executable, "-c", _CLIENT, cluster.master_addr], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
