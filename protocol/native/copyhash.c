/* kvpool.protocol._copyhash: copies that hash what they copy, without the GIL.
 *
 * Every put and get of kvpool copies bytes between a caller's buffer and a store node's
 * segment and hashes them (xxh3_64, the object checksum).  Done from Python that is one
 * interpreter call per 256 KiB piece and per object, holding the GIL.  Here a copy runs
 * in 64 KiB pieces, each hashed right after it landed (read back from the destination,
 * still in cache: a get hashes what it delivered, never the source), with the GIL
 * released for the whole call, and the batch forms take every object of a put or get in
 * one call.
 *
 * 4K aliasing: glibc's memcpy ("rep movsb") runs several times slower when the
 * destination lies 1-63 bytes past the source modulo 4 KiB (numpy arrays and
 * bytearrays start 16 bytes into a page, extents are page-aligned).  Such copies go
 * through a per-thread bounce buffer placed half a page from both, which stays in L2.
 *
 * xxh3_64 comes from the xxHash library's header (Debian's libxxhash-dev, inlined):
 * XXH3 output is stable across xxHash releases since 0.8.0, so these digests equal the
 * Python xxhash package's xxh3_64_intdigest (tests/test_copyhash.py checks it).
 *
 * Built by .ci/setup (protocol/native/build.sh); kvpool.protocol.copyhash falls back to
 * a pure-Python implementation of the same functions when it is absent.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define PIECE (64 * 1024)
#define PAGE 4096
#define ALIAS 64

static __thread unsigned char *bounce_raw = NULL;

/* A bounce buffer of PIECE bytes at page offset `at` (thread-local, made on first use). */
static unsigned char *bounce_at(size_t at) {
    if (bounce_raw == NULL) {
        bounce_raw = aligned_alloc(PAGE, PIECE + 2 * PAGE);
        if (bounce_raw == NULL)
            return NULL;
    }
    return bounce_raw + (at % PAGE);
}

static int aliased(const void *dst, const void *src, size_t n) {
    size_t d = ((uintptr_t)dst - (uintptr_t)src) % PAGE;
    return n > 2048 && d > 0 && d < ALIAS;
}

/* Copy n bytes src -> dst; with st, hash each piece as it landed in dst. */
static void copy_piecewise(unsigned char *dst, const unsigned char *src, size_t n, XXH3_state_t *st) {
    unsigned char *b = aliased(dst, src, n) ? bounce_at(((uintptr_t)src + PAGE / 2)) : NULL;
    for (size_t a = 0; a < n; a += PIECE) {
        size_t k = n - a < PIECE ? n - a : PIECE;
        if (b != NULL && k > 2048) {
            memcpy(b, src + a, k);
            memcpy(dst + a, b, k);
        } else {
            memcpy(dst + a, src + a, k);
        }
        if (st != NULL)
            XXH3_64bits_update(st, dst + a, k);
    }
}

static uint64_t copy_hash_one(unsigned char *dst, const unsigned char *src, size_t n, int hash) {
    if (!hash) {
        copy_piecewise(dst, src, n, NULL);
        return 0;
    }
    if (n <= PIECE && !aliased(dst, src, n)) {
        memcpy(dst, src, n);
        return XXH3_64bits(dst, n);
    }
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    copy_piecewise(dst, src, n, &st);
    return XXH3_64bits_digest(&st);
}

/* Copies into a store node's segment (puts): from STREAM_MIN bytes up, the destination is
 * written with non-temporal stores, past the caches: a put's bytes are read by another
 * process later, and the stores skip the read-for-ownership a cached store pays on a cold
 * line.  The source is hashed as it is read (each piece hashed, then copied, while it is
 * in L2): a put's checksum covers the bytes it was given; a reader checks them against what
 * landed.  (A get must hash what it delivered, so gets keep copy_hash_one.)
 * Intel 64 and IA-32 Optimization Reference Manual, "Non-temporal stores" (MOVNTDQ). */
#define STREAM_MIN (256 * 1024)

#if defined(__x86_64__)
#include <immintrin.h>

static void stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
    size_t i = 0;
    while (i < n && ((uintptr_t)(dst + i) & 31))
        dst[i] = src[i], i++;
#if defined(__AVX2__)
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), e);
    }
#else
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), e);
    }
#endif
    if (i < n)
        memcpy(dst + i, src + i, n - i);
}

static uint64_t store_hash_one(unsigned char *dst, const unsigned char *src, size_t n, int hash) {
    if (n < STREAM_MIN)
        return copy_hash_one(dst, src, n, hash);
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (size_t a = 0; a < n; a += PIECE) {
        size_t k = n - a < PIECE ? n - a : PIECE;
        if (hash)
            XXH3_64bits_update(&st, src + a, k);
        stream_copy(dst + a, src + a, k);
    }
    _mm_sfence(); /* the streamed stores are visible before the put's commit goes out */
    return hash ? XXH3_64bits_digest(&st) : 0;
}
#else
#define store_hash_one copy_hash_one
#endif

/* ---- argument helpers ------------------------------------------------------------ */

static int get_buf(PyObject *o, Py_buffer *b, int writable) {
    if (PyObject_GetBuffer(o, b, PyBUF_SIMPLE | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    return 0;
}

/* copy_hash(dst, src, hash) -> int | None: copy len(src) bytes of src into dst (at least
 * that long); with hash, the xxh3_64 of the bytes as they landed in dst. */
typedef uint64_t (*copier)(unsigned char *, const unsigned char *, size_t, int);

static PyObject *copy_one(PyObject *args, copier fn) {
    PyObject *dsto, *srco;
    int hash;
    if (!PyArg_ParseTuple(args, "OOp", &dsto, &srco, &hash))
        return NULL;
    Py_buffer d, s;
    if (get_buf(dsto, &d, 1) < 0)
        return NULL;
    if (get_buf(srco, &s, 0) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if (d.len < s.len) {
        PyBuffer_Release(&d);
        PyBuffer_Release(&s);
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes is smaller than the %zd-byte source", d.len, s.len);
        return NULL;
    }
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = fn(d.buf, s.buf, (size_t)s.len, hash);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    PyBuffer_Release(&s);
    if (!hash)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *py_copy_hash(PyObject *self, PyObject *args) { return copy_one(args, copy_hash_one); }

/* store_hash(dst, src, hash): copy_hash into a store segment (store_hash_one: large copies
 * stream past the caches, and the hash is of the source as it was read). */
static PyObject *py_store_hash(PyObject *self, PyObject *args) { return copy_one(args, store_hash_one); }

/* Buffers of a sequence; returns the count or -1 (every buffer taken is released on failure). */
static Py_ssize_t get_bufs(PyObject *seq, Py_buffer **out, int writable) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of buffers");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (bufs == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (get_buf(PySequence_Fast_GET_ITEM(fast, i), &bufs[i], writable) < 0) {
            for (Py_ssize_t j = 0; j < i; j++)
                PyBuffer_Release(&bufs[j]);
            PyMem_Free(bufs);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *out = bufs;
    return n;
}

static void release_bufs(Py_buffer *bufs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
}

static PyObject *digest_list(const uint64_t *h, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(h[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* copy_hash_many(dsts, srcs, hash) -> list[int] | None: copy_hash over pairs, one call. */
static PyObject *copy_many(PyObject *args, copier fn) {
    PyObject *dsto, *srco;
    int hash;
    if (!PyArg_ParseTuple(args, "OOp", &dsto, &srco, &hash))
        return NULL;
    Py_buffer *d, *s;
    Py_ssize_t nd = get_bufs(dsto, &d, 1);
    if (nd < 0)
        return NULL;
    Py_ssize_t ns = get_bufs(srco, &s, 0);
    if (ns < 0) {
        release_bufs(d, nd);
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t *h = NULL;
    if (nd != ns) {
        PyErr_Format(PyExc_ValueError, "%zd destinations for %zd sources", nd, ns);
        goto done;
    }
    for (Py_ssize_t i = 0; i < ns; i++) {
        if (d[i].len < s[i].len) {
            PyErr_Format(PyExc_ValueError, "destination %zd holds %zd bytes, its source %zd", i, d[i].len, s[i].len);
            goto done;
        }
    }
    h = PyMem_Calloc(ns ? ns : 1, sizeof(uint64_t));
    if (h == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < ns; i++)
        h[i] = fn(d[i].buf, s[i].buf, (size_t)s[i].len, hash);
    Py_END_ALLOW_THREADS
    if (hash) {
        result = digest_list(h, ns);
    } else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    PyMem_Free(h);
    release_bufs(d, nd);
    release_bufs(s, ns);
    return result;
}

static PyObject *py_copy_hash_many(PyObject *self, PyObject *args) { return copy_many(args, copy_hash_one); }

static PyObject *py_store_hash_many(PyObject *self, PyObject *args) { return copy_many(args, store_hash_one); }

/* hash_many(bufs) -> list[int]: the xxh3_64 of each buffer, one call. */
static PyObject *py_hash_many(PyObject *self, PyObject *arg) {
    Py_buffer *b;
    Py_ssize_t n = get_bufs(arg, &b, 0);
    if (n < 0)
        return NULL;
    uint64_t *h = PyMem_Calloc(n ? n : 1, sizeof(uint64_t));
    if (h == NULL) {
        release_bufs(b, n);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        h[i] = XXH3_64bits(b[i].buf, (size_t)b[i].len);
    Py_END_ALLOW_THREADS
    PyObject *out = digest_list(h, n);
    PyMem_Free(h);
    release_bufs(b, n);
    return out;
}

/* scatter_hash(src, dsts, hash) -> int | None: src into the dsts in order (their total at
 * least len(src)); with hash, the xxh3_64 of the bytes as they landed. */
static PyObject *py_scatter_hash(PyObject *self, PyObject *args) {
    PyObject *srco, *dsto;
    int hash;
    if (!PyArg_ParseTuple(args, "OOp", &srco, &dsto, &hash))
        return NULL;
    Py_buffer s, *d;
    if (get_buf(srco, &s, 0) < 0)
        return NULL;
    Py_ssize_t nd = get_bufs(dsto, &d, 1);
    if (nd < 0) {
        PyBuffer_Release(&s);
        return NULL;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < nd; i++)
        total += d[i].len;
    if (total < s.len) {
        release_bufs(d, nd);
        PyBuffer_Release(&s);
        PyErr_Format(PyExc_ValueError, "pieces hold %zd bytes, fewer than the %zd-byte source", total, s.len);
        return NULL;
    }
    XXH3_state_t st;
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(&st);
    size_t pos = 0, n = (size_t)s.len;
    for (Py_ssize_t i = 0; i < nd && pos < n; i++) {
        size_t k = (size_t)d[i].len < n - pos ? (size_t)d[i].len : n - pos;
        copy_piecewise(d[i].buf, (const unsigned char *)s.buf + pos, k, hash ? &st : NULL);
        pos += k;
    }
    Py_END_ALLOW_THREADS
    uint64_t h = XXH3_64bits_digest(&st);
    release_bufs(d, nd);
    PyBuffer_Release(&s);
    if (!hash)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(h);
}

/* gather_hash(dst, srcs, hash) -> int | None: the srcs back to back into dst (at least
 * their total); with hash, the xxh3_64 of the bytes as they landed. */
static PyObject *py_gather_hash(PyObject *self, PyObject *args) {
    PyObject *dsto, *srco;
    int hash;
    if (!PyArg_ParseTuple(args, "OOp", &dsto, &srco, &hash))
        return NULL;
    Py_buffer d, *s;
    if (get_buf(dsto, &d, 1) < 0)
        return NULL;
    Py_ssize_t ns = get_bufs(srco, &s, 0);
    if (ns < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < ns; i++)
        total += s[i].len;
    if (d.len < total) {
        release_bufs(s, ns);
        PyBuffer_Release(&d);
        PyErr_Format(PyExc_ValueError, "destination of %zd bytes is smaller than the %zd bytes gathered", d.len, total);
        return NULL;
    }
    XXH3_state_t st;
    Py_BEGIN_ALLOW_THREADS
    XXH3_64bits_reset(&st);
    size_t pos = 0;
    for (Py_ssize_t i = 0; i < ns; i++) {
        copy_piecewise((unsigned char *)d.buf + pos, s[i].buf, (size_t)s[i].len, hash ? &st : NULL);
        pos += (size_t)s[i].len;
    }
    Py_END_ALLOW_THREADS
    uint64_t h = XXH3_64bits_digest(&st);
    release_bufs(s, ns);
    PyBuffer_Release(&d);
    if (!hash)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"copy_hash", py_copy_hash, METH_VARARGS,
     "copy_hash(dst, src, hash) -> int | None: copy src into dst; with hash, xxh3_64 of what landed."},
    {"copy_hash_many", py_copy_hash_many, METH_VARARGS,
     "copy_hash_many(dsts, srcs, hash) -> list[int] | None: copy_hash over pairs, without the GIL."},
    {"store_hash", py_store_hash, METH_VARARGS,
     "store_hash(dst, src, hash) -> int | None: copy_hash into a store segment; large copies bypass the "
     "caches and hash the source as read."},
    {"store_hash_many", py_store_hash_many, METH_VARARGS,
     "store_hash_many(dsts, srcs, hash) -> list[int] | None: store_hash over pairs, without the GIL."},
    {"hash_many", py_hash_many, METH_O, "hash_many(bufs) -> list[int]: xxh3_64 of each buffer."},
    {"scatter_hash", py_scatter_hash, METH_VARARGS,
     "scatter_hash(src, dsts, hash) -> int | None: src into dsts in order; with hash, xxh3_64 of what landed."},
    {"gather_hash", py_gather_hash, METH_VARARGS,
     "gather_hash(dst, srcs, hash) -> int | None: srcs back to back into dst; with hash, xxh3_64 of what landed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copyhash",
                                    "Copies that hash what they copy, without the GIL (see copyhash.c).", -1, methods};

PyMODINIT_FUNC PyInit__copyhash(void) { return PyModule_Create(&module); }
