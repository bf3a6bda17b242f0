/* kvledger.core._native: the ledger core's optional C part (plain CPython C API, no other library).
 *
 * What it computes is defined by the pure-Python code it stands in for (kvledger.core.identity and
 * kvledger.core.pool); the tests run both on the same inputs and require identical results. Every
 * function either produces exactly the pure-Python result or returns None / declines, and the caller
 * then takes the pure-Python path -- so error messages and odd inputs (bools, integer-likes) are always
 * handled by the Python code.
 *
 * BLAKE2b is written here from RFC 7693 (unkeyed, 64-byte digests: the only form the block chain uses;
 * the personalised root digest is computed once per context by hashlib).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX, READONLY: the slot layout decode_fast reads */
#include <stdint.h>
#include <string.h>

#define NATIVE_ABI 3 /* bumped whenever a function's contract changes; kvledger.core.native checks it */
#define DIGEST 64
#define MAX_TOKEN 0xFFFFFFFFULL

/* ---- BLAKE2b (RFC 7693, section 3) --------------------------------------------------------------- */

static const uint64_t b2b_iv[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

/* Message word schedule; rounds 10 and 11 reuse rows 0 and 1. */
static const uint8_t b2b_sigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load_le64(const uint8_t *p) {
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 24) |
           ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void store_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* The mixing function G: rotations 32, 24, 16, 63. */
#define B2B_G(a, b, c, d, x, y)              \
    do {                                     \
        v[a] = v[a] + v[b] + (x);            \
        v[d] = rotr64(v[d] ^ v[a], 32);      \
        v[c] = v[c] + v[d];                  \
        v[b] = rotr64(v[b] ^ v[c], 24);      \
        v[a] = v[a] + v[b] + (y);            \
        v[d] = rotr64(v[d] ^ v[a], 16);      \
        v[c] = v[c] + v[d];                  \
        v[b] = rotr64(v[b] ^ v[c], 63);      \
    } while (0)

/* The compression function F over one 128-byte block; t is the byte offset after it (< 2**64 here). */
static void b2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = b2b_iv[i];
    }
    v[12] ^= t; /* the high word of the counter stays 0: messages here are far below 2**64 bytes */
    if (last) v[14] = ~v[14];
    /* Rounds unrolled with constant schedule indices, so the message words stay in registers. */
#define B2B_ROUND(r)                                                          \
    do {                                                                      \
        B2B_G(0, 4, 8, 12, m[b2b_sigma[r][0]], m[b2b_sigma[r][1]]);           \
        B2B_G(1, 5, 9, 13, m[b2b_sigma[r][2]], m[b2b_sigma[r][3]]);           \
        B2B_G(2, 6, 10, 14, m[b2b_sigma[r][4]], m[b2b_sigma[r][5]]);          \
        B2B_G(3, 7, 11, 15, m[b2b_sigma[r][6]], m[b2b_sigma[r][7]]);          \
        B2B_G(0, 5, 10, 15, m[b2b_sigma[r][8]], m[b2b_sigma[r][9]]);          \
        B2B_G(1, 6, 11, 12, m[b2b_sigma[r][10]], m[b2b_sigma[r][11]]);        \
        B2B_G(2, 7, 8, 13, m[b2b_sigma[r][12]], m[b2b_sigma[r][13]]);         \
        B2B_G(3, 4, 9, 14, m[b2b_sigma[r][14]], m[b2b_sigma[r][15]]);         \
    } while (0)
    B2B_ROUND(0); B2B_ROUND(1); B2B_ROUND(2); B2B_ROUND(3); B2B_ROUND(4); B2B_ROUND(5);
    B2B_ROUND(6); B2B_ROUND(7); B2B_ROUND(8); B2B_ROUND(9); B2B_ROUND(0); B2B_ROUND(1);
#undef B2B_ROUND
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-512, unkeyed, of msg[0:len]. */
static void b2b_512(const uint8_t *msg, size_t len, uint8_t out[DIGEST]) {
    uint64_t h[8];
    uint8_t last[128];
    memcpy(h, b2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ DIGEST; /* parameter block: fanout 1, depth 1, no key, 64-byte digest */
    size_t done = 0;
    while (len - done > 128) {
        done += 128;
        b2b_compress(h, msg + done - 128, (uint64_t)done, 0);
    }
    memset(last, 0, sizeof last);
    memcpy(last, msg + done, len - done);
    b2b_compress(h, last, (uint64_t)len, 1);
    for (int i = 0; i < 8; i++) store_le64(out + 8 * i, h[i]);
}

/* ---- token ids ------------------------------------------------------------------------------------ */

/* Encode items[0:n] as little-endian uint32 into out. Returns 0, or -1 when an item is not a plain int
 * in [0, 2**32) (no exception set: the caller declines and the Python path decides). */
static int encode_tokens(PyObject *const *items, Py_ssize_t n, uint8_t *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (!PyLong_CheckExact(o)) return -1;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || v < 0 || (unsigned long long)v > MAX_TOKEN) {
            PyErr_Clear();
            return -1;
        }
        uint32_t u = (uint32_t)v;
        out[4 * i] = (uint8_t)u;
        out[4 * i + 1] = (uint8_t)(u >> 8);
        out[4 * i + 2] = (uint8_t)(u >> 16);
        out[4 * i + 3] = (uint8_t)(u >> 24);
    }
    return 0;
}

/* Digests of nblocks chained blocks: parent || data[i*step : (i+1)*step], into out[i*64]. */
static int chain_into(const uint8_t *root, Py_ssize_t root_len, const uint8_t *data, Py_ssize_t step,
                      Py_ssize_t nblocks, uint8_t *out) {
    Py_ssize_t cap = (root_len > DIGEST ? root_len : DIGEST) + step;
    uint8_t *scratch = PyMem_RawMalloc((size_t)cap);
    if (scratch == NULL) return -1;
    const uint8_t *parent = root;
    Py_ssize_t plen = root_len;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        memcpy(scratch, parent, (size_t)plen);
        memcpy(scratch + plen, data + i * step, (size_t)step);
        b2b_512(scratch, (size_t)(plen + step), out + i * DIGEST);
        parent = out + i * DIGEST;
        plen = DIGEST;
    }
    PyMem_RawFree(scratch);
    return 0;
}

static PyObject *digest_list(const uint8_t *digests, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)digests + i * DIGEST, DIGEST);
        if (b == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, b);
    }
    return list;
}

static int check_block_size(Py_ssize_t bs) {
    if (bs <= 0 || bs > (1 << 16)) {
        PyErr_SetString(PyExc_ValueError, "block_size must be in 1..65536");
        return -1;
    }
    return 0;
}

/* chain_bytes(parent: bytes, data: bytes, block_size) -> list[bytes]: identity.chain_digests. */
static PyObject *native_chain_bytes(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer parent, data;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "y*y*n:chain_bytes", &parent, &data, &bs)) return NULL;
    PyObject *result = NULL;
    if (check_block_size(bs) == 0) {
        Py_ssize_t step = 4 * bs, n = data.len / step;
        uint8_t *out = PyMem_RawMalloc((size_t)(n > 0 ? n : 1) * DIGEST);
        if (out == NULL) {
            PyErr_NoMemory();
        } else {
            int rc;
            Py_BEGIN_ALLOW_THREADS
            rc = chain_into(parent.buf, parent.len, data.buf, step, n, out);
            Py_END_ALLOW_THREADS
            result = rc == 0 ? digest_list(out, n) : PyErr_NoMemory();
            PyMem_RawFree(out);
        }
    }
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return result;
}

/* blake2b(data: bytes) -> bytes: BLAKE2b-512 of data (what hashlib.blake2b(data).digest() gives; for
 * the RFC 7693 test vectors). */
static PyObject *native_blake2b(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*:blake2b", &data)) return NULL;
    PyObject *result = PyBytes_FromStringAndSize(NULL, DIGEST);
    static const uint8_t empty[1] = {0};
    if (result != NULL) /* an empty message is one final block of zeros with counter 0 */
        b2b_512(data.len ? data.buf : empty, (size_t)data.len, (uint8_t *)PyBytes_AS_STRING(result));
    PyBuffer_Release(&data);
    return result;
}

/* prompt_digests(root: bytes, tokens: tuple | list, block_size) -> list[bytes] | None.
 * Checks every token (the partial tail too) and returns the full blocks' chained digests; None when a
 * token is not a plain int in [0, 2**32) -- the Python path then accepts integer-likes or raises. */
static PyObject *native_prompt_digests(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer root;
    PyObject *tokens;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "y*On:prompt_digests", &root, &tokens, &bs)) return NULL;
    PyObject *result = NULL;
    uint8_t *data = NULL, *out = NULL;
    if (check_block_size(bs) < 0) goto done;
    if (!PyTuple_CheckExact(tokens) && !PyList_CheckExact(tokens)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    Py_ssize_t nblocks = n / bs;
    data = PyMem_RawMalloc((size_t)(n > 0 ? n : 1) * 4);
    out = PyMem_RawMalloc((size_t)(nblocks > 0 ? nblocks : 1) * DIGEST);
    if (data == NULL || out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (encode_tokens(PySequence_Fast_ITEMS(tokens), n, data) < 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = chain_into(root.buf, root.len, data, 4 * bs, nblocks, out);
    Py_END_ALLOW_THREADS
    result = rc == 0 ? digest_list(out, nblocks) : PyErr_NoMemory();
done:
    PyMem_RawFree(data);
    PyMem_RawFree(out);
    PyBuffer_Release(&root);
    return result;
}

/* block_digest(parent: bytes, tokens: list, start, block_size) -> bytes | None: the digest of
 * tokens[start:start+block_size] chained to parent; None when a token there is not a plain int in
 * range, the slice is short or an argument is of another type (the Python path decides). Called once
 * per block a sequence fills, so it takes its arguments without parsing (METH_FASTCALL). */
static PyObject *native_block_digest(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "block_digest takes (parent, tokens, start, block_size)");
        return NULL;
    }
    PyObject *parent = args[0], *tokens = args[1];
    if (!PyBytes_CheckExact(parent) || (!PyTuple_CheckExact(tokens) && !PyList_CheckExact(tokens)) ||
        !PyLong_CheckExact(args[2]) || !PyLong_CheckExact(args[3]))
        Py_RETURN_NONE;
    Py_ssize_t start = PyLong_AsSsize_t(args[2]), bs = PyLong_AsSsize_t(args[3]);
    if ((start == -1 || bs == -1) && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (bs <= 0 || bs > (1 << 16) || start < 0 || start > PySequence_Fast_GET_SIZE(tokens) - bs) Py_RETURN_NONE;
    Py_ssize_t plen = PyBytes_GET_SIZE(parent);
    size_t len = (size_t)plen + 4 * (size_t)bs;
    uint8_t stack[DIGEST + 4 * 64];
    uint8_t *msg = stack;
    if (len > sizeof stack && (msg = PyMem_RawMalloc(len)) == NULL) return PyErr_NoMemory();
    memcpy(msg, PyBytes_AS_STRING(parent), (size_t)plen);
    PyObject *result;
    if (encode_tokens(PySequence_Fast_ITEMS(tokens) + start, bs, msg + plen) < 0) {
        result = Py_NewRef(Py_None);
    } else {
        result = PyBytes_FromStringAndSize(NULL, DIGEST);
        if (result != NULL) b2b_512(msg, len, (uint8_t *)PyBytes_AS_STRING(result));
    }
    if (msg != stack) PyMem_RawFree(msg);
    return result;
}

/* check_tokens(tokens: tuple | list) -> bool: every item a plain int in [0, 2**32). False also for
 * anything else (the Python path then decides: integer-likes pass, the rest raise). */
static PyObject *native_check_tokens(PyObject *Py_UNUSED(self), PyObject *tokens) {
    if (!PyTuple_CheckExact(tokens) && !PyList_CheckExact(tokens)) Py_RETURN_FALSE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    PyObject *const *items = PySequence_Fast_ITEMS(tokens);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (!PyLong_CheckExact(o)) Py_RETURN_FALSE;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || v < 0 || (unsigned long long)v > MAX_TOKEN) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* ---- block pool bookkeeping ------------------------------------------------------------------------
 * These stand in for per-block loops of kvledger.core.pool over its flat lists (ref, leased, digest,
 * group, written: one entry per block id). Each first checks that every input is what the pool keeps
 * (exact lists, plain ints in range, bools); if not, it changes nothing and returns None, and the
 * Python loop runs instead (raising whatever it raises). */

/* items[i] as a block id in [0, n), or -1. */
static inline Py_ssize_t block_id(PyObject *o, Py_ssize_t n) {
    if (!PyLong_CheckExact(o)) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || v < 0 || v >= n) {
        PyErr_Clear();
        return -1;
    }
    return (Py_ssize_t)v;
}

static inline int small_int(PyObject *o, long *out) {
    if (!PyLong_CheckExact(o)) return -1;
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *out = v;
    return 0;
}

static int set_list_item(PyObject *list, Py_ssize_t i, PyObject *value) {
    Py_INCREF(value);
    return PyList_SetItem(list, i, value); /* steals value, releases the old item */
}

/* The block ids in seq, checked (PyMem_Malloc'd); NULL when one is not a plain int in [0, n) (an
 * exception is set only when memory ran out). */
static Py_ssize_t *block_ids(PyObject *seq, Py_ssize_t n, Py_ssize_t *count) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t *ids = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(len > 0 ? len : 1));
    if (ids == NULL) return NULL;
    for (Py_ssize_t i = 0; i < len; i++) {
        if ((ids[i] = block_id(items[i], n)) < 0) {
            PyMem_Free(ids);
            return NULL;
        }
    }
    *count = len;
    return ids;
}

/* release_scan(blocks, ref, leased, digest, written) -> (keep, freed, deferred, bad) | None.
 * BlockPool.release_many's loop: drop one reference per block in order; at zero a leased block is
 * deferred, a written indexed one kept (to be retained), anything else freed (the caller forgets and
 * frees it). bad is the position of a block released more often than taken (the scan stops there,
 * before touching it), else -1. */
static PyObject *native_release_scan(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *blocks, *ref, *leased, *digest, *written;
    if (!PyArg_ParseTuple(args, "OOOOO:release_scan", &blocks, &ref, &leased, &digest, &written)) return NULL;
    if (!PyList_CheckExact(ref) || !PyList_CheckExact(leased) || !PyList_CheckExact(digest) ||
        !PyList_CheckExact(written))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(ref), count = 0;
    if (PyList_GET_SIZE(leased) != n || PyList_GET_SIZE(digest) != n || PyList_GET_SIZE(written) != n)
        Py_RETURN_NONE;
    Py_ssize_t *ids = block_ids(blocks, n, &count);
    if (ids == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    long value;
    for (Py_ssize_t i = 0; i < count; i++) { /* everything the scan reads has the pool's types */
        Py_ssize_t b = ids[i];
        PyObject *w = PyList_GET_ITEM(written, b);
        if (small_int(PyList_GET_ITEM(ref, b), &value) < 0 || small_int(PyList_GET_ITEM(leased, b), &value) < 0 ||
            (w != Py_True && w != Py_False)) {
            PyMem_Free(ids);
            Py_RETURN_NONE;
        }
    }
    PyObject *keep = PyList_New(0), *freed = PyList_New(0), *result = NULL;
    Py_ssize_t deferred = 0, bad = -1;
    if (keep == NULL || freed == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t b = ids[i];
        long r = 0;
        small_int(PyList_GET_ITEM(ref, b), &r);
        r -= 1;
        if (r < 0) {
            bad = i;
            break;
        }
        PyObject *num = PyLong_FromLong(r);
        if (num == NULL || PyList_SetItem(ref, b, num) < 0) goto done;
        if (r > 0) continue;
        long lease = 0;
        small_int(PyList_GET_ITEM(leased, b), &lease);
        if (lease) {
            deferred++;
        } else if (PyList_GET_ITEM(digest, b) != Py_None && PyList_GET_ITEM(written, b) == Py_True) {
            if (PyList_Append(keep, PySequence_Fast_GET_ITEM(blocks, i)) < 0) goto done;
        } else {
            if (PyList_Append(freed, PySequence_Fast_GET_ITEM(blocks, i)) < 0) goto done;
        }
    }
    result = Py_BuildValue("(OOnn)", keep, freed, deferred, bad);
done:
    Py_XDECREF(keep);
    Py_XDECREF(freed);
    PyMem_Free(ids);
    return result;
}

/* clear_identity(victims, index, digest, group, written) -> True | None: evicted blocks lose their
 * identity, in order: del index[digest[b]]; digest[b] = group[b] = None; written[b] = False. A digest
 * missing from the index raises KeyError there, as the Python loop does. */
static PyObject *native_clear_identity(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *victims, *index, *digest, *group, *written;
    if (!PyArg_ParseTuple(args, "OOOOO:clear_identity", &victims, &index, &digest, &group, &written)) return NULL;
    if (!PyDict_CheckExact(index) || !PyList_CheckExact(digest) || !PyList_CheckExact(group) ||
        !PyList_CheckExact(written) || PyList_GET_SIZE(group) != PyList_GET_SIZE(digest) ||
        PyList_GET_SIZE(written) != PyList_GET_SIZE(digest))
        Py_RETURN_NONE;
    Py_ssize_t count = 0;
    Py_ssize_t *ids = block_ids(victims, PyList_GET_SIZE(digest), &count);
    if (ids == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < count; i++) { /* digests are bytes: deleting them runs no Python code */
        PyObject *d = PyList_GET_ITEM(digest, ids[i]);
        if (!PyBytes_CheckExact(d)) {
            /* a second occurrence of a victim finds None only after the first cleared it */
            int earlier = 0;
            for (Py_ssize_t j = 0; j < i && !earlier; j++) earlier = ids[j] == ids[i];
            if (!(earlier && d == Py_None)) {
                PyMem_Free(ids);
                Py_RETURN_NONE;
            }
        }
    }
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t b = ids[i];
        PyObject *d = PyList_GET_ITEM(digest, b);
        Py_INCREF(d);
        int rc = PyDict_DelItem(index, d);
        if (rc < 0 && PyErr_ExceptionMatches(PyExc_KeyError)) {
            PyErr_Clear();
            PyErr_SetObject(PyExc_KeyError, d); /* as `del index[d]` words it */
        }
        Py_DECREF(d);
        if (rc < 0 || set_list_item(digest, b, Py_None) < 0 || set_list_item(group, b, Py_None) < 0 ||
            set_list_item(written, b, Py_False) < 0)
            goto done;
    }
    result = Py_NewRef(Py_True);
done:
    PyMem_Free(ids);
    return result;
}

/* set_items(target, ids, start, stop, value) -> True | None: target[ids[i]] = value for i in
 * range(start, stop) (a list's per-block flag or count, e.g. written = True, ref = 1). */
static PyObject *native_set_items(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *target, *ids, *value;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "OOnnO:set_items", &target, &ids, &start, &stop, &value)) return NULL;
    if (!PyList_CheckExact(target) || (!PyList_CheckExact(ids) && !PyTuple_CheckExact(ids)) || start < 0 ||
        stop > PySequence_Fast_GET_SIZE(ids))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(target);
    PyObject *const *items = PySequence_Fast_ITEMS(ids);
    for (Py_ssize_t i = start; i < stop; i++)
        if (block_id(items[i], n) < 0) Py_RETURN_NONE;
    for (Py_ssize_t i = start; i < stop; i++)
        if (set_list_item(target, block_id(items[i], n), value) < 0) return NULL;
    Py_RETURN_TRUE;
}

/* add_refs(ref, blocks) -> bool: ref[b] += 1 for each block when every one is already held (ref >= 1:
 * a fork sharing its parent's blocks); False, changing nothing, otherwise (BlockPool.share's other
 * cases -- a retained or deferred block -- stay in Python). */
static PyObject *native_add_refs(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ref, *blocks;
    if (!PyArg_ParseTuple(args, "OO:add_refs", &ref, &blocks)) return NULL;
    if (!PyList_CheckExact(ref)) Py_RETURN_FALSE;
    Py_ssize_t count = 0;
    Py_ssize_t *ids = block_ids(blocks, PyList_GET_SIZE(ref), &count);
    if (ids == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    long value;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (small_int(PyList_GET_ITEM(ref, ids[i]), &value) < 0 || value < 1 || value > LONG_MAX / 2) {
            PyMem_Free(ids);
            Py_RETURN_FALSE;
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        small_int(PyList_GET_ITEM(ref, ids[i]), &value);
        PyObject *num = PyLong_FromLong(value + 1);
        if (num == NULL || PyList_SetItem(ref, ids[i], num) < 0) {
            PyMem_Free(ids);
            return NULL;
        }
    }
    PyMem_Free(ids);
    Py_RETURN_TRUE;
}

/* register_many(index, digest, group, blocks, digests, start, trust_group) -> True | None: for i in
 * range(start, len(digests)), index blocks[i] under digests[i] unless that identity is indexed already
 * (the first block stays canonical), recording its digest and trust group. */
static PyObject *native_register_many(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *index, *digest, *group, *blocks, *digests, *trust;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "OOOOOnO:register_many", &index, &digest, &group, &blocks, &digests, &start, &trust))
        return NULL;
    if (!PyDict_CheckExact(index) || !PyList_CheckExact(digest) || !PyList_CheckExact(group) ||
        PyList_GET_SIZE(group) != PyList_GET_SIZE(digest) || !PyList_CheckExact(blocks) ||
        !PyList_CheckExact(digests) || start < 0 || PyList_GET_SIZE(blocks) < PyList_GET_SIZE(digests))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(digest), stop = PyList_GET_SIZE(digests);
    for (Py_ssize_t i = start; i < stop; i++)
        if (block_id(PyList_GET_ITEM(blocks, i), n) < 0 || !PyBytes_CheckExact(PyList_GET_ITEM(digests, i)))
            Py_RETURN_NONE;
    for (Py_ssize_t i = start; i < stop; i++) {
        PyObject *d = PyList_GET_ITEM(digests, i), *block = PyList_GET_ITEM(blocks, i);
        int has = PyDict_Contains(index, d);
        if (has < 0) return NULL;
        if (has) continue;
        Py_ssize_t b = block_id(block, n);
        if (PyDict_SetItem(index, d, block) < 0 || set_list_item(digest, b, d) < 0 || set_list_item(group, b, trust) < 0)
            return NULL;
    }
    Py_RETURN_TRUE;
}

/* ---- BlockOrder: the LRU policy's order of retained blocks --------------------------------------------
 * An ordered set of block ids (plain ints in [0, 2**26)) as an intrusive doubly linked list over flat
 * arrays (vLLM's free-block queue works the same way): add at the back, remove anywhere, pop from the
 * front, all O(1), with no object per entry. add/add_many return False (and change nothing) for any
 * other key; kvledger.core.eviction.LRUPolicy then moves to an OrderedDict, so behaviour never depends
 * on which one holds the order. */

#define ORDER_MAX (1 << 26)

typedef struct {
    PyObject_HEAD
    int32_t *prev, *next; /* -1: none */
    uint8_t *member;
    Py_ssize_t cap, len;
    int32_t head, tail;
} BlockOrder;

static Py_ssize_t order_key(PyObject *o) {
    if (!PyLong_CheckExact(o)) return -1;
    int overflow = 0;
    long v = PyLong_AsLongAndOverflow(o, &overflow);
    if (overflow || v < 0 || v >= ORDER_MAX) {
        PyErr_Clear();
        return -1;
    }
    return (Py_ssize_t)v;
}

static int order_reserve(BlockOrder *self, Py_ssize_t key) {
    if (key < self->cap) return 0;
    Py_ssize_t cap = self->cap ? self->cap : 64;
    while (cap <= key) cap *= 2;
    if (cap > ORDER_MAX) cap = ORDER_MAX;
    int32_t *prev = PyMem_Realloc(self->prev, sizeof(int32_t) * (size_t)cap);
    if (prev == NULL) goto nomem;
    self->prev = prev;
    int32_t *next = PyMem_Realloc(self->next, sizeof(int32_t) * (size_t)cap);
    if (next == NULL) goto nomem;
    self->next = next;
    uint8_t *member = PyMem_Realloc(self->member, (size_t)cap);
    if (member == NULL) goto nomem;
    self->member = member;
    memset(member + self->cap, 0, (size_t)(cap - self->cap));
    self->cap = cap;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static void order_link(BlockOrder *self, Py_ssize_t k) {
    self->member[k] = 1;
    self->prev[k] = self->tail;
    self->next[k] = -1;
    if (self->tail >= 0)
        self->next[self->tail] = (int32_t)k;
    else
        self->head = (int32_t)k;
    self->tail = (int32_t)k;
    self->len++;
}

static void order_unlink(BlockOrder *self, Py_ssize_t k) {
    int32_t p = self->prev[k], n = self->next[k];
    if (p >= 0)
        self->next[p] = n;
    else
        self->head = n;
    if (n >= 0)
        self->prev[n] = p;
    else
        self->tail = p;
    self->member[k] = 0;
    self->len--;
}

static PyObject *order_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "BlockOrder() takes no arguments");
        return NULL;
    }
    BlockOrder *self = (BlockOrder *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->prev = self->next = NULL;
    self->member = NULL;
    self->cap = self->len = 0;
    self->head = self->tail = -1;
    return (PyObject *)self;
}

static void order_dealloc(BlockOrder *self) {
    PyMem_Free(self->prev);
    PyMem_Free(self->next);
    PyMem_Free(self->member);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* add(block) -> bool: append at the back (a block already there keeps its place). */
static PyObject *order_add(BlockOrder *self, PyObject *key) {
    Py_ssize_t k = order_key(key);
    if (k < 0) Py_RETURN_FALSE;
    if (order_reserve(self, k) < 0) return NULL;
    if (!self->member[k]) order_link(self, k);
    Py_RETURN_TRUE;
}

/* add_many(blocks) -> bool: add each, in order; False (nothing added) if any key is not a block id. */
static PyObject *order_add_many(BlockOrder *self, PyObject *blocks) {
    if (!PyList_CheckExact(blocks) && !PyTuple_CheckExact(blocks)) Py_RETURN_FALSE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks), top = -1;
    PyObject *const *items = PySequence_Fast_ITEMS(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = order_key(items[i]);
        if (k < 0) Py_RETURN_FALSE;
        if (k > top) top = k;
    }
    if (top >= 0 && order_reserve(self, top) < 0) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = order_key(items[i]);
        if (!self->member[k]) order_link(self, k);
    }
    Py_RETURN_TRUE;
}

/* remove(block): KeyError(block) when it is not there (as `del ordered_dict[block]`). */
static PyObject *order_remove(BlockOrder *self, PyObject *key) {
    Py_ssize_t k = order_key(key);
    if (k < 0 || k >= self->cap || !self->member[k]) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    order_unlink(self, k);
    Py_RETURN_NONE;
}

/* The n oldest blocks (n <= len) as a new list, oldest first; NULL with an exception set on failure. */
static PyObject *order_oldest(BlockOrder *self, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    Py_ssize_t k = self->head;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *num = PyLong_FromSsize_t(k);
        if (num == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, num);
        k = self->next[k];
    }
    return out;
}

/* pop_front(n) -> list: the n oldest blocks, removed (n <= len). */
static PyObject *order_pop_front(BlockOrder *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || n > self->len) {
        PyErr_SetString(PyExc_ValueError, "pop_front: n must be in 0..len");
        return NULL;
    }
    PyObject *out = order_oldest(self, n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) order_unlink(self, self->head);
    return out;
}

/* to_list() -> list: every block, oldest first. */
static PyObject *order_to_list(BlockOrder *self, PyObject *Py_UNUSED(ignored)) {
    return order_oldest(self, self->len);
}

static PyObject *order_clear(BlockOrder *self, PyObject *Py_UNUSED(ignored)) {
    if (self->member != NULL) memset(self->member, 0, (size_t)self->cap);
    self->len = 0;
    self->head = self->tail = -1;
    Py_RETURN_NONE;
}

static Py_ssize_t order_len(BlockOrder *self) { return self->len; }

static int order_contains(BlockOrder *self, PyObject *key) {
    Py_ssize_t k = order_key(key);
    return k >= 0 && k < self->cap && self->member[k];
}

static PyMethodDef order_methods[] = {
    {"add", (PyCFunction)order_add, METH_O, "Append a block at the back (one already there keeps its place)."},
    {"add_many", (PyCFunction)order_add_many, METH_O, "Append blocks in order; False if one is not a block id."},
    {"remove", (PyCFunction)order_remove, METH_O, "Remove a block (KeyError if absent)."},
    {"pop_front", (PyCFunction)order_pop_front, METH_O, "Remove and return the n oldest blocks."},
    {"to_list", (PyCFunction)order_to_list, METH_NOARGS, "Every block, oldest first."},
    {"clear", (PyCFunction)order_clear, METH_NOARGS, "Forget every block."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods order_as_sequence = {
    .sq_length = (lenfunc)order_len,
    .sq_contains = (objobjproc)order_contains,
};

static PyTypeObject BlockOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvledger.core._native.BlockOrder",
    .tp_basicsize = sizeof(BlockOrder),
    .tp_dealloc = (destructor)order_dealloc,
    .tp_as_sequence = &order_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ordered set of block ids: O(1) add at the back, remove anywhere, pop from the front.",
    .tp_methods = order_methods,
    .tp_new = order_new,
};

/* ---- decode_step's common case ---------------------------------------------------------------------
 * decode_fast(seqs, steps, block_size, seq_type) -> (deferred, pairs, opens) | None: KVLedger.decode_step's
 * first loop. For each (request_id, token) pair in order: when the token lands inside the tail block
 * of a sequence that owns it alone (n % bs != 0, num_prompt < n < limit, not cow_tail, token a plain
 * int in [0, 2**32)), append it; otherwise defer the pair -- its position goes to `deferred`, and
 * (sequence, token) to `pairs` -- and raise the sequence's cow_tail flag for the rest of the loop, so
 * that its later pairs are deferred too. The flags are put back before returning. `opens` is True when
 * every deferred pair simply opens the next block of its own sequence from its promise (one pair per
 * sequence, none with a forked tail, n % bs == 0, promised > 0, n < limit, no block there yet, a plain
 * token id): then nothing can fail and decode_step applies them without its general check. Any input
 * the Python loop would reject or treat specially (an unknown id, a pair that is not a 2-tuple, a
 * sequence of another type) undoes every append and returns None: the Python loop then runs. */

typedef struct {
    Py_ssize_t tokens, num_prompt, limit, cow_tail, promised, table;
} SeqLayout;

/* Slot names, interned once (module init): looked up on the type at every call, never cached. */
static PyObject *name_tokens, *name_num_prompt, *name_limit, *name_cow_tail, *name_promised, *name_table,
    *name_blocks;

static int slot_offset(PyObject *type, PyObject *name, Py_ssize_t *offset) {
    PyObject *descr = PyObject_GetAttr(type, name);
    if (descr == NULL) {
        PyErr_Clear();
        return -1;
    }
    int ok = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
             ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX &&
             !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
    if (ok) *offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    Py_DECREF(descr);
    return ok ? 0 : -1;
}

static inline PyObject *slot_get(PyObject *obj, Py_ssize_t offset) { return *(PyObject **)((char *)obj + offset); }

static inline void slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value) {
    PyObject **where = (PyObject **)((char *)obj + offset);
    PyObject *old = *where;
    Py_INCREF(value);
    *where = value;
    Py_XDECREF(old);
}

static PyObject *native_decode_fast(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *seqs, *steps, *seq_type;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "OOnO:decode_fast", &seqs, &steps, &bs, &seq_type)) return NULL;
    SeqLayout L;
    if (!PyDict_CheckExact(seqs) || !PyList_CheckExact(steps) || bs <= 0 || !PyType_Check(seq_type) ||
        slot_offset(seq_type, name_tokens, &L.tokens) < 0 || slot_offset(seq_type, name_num_prompt, &L.num_prompt) < 0 ||
        slot_offset(seq_type, name_limit, &L.limit) < 0 || slot_offset(seq_type, name_cow_tail, &L.cow_tail) < 0 ||
        slot_offset(seq_type, name_promised, &L.promised) < 0 || slot_offset(seq_type, name_table, &L.table) < 0)
        Py_RETURN_NONE;
    Py_ssize_t n_steps = PyList_GET_SIZE(steps), n_appended = 0, n_raised = 0;
    PyObject **appended = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n_steps > 0 ? n_steps : 1));
    PyObject **raised = PyMem_Malloc(sizeof(PyObject *) * (size_t)(n_steps > 0 ? n_steps : 1));
    PyObject *deferred = PyList_New(0), *pairs = PyList_New(0), *result = NULL;
    PyTypeObject *table_type = NULL; /* the block table's type and its `blocks` slot, read at the first opening */
    Py_ssize_t blocks_offset = 0;
    int declined = 0, opens = 1;
    if (appended == NULL || raised == NULL || deferred == NULL || pairs == NULL) {
        if (deferred != NULL && pairs != NULL) PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n_steps; i++) {
        PyObject *pair = PyList_GET_ITEM(steps, i);
        /* str ids only: hashing and comparing them runs no Python code that could change the lists */
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(pair, 0))) {
            declined = 1;
            break;
        }
        PyObject *seq = PyDict_GetItemWithError(seqs, PyTuple_GET_ITEM(pair, 0)); /* borrowed */
        if (seq == NULL || Py_TYPE(seq) != (PyTypeObject *)seq_type) {
            PyErr_Clear(); /* an unhashable id: the Python loop words the error */
            declined = 1;
            break;
        }
        PyObject *tokens = slot_get(seq, L.tokens), *num_prompt = slot_get(seq, L.num_prompt);
        PyObject *limit = slot_get(seq, L.limit), *cow_tail = slot_get(seq, L.cow_tail);
        if (tokens == NULL || !PyList_CheckExact(tokens) || num_prompt == NULL || !PyLong_CheckExact(num_prompt) ||
            limit == NULL || !PyLong_CheckExact(limit) || (cow_tail != Py_True && cow_tail != Py_False)) {
            declined = 1;
            break;
        }
        Py_ssize_t n = PyList_GET_SIZE(tokens);
        PyObject *token = PyTuple_GET_ITEM(pair, 1);
        int fast = 0;
        if (n % bs != 0 && cow_tail == Py_False && PyLong_CheckExact(token)) {
            int overflow = 0;
            long long np = PyLong_AsLongLongAndOverflow(num_prompt, &overflow);
            long long lim = overflow ? 0 : PyLong_AsLongLongAndOverflow(limit, &overflow);
            long long t = overflow ? 0 : PyLong_AsLongLongAndOverflow(token, &overflow);
            if (PyErr_Occurred()) PyErr_Clear();
            if (overflow) {
                declined = 1; /* numbers beyond 64 bits: let Python compare them */
                break;
            }
            fast = np < n && n < lim && t >= 0 && (unsigned long long)t <= MAX_TOKEN;
        }
        if (fast) {
            if (PyList_Append(tokens, token) < 0) goto out;
            Py_INCREF(tokens);
            appended[n_appended++] = tokens;
        } else {
            PyObject *pos = PyLong_FromSsize_t(i);
            if (pos == NULL || PyList_Append(deferred, pos) < 0) {
                Py_XDECREF(pos);
                goto out;
            }
            Py_DECREF(pos);
            PyObject *deferred_pair = PyTuple_Pack(2, seq, token);
            if (deferred_pair == NULL || PyList_Append(pairs, deferred_pair) < 0) {
                Py_XDECREF(deferred_pair);
                goto out;
            }
            Py_DECREF(deferred_pair);
            if (cow_tail == Py_False) {
                slot_set(seq, L.cow_tail, Py_True);
                Py_INCREF(seq);
                raised[n_raised++] = seq;
            } else {
                opens = 0; /* a forked tail, or the sequence's second pair in this step */
            }
            if (opens) { /* does this pair just open the next block from the sequence's promise? */
                PyObject *promised = slot_get(seq, L.promised), *table = slot_get(seq, L.table), *blocks = NULL;
                if (table != NULL && table_type == NULL) {
                    table_type = Py_TYPE(table);
                    if (slot_offset((PyObject *)table_type, name_blocks, &blocks_offset) < 0) table_type = NULL;
                }
                if (table != NULL && table_type != NULL && Py_TYPE(table) == table_type)
                    blocks = slot_get(table, blocks_offset);
                int overflow = 0;
                long long lim = PyLong_AsLongLongAndOverflow(limit, &overflow);
                long long pr = promised != NULL && PyLong_CheckExact(promised) && !overflow
                                   ? PyLong_AsLongLongAndOverflow(promised, &overflow) : 0;
                long long t = PyLong_CheckExact(token) && !overflow ? PyLong_AsLongLongAndOverflow(token, &overflow) : -1;
                if (PyErr_Occurred()) PyErr_Clear();
                opens = !overflow && blocks != NULL && PyList_CheckExact(blocks) && n % bs == 0 && pr > 0 &&
                        n < lim && n >= PyList_GET_SIZE(blocks) * bs && t >= 0 && (unsigned long long)t <= MAX_TOKEN;
            }
        }
    }
    if (!declined) result = Py_BuildValue("(OOO)", deferred, pairs, opens && PyList_GET_SIZE(deferred) ? Py_True : Py_False);
out:
    if (result == NULL && appended != NULL) { /* declined or failed: take every append back, newest first */
        for (Py_ssize_t j = n_appended - 1; j >= 0; j--)
            PyList_SetSlice(appended[j], PyList_GET_SIZE(appended[j]) - 1, PyList_GET_SIZE(appended[j]), NULL);
    }
    if (raised != NULL) {
        for (Py_ssize_t j = 0; j < n_raised; j++) {
            slot_set(raised[j], L.cow_tail, Py_False);
            Py_DECREF(raised[j]);
        }
    }
    if (appended != NULL)
        for (Py_ssize_t j = 0; j < n_appended; j++) Py_DECREF(appended[j]);
    PyMem_Free(appended);
    PyMem_Free(raised);
    Py_XDECREF(deferred);
    Py_XDECREF(pairs);
    if (result == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return result;
}

/* prefix_hits(index, digests, ref, leased, written) -> (hits, retained, pending, ready) | None: admission's
 * prefix lookup. hits: the blocks indexed under the leading digests, up to the first miss; retained: how
 * many of them are idle cache (ref 0, not leased); pending: how many are not written yet; ready: how
 * many leading hits are written. */
static PyObject *native_prefix_hits(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *index, *digests, *ref, *leased, *written;
    if (!PyArg_ParseTuple(args, "OOOOO:prefix_hits", &index, &digests, &ref, &leased, &written)) return NULL;
    if (!PyDict_CheckExact(index) || (!PyList_CheckExact(digests) && !PyTuple_CheckExact(digests)) ||
        !PyList_CheckExact(ref) || !PyList_CheckExact(leased) || !PyList_CheckExact(written))
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(ref);
    if (PyList_GET_SIZE(leased) != n || PyList_GET_SIZE(written) != n) Py_RETURN_NONE;
    PyObject *hits = PyList_New(0);
    if (hits == NULL) return NULL;
    Py_ssize_t retained = 0, pending = 0, ready = 0;
    int ready_run = 1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(digests); i++) {
        PyObject *d = PySequence_Fast_GET_ITEM(digests, i);
        if (!PyBytes_CheckExact(d)) { /* a lookup of anything else could run Python code */
            Py_DECREF(hits);
            Py_RETURN_NONE;
        }
        PyObject *block = PyDict_GetItemWithError(index, d);
        if (block == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(hits);
                return NULL;
            }
            break;
        }
        Py_ssize_t b = block_id(block, n);
        long r = 0, l = 0;
        PyObject *w = b >= 0 ? PyList_GET_ITEM(written, b) : NULL;
        if (b < 0 || small_int(PyList_GET_ITEM(ref, b), &r) < 0 || small_int(PyList_GET_ITEM(leased, b), &l) < 0 ||
            (w != Py_True && w != Py_False)) {
            Py_DECREF(hits);
            Py_RETURN_NONE;
        }
        if (PyList_Append(hits, block) < 0) {
            Py_DECREF(hits);
            return NULL;
        }
        if (r == 0 && l == 0) retained++;
        if (w == Py_False) {
            pending++;
            ready_run = 0;
        } else if (ready_run) {
            ready++;
        }
    }
    PyObject *result = Py_BuildValue("(Nnnn)", hits, retained, pending, ready);
    return result;
}

/* ---- PolicyCore: the bookkeeping of the heap-ordered eviction policies -------------------------------
 * kvledger.core.eviction.PriorityPolicy and the prefix-tree policies of kvledger.core.eviction_tree (LFU-DA,
 * GDSF, ARC, S3-FIFO, SGLang priority) keep their state here when the C part is loaded; the Python classes
 * are the reference (and the fallback), and the tests run both on the same random sequences and require
 * the same victims. Every per-block fact lives in one 64-byte Node indexed by block id (plain ints in
 * [0, 2**26); what a link or an eviction reads once, in a Cold beside it); each queue's evictable
 * blocks sit in an indexed 4-ary heap ordered by (k1, seq), so add, remove and each victim are O(log n)
 * (ARC and S3-FIFO, whose k1 is 0, first try the ends of a list sorted by seq: O(1), see q_push).
 * Where the Python classes keep stale heap entries and skip them lazily, this keeps exactly the evictable
 * set in the heap (a tree policy's retained leaves: retained blocks none of whose children are retained);
 * the minimum is the same either way, and so are the victims.
 *
 * Keys: LFU/GDSF k1 = L + uses x weight, seq = the entry's tick; ARC and SGLang seq = the tick drawn at
 * placement (ARC k1 = 0, SGLang k1 = the priority); S3-FIFO k1 = 0, seq = the block's FIFO stamp (kept
 * while the block is active); the priority policy k1 = the level, seq = the tick at which the block joined
 * that level, and its order needs no heap: one FIFO list per level (the Python buckets), O(1) throughout.
 * Ghost lists (ARC's B1/B2, S3-FIFO's ghost) are ordered sets of ghost keys: a ring in put order, found
 * through an open-addressing table (see Ghost). */

enum { K_PRIORITY = 0, K_LFU, K_GDSF, K_ARC, K_S3FIFO, K_SGLANG, K_COUNT };
#define PC_DEFAULT_PRIORITY 35
#define PC_SMALL 0 /* S3-FIFO's queues; ARC's T1 = 0, T2 = 1 */
#define PC_MAIN 1
#define PC_MAX_FREQ 3
#define PC_LEVELS 101 /* PRIO: levels 0..100 */

/* A ghost's key is its digest's first PC_GHOST_KEY bytes (eviction_tree.GHOST_KEY_BYTES owns the width
 * and hands it to PolicyCore(), which refuses any other): a ghost only hints that an identity was evicted
 * lately, and 128 bits of BLAKE2b keep that hint exact in practice at a quarter of the 64 bytes. Held
 * as two uint64, a slot is half a line and no digest object is read when a block becomes a ghost. */
#define PC_GHOST_KEY 16
_Static_assert(PC_GHOST_KEY == 2 * sizeof(uint64_t), "a ghost key is two uint64");

typedef struct { /* a ghost on the ring: its key's 16 bytes, or (an object key) k[0] = the object's hash */
    uint64_t k[2];
} GEntry;

typedef struct { /* what is looked up or put: a 16-byte key, or an object key with its hash */
    uint64_t k[2];
    PyObject *obj; /* borrowed */
} GKey;

/* An ordered set of ghost keys: a ring in put order (a put writes the next entry, dropping the oldest reads
 * the first: both walk memory in order, so the oldest ghosts' hashes are known ahead and their table lines
 * asked for early), found through an open-addressing table that holds exactly the live ones. A key taken
 * from the middle (a hit) leaves a dead entry on the ring, passed over when the front reaches it; a full
 * ring is compacted (or doubled) in put order. */
typedef struct {
    GEntry *ring;     /* ringcap entries (a power of two); serial s lies at s & (ringcap - 1) */
    uint8_t *alive;   /* per ring position: 1 while its entry is in the set */
    PyObject **obj;   /* NULL until an object key is put; then per ring position that key or NULL */
    uint64_t *tab;    /* 0 empty, else the hash's low 32 bits << 32 | ring position + 1; linear probing,
                       * backward-shift deletion */
    uint64_t head, tail; /* serials: the oldest entry not yet passed; the next put's */
    Py_ssize_t ringcap, len, tabsize;
} Ghost;

typedef struct {
    double t;
    int32_t b;
} Expiry;

typedef struct { /* a heap slot carries its block's key, so sifting reads only the heap's own memory */
    double k1;
    int64_t seq;
    int32_t b;
} Slot;

#if defined(__GNUC__) || defined(__clang__)
#define PC_LINE_ALIGNED __attribute__((aligned(64)))
#define PC_PREFETCH(p) __builtin_prefetch(p)
#else
#define PC_LINE_ALIGNED
#define PC_PREFETCH(p) ((void)(p))
#endif

typedef struct { /* one block's facts, together, on one 64-byte line (the nodes are aligned): what a
                  * parent is asked (is it linked, of which generation, how many retained children, its
                  * heap place and key), so the leaf rule costs one line per parent */
    double k1;       /* retained: the key, then */
    int64_t seq;     /* the tie-break */
    int64_t gen, pgen; /* linked: its generation, its parent's at link time */
    int32_t lprev, lnext; /* PRIO: its level's FIFO list; ARC, S3: its queue's sorted list */
    int32_t hpos;    /* position in its queue's heap, PC_LISTED on its queue's sorted list, -1 none */
    int32_t parent, kids; /* linked: parent block (-1 none); retained children */
    int32_t uses;    /* LFU, GDSF, ARC: releases counted (0: none) */
    int16_t prio;    /* SGLang: -1 = none given; PRIO: the wanted priority */
    uint8_t ret, queue, linked;
    uint8_t flag;    /* ARC: often; S3: bit 0 freq set, bit 1 queue set, bit 2 stamp set; PRIO: want set */
    int8_t freq;     /* S3 */
    uint8_t s3q;     /* S3 */
} PC_LINE_ALIGNED Node;
_Static_assert(sizeof(Node) == 64, "a node is one cache line");

typedef struct { /* a block's facts read once per link or eviction, apart: the nodes stay one line each */
    PyObject *digest; /* linked: its identity (a reference) */
    union {           /* one kind's fact or the other's: a record stays half a line */
        uint64_t gk[2];  /* ARC, S3: its ghost key, copied at link (gkinl), else gk[0] = digest[:16]'s hash */
        double want_exp; /* PRIO: expiry of the wanted priority, NaN = never */
    };
    int32_t depth;    /* linked: depth */
    uint8_t gkinl;    /* gk holds the key's 16 bytes */
} Cold;
_Static_assert(sizeof(Cold) == 32, "a block's cold record is half a line");

typedef struct {
    PyObject_HEAD
    int kind, queues;
    Py_ssize_t cap;
    Node *n;
    Cold *c;    /* beside n, by block id */
    void *nraw; /* n's allocation (n is its first 64-byte aligned address) */
    Slot *heap[2];
    int32_t lhead[PC_LEVELS], ltail[PC_LEVELS]; /* PRIO: one FIFO list per level, as the Python buckets */
    uint64_t lmask[2];                          /* PRIO: which levels hold blocks */
    Py_ssize_t hlen[2], size[2], count;
    int64_t tick, gens;
    double age, entry_key, p;
    Py_ssize_t capacity, nwant;
    Ghost ghost[2];
    double *costs;
    Py_ssize_t ncosts;
    PyObject *cost_fn, *clock, *error;
    Expiry *exp;
    Py_ssize_t nexp, capexp;
    PyObject **ints; /* by block id: its int, made the first time it is a victim and kept (no allocation after) */
} PolicyCore;

static PyTypeObject PolicyCoreType;

/* ---- ghosts ----
 * What an OrderedDict of digest[:16] does for ARC's B1/B2 and S3-FIFO's ghost (insert at the back if absent,
 * delete, pop the oldest, membership), without a Python object per operation: a digest of 16 bytes or more
 * is held as its first 16 bytes, hashed by mixing them; anything else as the object digest[:16]. */
static int ghost_init(Ghost *g) {
    memset(g, 0, sizeof *g);
    return 0;
}

static void ghost_clear(Ghost *g) {
    if (g->obj != NULL)
        for (Py_ssize_t i = 0; i < g->ringcap; i++) Py_CLEAR(g->obj[i]);
    if (g->ringcap) memset(g->alive, 0, (size_t)g->ringcap);
    if (g->tabsize) memset(g->tab, 0, sizeof(uint64_t) * (size_t)g->tabsize);
    g->head = g->tail = 0;
    g->len = 0;
}

static void ghost_dealloc(Ghost *g) {
    ghost_clear(g);
    PyMem_Free(g->ring);
    PyMem_Free(g->alive);
    PyMem_Free(g->obj);
    PyMem_Free(g->tab);
}

/* 1 equal, 0 not, -1 error. */
static inline int ghost_eq(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (PyBytes_CheckExact(a) && PyBytes_CheckExact(b))
        return PyBytes_GET_SIZE(a) == PyBytes_GET_SIZE(b) &&
               memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(a)) == 0;
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

/* The hash of a 16-byte key: its bits are BLAKE2b's, mixed so that keys made by hand spread too. */
static inline uint64_t ghost_mix(const uint64_t k[2]) {
    uint64_t x = k[0] ^ (k[1] * 0x9E3779B97F4A7C15ULL);
    x ^= x >> 32;
    x *= 0xD6E8FEB86659FD93ULL;
    return x ^ (x >> 32);
}

static inline uint64_t gkey_hash(const GKey *q) { return q->obj == NULL ? ghost_mix(q->k) : q->k[0]; }

static inline PyObject *gentry_obj(const Ghost *g, Py_ssize_t pos) { return g->obj != NULL ? g->obj[pos] : NULL; }

static inline uint64_t gentry_hash(const Ghost *g, Py_ssize_t pos) {
    return gentry_obj(g, pos) == NULL ? ghost_mix(g->ring[pos].k) : g->ring[pos].k[0];
}

/* Whether ring position pos holds q: 1, 0, -1 error. */
static inline int ghost_holds(Ghost *g, int32_t pos, const GKey *q) {
    const GEntry *x = &g->ring[pos];
    PyObject *o = gentry_obj(g, pos);
    if (q->obj == NULL) return o == NULL && x->k[0] == q->k[0] && x->k[1] == q->k[1];
    return o != NULL && x->k[0] == q->k[0] ? ghost_eq(o, q->obj) : 0;
}

static inline uint64_t ghost_entry(uint64_t h, int32_t pos) {
    return (uint64_t)(uint32_t)h << 32 | (uint32_t)(pos + 1);
}

static inline int32_t ghost_entry_slot(uint64_t e) { return (int32_t)(uint32_t)e - 1; }

/* Ask for the table line a probe for hash h starts on. */
static inline void ghost_prefetch(const Ghost *g, uint64_t h) {
    if (g->len) PC_PREFETCH(&g->tab[(size_t)(uint32_t)h & ((size_t)g->tabsize - 1)]);
}

/* The table position holding q (hash h), or -1 absent (then *empty, when given and the table exists, is
 * the empty position the probe ended on: where q goes), -2 error. */
static Py_ssize_t ghost_find_at(Ghost *g, const GKey *q, uint64_t h, Py_ssize_t *empty) {
    if (g->tabsize == 0) return -1;
    size_t mask = (size_t)g->tabsize - 1, i = (size_t)(uint32_t)h & mask;
    if (g->len == 0) {
        if (empty != NULL) *empty = (Py_ssize_t)i; /* the table holds exactly the live entries: all empty */
        return -1;
    }
    uint32_t low = (uint32_t)h;
    for (;;) {
        uint64_t e = g->tab[i];
        if (e == 0) {
            if (empty != NULL) *empty = (Py_ssize_t)i;
            return -1;
        }
        if ((uint32_t)(e >> 32) == low) {
            int eq = ghost_holds(g, ghost_entry_slot(e), q);
            if (eq < 0) return -2;
            if (eq) return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

static inline Py_ssize_t ghost_find(Ghost *g, const GKey *q, uint64_t h) { return ghost_find_at(g, q, h, NULL); }

static void ghost_tab_insert(Ghost *g, int32_t pos) {
    uint64_t h = gentry_hash(g, pos);
    size_t mask = (size_t)g->tabsize - 1, i = (size_t)(uint32_t)h & mask;
    while (g->tab[i] != 0) i = (i + 1) & mask;
    g->tab[i] = ghost_entry(h, pos);
}

static void ghost_tab_delete(Ghost *g, size_t i) {
    size_t mask = (size_t)g->tabsize - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t e = g->tab[j];
        if (e == 0) break;
        size_t ideal = (size_t)(uint32_t)(e >> 32) & mask;
        /* the entry stays unless its ideal position is cyclically outside (i, j] */
        int stays = i <= j ? (i < ideal && ideal <= j) : (i < ideal || ideal <= j);
        if (!stays) {
            g->tab[i] = e;
            i = j;
        }
    }
    g->tab[i] = 0;
}

/* Remove the entry at table position tpos from the table and the ring (its ring entry goes dead). */
static void ghost_drop(Ghost *g, Py_ssize_t tpos) {
    int32_t pos = ghost_entry_slot(g->tab[tpos]);
    ghost_tab_delete(g, (size_t)tpos);
    g->alive[pos] = 0;
    if (g->obj != NULL) Py_CLEAR(g->obj[pos]);
    g->len--;
}

/* del ghosts[q] (q's hash h) if there: 1 deleted, 0 absent, -1 error. */
static int ghost_take(Ghost *g, const GKey *q, uint64_t h) {
    Py_ssize_t tpos = ghost_find(g, q, h);
    if (tpos == -2) return -1;
    if (tpos < 0) return 0;
    ghost_drop(g, tpos);
    return 1;
}

/* The live entries, in put order, onto a ring of cap entries (>= 2 * (len + 1), a power of two) and a
 * table of 2 * cap: serials start again at 0. */
static int ghost_resize(Ghost *g, Py_ssize_t cap) {
    GEntry *ring = PyMem_Malloc(sizeof(GEntry) * (size_t)cap);
    uint8_t *alive = PyMem_Calloc((size_t)cap, 1);
    uint64_t *tab = PyMem_Calloc((size_t)(2 * cap), sizeof(uint64_t));
    PyObject **obj = g->obj != NULL ? PyMem_Calloc((size_t)cap, sizeof(PyObject *)) : NULL;
    if (ring == NULL || alive == NULL || tab == NULL || (g->obj != NULL && obj == NULL)) {
        PyMem_Free(ring);
        PyMem_Free(alive);
        PyMem_Free(tab);
        PyMem_Free(obj);
        return PyErr_NoMemory(), -1;
    }
    Py_ssize_t n = 0;
    size_t mask = (size_t)g->ringcap - 1;
    for (uint64_t sn = g->head; sn != g->tail; sn++) {
        size_t pos = (size_t)sn & mask;
        if (!g->alive[pos]) continue;
        ring[n] = g->ring[pos];
        alive[n] = 1;
        if (obj != NULL) obj[n] = g->obj[pos]; /* the reference moves */
        n++;
    }
    PyMem_Free(g->ring);
    PyMem_Free(g->alive);
    PyMem_Free(g->obj);
    PyMem_Free(g->tab);
    g->ring = ring;
    g->alive = alive;
    g->obj = obj;
    g->tab = tab;
    g->ringcap = cap;
    g->tabsize = 2 * cap; /* at most a quarter full */
    g->head = 0;
    g->tail = (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) ghost_tab_insert(g, (int32_t)i);
    return 0;
}

/* ghosts[q] = None (q's hash h): appended when absent, left in place when there. */
static int ghost_put(Ghost *g, const GKey *q, uint64_t h) {
    Py_ssize_t empty = -1, tpos = ghost_find_at(g, q, h, &empty);
    if (tpos == -2) return -1;
    if (tpos >= 0) return 0;
    if (g->tail - g->head == (uint64_t)g->ringcap) { /* no room on the ring: compact it, doubled if need be */
        Py_ssize_t cap = g->ringcap ? g->ringcap : 64;
        while (cap < 2 * (g->len + 1)) cap *= 2;
        if (ghost_resize(g, cap) < 0) return -1;
        empty = -1; /* a new table: probe it afresh */
    }
    if (q->obj != NULL && g->obj == NULL) {
        g->obj = PyMem_Calloc((size_t)g->ringcap, sizeof(PyObject *));
        if (g->obj == NULL) return PyErr_NoMemory(), -1;
    }
    int32_t pos = (int32_t)(g->tail & (uint64_t)(g->ringcap - 1));
    g->ring[pos].k[0] = q->k[0];
    g->ring[pos].k[1] = q->k[1];
    g->alive[pos] = 1;
    if (q->obj != NULL) g->obj[pos] = Py_NewRef(q->obj);
    g->tail++;
    g->len++;
    if (empty >= 0)
        g->tab[empty] = ghost_entry(h, pos); /* where the probe for q ended: the first empty position */
    else
        ghost_tab_insert(g, pos);
    return 0;
}

#define GHOST_AHEAD 4 /* the front's table lines asked for this many entries ahead */

/* popitem(last=False): 0, or -1 with SystemError set when the table lost a live ghost. */
static int ghost_pop_front(Ghost *g) {
    if (g->len == 0) return 0;
    size_t rmask = (size_t)g->ringcap - 1;
    while (!g->alive[g->head & rmask]) g->head++;
    int32_t pos = (int32_t)(g->head & rmask);
    size_t mask = (size_t)g->tabsize - 1, i = (size_t)(uint32_t)gentry_hash(g, pos) & mask;
    for (;;) { /* a live entry is always in the table: an empty position first is a broken invariant */
        uint64_t e = g->tab[i];
        if (e == 0) {
            PyErr_SetString(PyExc_SystemError, "kvledger: a live ghost is missing from its table (a bug)");
            return -1;
        }
        if (ghost_entry_slot(e) == pos) break;
        i = (i + 1) & mask;
    }
    ghost_drop(g, (Py_ssize_t)i);
    g->head++;
    if (g->tail - g->head > GHOST_AHEAD) { /* a later pop's line, on its way meanwhile */
        size_t ahead = (size_t)(g->head + GHOST_AHEAD) & rmask;
        PC_PREFETCH(&g->tab[(size_t)(uint32_t)gentry_hash(g, (Py_ssize_t)ahead) & mask]);
    }
    return 0;
}

/* The hash of the entry a pop would take first (the front's, dead or alive); 0 when empty. */
static inline uint64_t ghost_front_hash(const Ghost *g) {
    return g->len ? gentry_hash(g, (Py_ssize_t)(g->head & (uint64_t)(g->ringcap - 1))) : 0;
}

static PyObject *ghost_list(Ghost *g) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    size_t mask = (size_t)g->ringcap - 1;
    for (uint64_t sn = g->head; sn != g->tail; sn++) {
        size_t pos = (size_t)sn & mask;
        if (!g->alive[pos]) continue;
        PyObject *o = gentry_obj(g, (Py_ssize_t)pos);
        PyObject *key = o != NULL ? Py_NewRef(o) : PyBytes_FromStringAndSize((const char *)g->ring[pos].k, PC_GHOST_KEY);
        if (key == NULL || PyList_Append(out, key) < 0) {
            Py_XDECREF(key);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
    }
    return out;
}

/* ---- arrays ---- */
#define PC_GROW(field, type)                                                            \
    do {                                                                                \
        type *grown = PyMem_Realloc(self->field, sizeof(type) * (size_t)cap);           \
        if (grown == NULL) return PyErr_NoMemory(), -1;                                 \
        memset(grown + self->cap, 0, sizeof(type) * (size_t)(cap - self->cap));        \
        self->field = grown;                                                            \
    } while (0)

static int pc_reserve(PolicyCore *self, Py_ssize_t key) {
    if (key < self->cap) return 0;
    Py_ssize_t cap = self->cap ? self->cap : 64;
    while (cap <= key) cap *= 2;
    if (cap > ORDER_MAX) cap = ORDER_MAX;
    {
        void *raw = PyMem_Malloc(sizeof(Node) * (size_t)cap + 64);
        if (raw == NULL) return PyErr_NoMemory(), -1;
        Node *grown = (Node *)(((uintptr_t)raw + 63) & ~(uintptr_t)63);
        if (self->cap) memcpy(grown, self->n, sizeof(Node) * (size_t)self->cap);
        memset(grown + self->cap, 0, sizeof(Node) * (size_t)(cap - self->cap));
        PyMem_Free(self->nraw);
        self->nraw = raw;
        self->n = grown;
    }
    PC_GROW(c, Cold);
    PC_GROW(ints, PyObject *);
    PC_GROW(heap[0], Slot);
    PC_GROW(heap[1], Slot);
    for (Py_ssize_t i = self->cap; i < cap; i++) {
        self->n[i].hpos = -1;
        self->n[i].prio = -1;
    }
    self->cap = cap;
    return 0;
}

/* ---- heaps ---- */
static inline int slot_less(const Slot *a, const Slot *b) {
    return a->k1 < b->k1 || (a->k1 == b->k1 && a->seq < b->seq);
}

#define HEAP_D 4 /* a 4-ary heap: half the levels of a binary one, the four children on adjacent slots */

static void heap_up(PolicyCore *s, int q, Py_ssize_t i) {
    Slot *h = s->heap[q], x = h[i];
    while (i > 0) {
        Py_ssize_t up = (i - 1) / HEAP_D;
        if (!slot_less(&x, &h[up])) break;
        h[i] = h[up];
        s->n[h[i].b].hpos = (int32_t)i;
        i = up;
    }
    h[i] = x;
    s->n[x.b].hpos = (int32_t)i;
}

static void heap_down(PolicyCore *s, int q, Py_ssize_t i) {
    Slot *h = s->heap[q], x = h[i];
    Py_ssize_t n = s->hlen[q];
    for (;;) {
        Py_ssize_t first = HEAP_D * i + 1, c = first;
        if (first >= n) break;
        Py_ssize_t last = first + HEAP_D < n ? first + HEAP_D : n;
        for (Py_ssize_t j = first + 1; j < last; j++)
            if (slot_less(&h[j], &h[c])) c = j;
        if (!slot_less(&h[c], &x)) break;
        h[i] = h[c];
        s->n[h[i].b].hpos = (int32_t)i;
        i = c;
    }
    h[i] = x;
    s->n[x.b].hpos = (int32_t)i;
}

static void heap_push_raw(PolicyCore *s, int32_t b) {
    int q = s->n[b].queue;
    Py_ssize_t i = s->hlen[q]++;
    Slot x = {s->n[b].k1, s->n[b].seq, b};
    s->heap[q][i] = x;
    heap_up(s, q, i);
}

static void heap_remove_raw(PolicyCore *s, int32_t b) {
    int q = s->n[b].queue;
    Py_ssize_t i = s->n[b].hpos, last = --s->hlen[q];
    s->n[b].hpos = -1;
    if (i == last) return;
    Slot *h = s->heap[q];
    h[i] = h[last];
    s->n[h[i].b].hpos = (int32_t)i;
    if (i > 0 && slot_less(&h[i], &h[(i - 1) / HEAP_D]))
        heap_up(s, q, i);
    else
        heap_down(s, q, i);
}

/* ---- a queue: ARC's and S3-FIFO's keys are (0, seq) with seq a tick, so a block that joins is nearly always
 * the newest (the list's back) and a parent left a leaf by its child's eviction is nearly always older than
 * every queued leaf (the list's front): those sit on a list sorted by seq, in O(1) and without sifting; a
 * block that fits neither end goes to the heap. The queue's first block is the older of the two fronts, so
 * the order (and every victim) is the heap's alone would give. The other kinds queue in the heap. */
#define PC_LISTED INT32_MAX

static inline int pc_lists(const PolicyCore *s) { return s->kind == K_ARC || s->kind == K_S3FIFO; }

static void q_push(PolicyCore *s, int32_t b) {
    if (pc_lists(s)) {
        int q = s->n[b].queue;
        int32_t h = s->lhead[q], t = s->ltail[q];
        int64_t seq = s->n[b].seq;
        if (t < 0) {
            s->n[b].lprev = s->n[b].lnext = -1;
            s->lhead[q] = s->ltail[q] = b;
            s->n[b].hpos = PC_LISTED;
            return;
        }
        if (seq > s->n[t].seq) {
            s->n[b].lprev = t;
            s->n[b].lnext = -1;
            s->n[t].lnext = b;
            s->ltail[q] = b;
            s->n[b].hpos = PC_LISTED;
            return;
        }
        if (seq < s->n[h].seq) {
            s->n[b].lprev = -1;
            s->n[b].lnext = h;
            s->n[h].lprev = b;
            s->lhead[q] = b;
            s->n[b].hpos = PC_LISTED;
            return;
        }
    }
    heap_push_raw(s, b);
}

static void q_remove(PolicyCore *s, int32_t b) {
    if (s->n[b].hpos != PC_LISTED) {
        heap_remove_raw(s, b);
        return;
    }
    int q = s->n[b].queue;
    int32_t p = s->n[b].lprev, nx = s->n[b].lnext;
    if (p >= 0) s->n[p].lnext = nx; else s->lhead[q] = nx;
    if (nx >= 0) s->n[nx].lprev = p; else s->ltail[q] = p;
    s->n[b].hpos = -1;
}

/* Queue q's first block (the next victim there unless S3-FIFO moves it on), -1 when empty. */
static inline int32_t q_first(const PolicyCore *s, int q) {
    int32_t l = pc_lists(s) ? s->lhead[q] : -1, hb = s->hlen[q] ? s->heap[q][0].b : -1;
    if (l < 0 || hb < 0) return l < 0 ? hb : l;
    return s->n[l].seq < s->heap[q][0].seq ? l : hb;
}

/* ---- the priority policy's levels: a block joins its level's back, the lowest level's front goes first */
static void level_append(PolicyCore *s, int32_t b) {
    int lv = (int)s->n[b].k1;
    s->n[b].lprev = s->ltail[lv];
    s->n[b].lnext = -1;
    if (s->ltail[lv] >= 0) s->n[s->ltail[lv]].lnext = b; else s->lhead[lv] = b;
    s->ltail[lv] = b;
    s->lmask[lv >> 6] |= 1ULL << (lv & 63);
    s->n[b].hpos = 0; /* listed */
}

static void level_unlink(PolicyCore *s, int32_t b) {
    int lv = (int)s->n[b].k1;
    int32_t p = s->n[b].lprev, nx = s->n[b].lnext;
    if (p >= 0) s->n[p].lnext = nx; else s->lhead[lv] = nx;
    if (nx >= 0) s->n[nx].lprev = p; else s->ltail[lv] = p;
    if (s->lhead[lv] < 0) s->lmask[lv >> 6] &= ~(1ULL << (lv & 63));
    s->n[b].hpos = -1;
}

static int32_t level_first(const PolicyCore *s) {
    if (s->lmask[0]) return s->lhead[__builtin_ctzll(s->lmask[0])];
    if (s->lmask[1]) return s->lhead[64 + __builtin_ctzll(s->lmask[1])];
    return -1;
}

/* ---- the tree ---- */
static inline int32_t pc_parent(const PolicyCore *s, int32_t b) {
    if (!s->n[b].linked) return -1;
    int32_t p = s->n[b].parent;
    return p >= 0 && s->n[p].linked && s->n[p].gen == s->n[b].pgen ? p : -1;
}

/* _take: the block leaves the retained set (a hit or a victim); its parent may become a leaf. */
static void pc_take(PolicyCore *s, int32_t b) {
    if (s->kind == K_PRIORITY)
        level_unlink(s, b);
    else if (s->n[b].hpos >= 0)
        q_remove(s, b);
    s->n[b].ret = 0;
    s->size[s->n[b].queue]--;
    s->count--;
    int32_t p = pc_parent(s, b);
    if (p >= 0) {
        if (--s->n[p].kids <= 0) {
            s->n[p].kids = 0;
            if (s->n[p].ret && s->n[p].hpos < 0) q_push(s, p);
        }
    }
}

/* pc_take for the root of queue q's heap (a victim). When its parent becomes a leaf of the same queue the
 * parent takes the root's place and sifts down, instead of the last slot sifting down from the root and
 * the parent sifting up from the bottom: a chain evicted leaf first (its parent released just before it,
 * so older) stops after one level. The heap holds the same set either way; keys are unique (seq is a
 * tick), so the minimum, and every victim, is the same. */
static void pc_take_root(PolicyCore *s, int32_t b, int q) {
    s->n[b].ret = 0;
    s->size[q]--;
    s->count--;
    int32_t p = pc_parent(s, b);
    int push = 0;
    if (p >= 0 && --s->n[p].kids <= 0) {
        s->n[p].kids = 0;
        push = s->n[p].ret && s->n[p].hpos < 0;
    }
    if (push && s->n[p].queue == q && s->n[b].hpos == 0) { /* b is the heap's root */
        s->n[b].hpos = -1;
        Slot x = {s->n[p].k1, s->n[p].seq, p};
        s->heap[q][0] = x;
        heap_down(s, q, 0);
    } else {
        q_remove(s, b);
        if (push) q_push(s, p);
    }
    int32_t root = q_first(s, q);
    if (root >= 0) { /* the next victim is likely the queue's new first: its parent's line on the way meanwhile */
        int32_t up = s->n[root].parent;
        if (up >= 0 && up < s->cap) PC_PREFETCH(&s->n[up]);
        if (s->kind == K_ARC || s->kind == K_S3FIFO) PC_PREFETCH(&s->c[root]); /* its ghost key, if it goes next */
    }
}

static Py_ssize_t pc_limit(const PolicyCore *s) {
    Py_ssize_t limit = s->capacity > s->count ? s->capacity : s->count;
    return limit > 1 ? limit : 1;
}

static double pc_cost(PolicyCore *s, int32_t depth) {
    if (depth < s->ncosts && s->costs[depth] == s->costs[depth]) return s->costs[depth];
    if (depth >= s->ncosts) {
        Py_ssize_t n = s->ncosts ? s->ncosts : 64;
        while (n <= depth) n *= 2;
        double *grown = PyMem_Realloc(s->costs, sizeof(double) * (size_t)n);
        if (grown == NULL) return PyErr_NoMemory(), -1.0;
        for (Py_ssize_t i = s->ncosts; i < n; i++) grown[i] = Py_NAN;
        s->costs = grown;
        s->ncosts = n;
    }
    PyObject *value = PyObject_CallFunction(s->cost_fn, "i", (int)depth);
    if (value == NULL) return -1.0;
    double c = PyFloat_AsDouble(value);
    Py_DECREF(value);
    if (c == -1.0 && PyErr_Occurred()) return -1.0;
    s->costs[depth] = c;
    return c;
}

static int pc_now(PolicyCore *s, double *now) {
    PyObject *value = PyObject_CallNoArgs(s->clock);
    if (value == NULL) return -1;
    *now = PyFloat_AsDouble(value);
    Py_DECREF(value);
    return *now == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static int exp_push(PolicyCore *s, double t, int32_t b) {
    if (s->nexp == s->capexp) {
        Py_ssize_t cap = s->capexp ? 2 * s->capexp : 64;
        Expiry *grown = PyMem_Realloc(s->exp, sizeof(Expiry) * (size_t)cap);
        if (grown == NULL) return PyErr_NoMemory(), -1;
        s->exp = grown;
        s->capexp = cap;
    }
    Py_ssize_t i = s->nexp++;
    Expiry e = {t, b};
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        Expiry u = s->exp[up];
        if (u.t < e.t || (u.t == e.t && u.b <= e.b)) break;
        s->exp[i] = u;
        i = up;
    }
    s->exp[i] = e;
    return 0;
}

static Expiry exp_pop(PolicyCore *s) {
    Expiry top = s->exp[0], e = s->exp[--s->nexp];
    Py_ssize_t i = 0, n = s->nexp;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && (s->exp[c + 1].t < s->exp[c].t || (s->exp[c + 1].t == s->exp[c].t && s->exp[c + 1].b < s->exp[c].b)))
            c++;
        if (e.t < s->exp[c].t || (e.t == s->exp[c].t && e.b <= s->exp[c].b)) break;
        s->exp[i] = s->exp[c];
        i = c;
    }
    if (n > 0) s->exp[i] = e;
    return top;
}

/* PriorityPolicy._expire: priorities whose time is up fall back to the default level (at its back). The
 * clock is read only while an expiry is pending. */
static int pc_expire(PolicyCore *s) {
    if (s->nexp == 0) return 0;
    double now;
    if (pc_now(s, &now) < 0) return -1;
    while (s->nexp && s->exp[0].t <= now) {
        int32_t b = exp_pop(s).b;
        if (!s->n[b].ret || s->n[b].k1 == PC_DEFAULT_PRIORITY) continue;
        if (!s->n[b].flag || s->c[b].want_exp != s->c[b].want_exp || s->c[b].want_exp > now) continue;
        level_unlink(s, b);
        s->n[b].k1 = PC_DEFAULT_PRIORITY;
        s->n[b].seq = s->tick++;
        level_append(s, b);
    }
    return 0;
}

/* _place: the block's queue and key as it becomes retained; -1 with an exception on failure. */
static int pc_place(PolicyCore *s, int32_t b) {
    switch (s->kind) {
    case K_LFU:
    case K_GDSF: {
        int32_t uses = ++s->n[b].uses;
        double w = 1.0;
        if (s->kind == K_GDSF) {
            w = pc_cost(s, s->n[b].linked ? s->c[b].depth : 0);
            if (w == -1.0 && PyErr_Occurred()) {
                s->n[b].uses--;
                return -1;
            }
        }
        double weighted = (double)uses * w;
        s->n[b].queue = 0;
        s->n[b].k1 = s->age + weighted;
        s->n[b].seq = s->tick++;
        return 0;
    }
    case K_ARC: {
        int32_t uses = ++s->n[b].uses;
        s->n[b].queue = (uses > 1 || s->n[b].flag) ? 1 : 0;
        s->n[b].k1 = 0.0;
        s->n[b].seq = s->tick++;
        return 0;
    }
    case K_S3FIFO: {
        int f = (s->n[b].flag & 1) ? s->n[b].freq : -1;
        s->n[b].freq = (int8_t)(f + 1 < PC_MAX_FREQ ? f + 1 : PC_MAX_FREQ);
        s->n[b].flag |= 1;
        if (!(s->n[b].flag & 4)) { /* its FIFO stamp: seq keeps it while the block is active */
            s->n[b].seq = s->tick++;
            s->n[b].flag |= 4;
        }
        s->n[b].queue = (s->n[b].flag & 2) ? s->n[b].s3q : PC_SMALL;
        s->n[b].k1 = 0.0;
        return 0;
    }
    case K_SGLANG:
        s->n[b].queue = 0;
        s->n[b].k1 = s->n[b].prio >= 0 ? s->n[b].prio : PC_DEFAULT_PRIORITY;
        s->n[b].seq = s->tick++;
        return 0;
    default: { /* K_PRIORITY */
        int level = PC_DEFAULT_PRIORITY;
        if (s->n[b].flag) {
            level = s->n[b].prio;
            double e = s->c[b].want_exp;
            if (e == e) {
                double now;
                if (pc_now(s, &now) < 0) return -1;
                if (e <= now)
                    level = PC_DEFAULT_PRIORITY;
                else if (exp_push(s, e, b) < 0)
                    return -1;
            }
        }
        s->n[b].queue = 0;
        s->n[b].k1 = level;
        s->n[b].seq = s->tick++;
        return 0;
    }
    }
}

static int pc_add(PolicyCore *s, int32_t b) {
    if (s->n[b].ret) {
        PyErr_Format(s->error, "block %d is retained already", (int)b);
        return -1;
    }
    if (pc_place(s, b) < 0) return -1;
    s->n[b].ret = 1;
    s->size[s->n[b].queue]++;
    s->count++;
    int32_t p = pc_parent(s, b);
    if (s->kind == K_PRIORITY) {
        level_append(s, b);
        return 0;
    }
    if (p >= 0 && s->n[p].kids++ == 0 && s->n[p].hpos >= 0) q_remove(s, p); /* no longer a leaf */
    if (s->n[b].kids <= 0) q_push(s, b);
    return 0;
}

static void pc_requeue(PolicyCore *s, int32_t b, int q, int64_t key) {
    if (s->n[b].hpos >= 0 && s->n[b].hpos != PC_LISTED && s->n[b].queue == q) { /* same queue, a later key: sift down in place */
        Py_ssize_t i = s->n[b].hpos;
        s->n[b].k1 = 0.0;
        s->n[b].seq = key;
        s->heap[q][i].k1 = 0.0;
        s->heap[q][i].seq = key;
        if (i > 0 && slot_less(&s->heap[q][i], &s->heap[q][(i - 1) / HEAP_D]))
            heap_up(s, q, i);
        else
            heap_down(s, q, i);
        return;
    }
    if (s->n[b].hpos >= 0) q_remove(s, b);
    s->size[s->n[b].queue]--;
    s->n[b].queue = (uint8_t)q;
    s->n[b].k1 = 0.0;
    s->n[b].seq = key;
    s->size[q]++;
    q_push(s, b);
}

/* _evict_from: the queue's victim (taken), or -1 (none there). */
static int32_t pc_evict_from(PolicyCore *s, int q) {
    for (;;) {
        int32_t b = q_first(s, q);
        if (b < 0) return -1;
        if (s->kind == K_S3FIFO) {
            int f = (s->n[b].flag & 1) ? s->n[b].freq : 0;
            if (q == PC_SMALL && f > 0) { /* used again while small: to main's tail */
                s->n[b].freq = 0;
                s->n[b].s3q = PC_MAIN;
                s->n[b].flag |= 2;
                pc_requeue(s, b, PC_MAIN, s->tick++);
                if (!s->size[PC_SMALL]) return -1;
                continue;
            }
            if (q == PC_MAIN && f > 0) { /* another round */
                s->n[b].freq = (int8_t)(f - 1);
                pc_requeue(s, b, PC_MAIN, s->tick++);
                continue;
            }
        }
        if (s->kind == K_LFU || s->kind == K_GDSF) s->entry_key = s->n[b].k1;
        pc_take_root(s, b, q);
        return b;
    }
}

static int pc_order(const PolicyCore *s, int order[2]) {
    if (s->kind == K_ARC) {
        Py_ssize_t t1 = s->size[0];
        int first = t1 && ((double)t1 > s->p || !s->size[1]) ? 0 : 1;
        order[0] = first;
        order[1] = 1 - first;
        return 2;
    }
    if (s->kind == K_S3FIFO) {
        Py_ssize_t small = s->size[PC_SMALL];
        int first = small && ((double)small >= 0.1 * (double)s->count || !s->size[PC_MAIN]) ? PC_SMALL : PC_MAIN;
        order[0] = first;
        order[1] = 1 - first;
        return 2;
    }
    order[0] = 0;
    return 1;
}

/* Block b's ghost key (set at link) into q, and its hash; q->obj is a new reference or NULL. */
static int pc_ghost_key(PolicyCore *s, int32_t b, GKey *q, uint64_t *h) {
    q->k[0] = s->c[b].gk[0];
    q->k[1] = s->c[b].gk[1];
    q->obj = NULL;
    if (!s->c[b].gkinl) { /* a digest under 16 bytes (or not bytes): its key object, made again */
        q->obj = PySequence_GetSlice(s->c[b].digest, 0, PC_GHOST_KEY);
        if (q->obj == NULL) return -1;
    }
    *h = gkey_hash(q);
    return 0;
}

static int pc_link_ghosts(PolicyCore *s, int32_t b, const GKey *q, uint64_t h);

/* The ghost list victim b joins (ARC, S3-FIFO), or NULL. */
static inline Ghost *pc_victim_ghost(PolicyCore *s, int32_t b) {
    if (!s->n[b].linked) return NULL;
    if (s->kind == K_ARC) return &s->ghost[(s->n[b].uses > 1 || s->n[b].flag) ? 1 : 0];
    if (s->kind == K_S3FIFO && (s->n[b].flag & 2) && s->n[b].s3q == PC_SMALL) return &s->ghost[0];
    return NULL;
}

/* Victim b's ghost entry (ARC, S3-FIFO), the ghost list bounded by limit (pc_limit as b was taken). */
static int pc_put_ghost(PolicyCore *s, int32_t b, Py_ssize_t limit) {
    Ghost *g = pc_victim_ghost(s, b);
    if (g == NULL) return 0;
    GKey q;
    uint64_t h;
    if (pc_ghost_key(s, b, &q, &h) < 0) return -1;
    ghost_prefetch(g, h);
    if (g->len >= limit) ghost_prefetch(g, ghost_front_hash(g)); /* the pop's line too */
    int rc = ghost_put(g, &q, h);
    Py_XDECREF(q.obj);
    if (rc < 0) return -1;
    return g->len > limit ? ghost_pop_front(g) : 0;
}

static int pc_on_evict(PolicyCore *s, int32_t b) {
    if (s->kind == K_LFU || s->kind == K_GDSF) {
        if (s->entry_key > s->age) s->age = s->entry_key;
        return 0;
    }
    return pc_put_ghost(s, b, pc_limit(s));
}

static void pc_forget(PolicyCore *s, int32_t b);

/* A new reference to the int b: made the first time, then kept (a victim costs no allocation). */
static inline PyObject *pc_int(PolicyCore *s, int32_t b) {
    if (s->ints[b] == NULL && (s->ints[b] = PyLong_FromLong(b)) == NULL) return NULL;
    return Py_NewRef(s->ints[b]);
}

/* pop_victims(n) into a new list, each victim also forgotten when forget is set; NULL with an exception
 * set. (A victim is a leaf: no block retained after it names it as parent, so forgetting it at once
 * changes nothing the later victims of the same call depend on. A tree policy refuses a call before
 * taking any victim; "no evictable leaf" midway cannot happen, a finite retained set has a leaf.) */
static PyObject *pc_pop(PolicyCore *s, Py_ssize_t n, int forget) {
    if (s->kind == K_PRIORITY) {
        if (pc_expire(s) < 0) return NULL;
        Py_ssize_t take = n < s->count ? n : s->count;
        PyObject *out = PyList_New(take > 0 ? take : 0);
        if (out == NULL) return NULL;
        for (Py_ssize_t i = 0; i < take; i++) {
            int32_t b = level_first(s);
            pc_take(s, b);
            if (forget && take == n) pc_forget(s, b); /* a refused call forgets nothing */
            PyObject *num = pc_int(s, b);
            if (num == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(out, i, num);
        }
        if (take < n) {
            Py_DECREF(out);
            PyErr_SetString(s->error, "fewer retained blocks than requested victims");
            return NULL;
        }
        return out;
    }
    if (n > s->count) {
        PyErr_SetString(s->error, "fewer retained blocks than requested victims");
        return NULL;
    }
    PyObject *out = PyList_New(n > 0 ? n : 0);
    if (out == NULL) return NULL;
    /* ARC and S3-FIFO choose a call's victims first and put their ghosts after, in the same order with the
     * same bounds: choosing reads no ghost, and a victim is a leaf, so nothing chosen later depends on an
     * earlier one's ghost or its being forgotten. Apart, the ghosts' table lines and keys can be asked for
     * a few victims ahead instead of each waiting for its own. */
    int ghosts = s->kind == K_ARC || s->kind == K_S3FIFO;
    int32_t *vict = NULL;
    Py_ssize_t *limits = NULL;
    if (ghosts && n > 0) {
        vict = PyMem_Malloc(sizeof(int32_t) * (size_t)n);
        limits = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)n);
        if (vict == NULL || limits == NULL) {
            PyMem_Free(vict);
            PyMem_Free(limits);
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int order[2], nq = pc_order(s, order);
        int32_t b = -1;
        for (int j = 0; j < nq && b < 0; j++) b = pc_evict_from(s, order[j]);
        if (b < 0) {
            PyErr_SetString(s->error, "no evictable leaf among the retained blocks");
            goto fail;
        }
        PyObject *num = pc_int(s, b);
        if (num == NULL) goto fail;
        PyList_SET_ITEM(out, i, num);
        if (ghosts) {
            vict[i] = b;
            limits[i] = pc_limit(s);
            continue;
        }
        if (pc_on_evict(s, b) < 0) goto fail;
        if (forget) pc_forget(s, b);
    }
    if (ghosts) {
        enum { KEYS_AHEAD = 8, LINES_AHEAD = 4 };
        for (Py_ssize_t i = 0; i < n && i < KEYS_AHEAD; i++) PC_PREFETCH(&s->c[vict[i]]);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i + KEYS_AHEAD < n) PC_PREFETCH(&s->c[vict[i + KEYS_AHEAD]]);
            if (i + LINES_AHEAD < n) { /* its key arrived meanwhile: its ghost table line now */
                int32_t a = vict[i + LINES_AHEAD];
                Ghost *g = pc_victim_ghost(s, a);
                if (g != NULL && s->c[a].gkinl) ghost_prefetch(g, ghost_mix(s->c[a].gk));
            }
            if (pc_put_ghost(s, vict[i], limits[i]) < 0) goto fail;
            if (forget) pc_forget(s, vict[i]);
        }
        PyMem_Free(vict);
        PyMem_Free(limits);
    }
    return out;
fail:
    PyMem_Free(vict);
    PyMem_Free(limits);
    Py_DECREF(out);
    return NULL;
}

static void pc_forget(PolicyCore *s, int32_t b) {
    if (b >= s->cap) return;
    if (s->kind == K_PRIORITY) {
        if (s->n[b].flag) {
            s->n[b].flag = 0;
            s->nwant--;
        }
        return;
    }
    if (!s->n[b].linked) return;
    s->n[b].linked = 0;
    Py_CLEAR(s->c[b].digest);
    s->n[b].kids = 0;
    switch (s->kind) {
    case K_LFU:
    case K_GDSF:
        s->n[b].uses = 0;
        break;
    case K_ARC:
        s->n[b].uses = 0;
        s->n[b].flag = 0;
        break;
    case K_S3FIFO:
        s->n[b].flag = 0;
        break;
    case K_SGLANG:
        s->n[b].prio = -1;
        break;
    }
}

static int pc_link(PolicyCore *s, int32_t b, PyObject *digest, PyObject *parent, int32_t depth) {
    int32_t up = -1;
    if (parent != Py_None) {
        Py_ssize_t p = order_key(parent);
        if (p >= 0 && p != b && p < s->cap && s->n[p].linked) up = (int32_t)p;
    }
    Py_INCREF(digest);
    Py_XSETREF(s->c[b].digest, digest);
    s->n[b].gen = s->gens++;
    s->n[b].parent = up;
    s->n[b].pgen = up >= 0 ? s->n[up].gen : 0;
    s->c[b].depth = depth;
    s->n[b].linked = 1;
    if (s->kind != K_ARC && s->kind != K_S3FIFO) return 0;
    if (PyBytes_CheckExact(digest) && PyBytes_GET_SIZE(digest) >= PC_GHOST_KEY) {
        memcpy(s->c[b].gk, PyBytes_AS_STRING(digest), PC_GHOST_KEY);
        s->c[b].gkinl = 1;
    } else { /* rare (tests): digest[:16] as an object, compared as Python compares it */
        PyObject *obj = PySequence_GetSlice(digest, 0, PC_GHOST_KEY);
        if (obj == NULL) return -1;
        Py_hash_t oh = PyObject_Hash(obj);
        Py_DECREF(obj);
        if (oh == -1) return -1;
        s->c[b].gk[0] = (uint64_t)oh;
        s->c[b].gk[1] = 0;
        s->c[b].gkinl = 0;
    }
    GKey q;
    uint64_t h;
    if (pc_ghost_key(s, b, &q, &h) < 0) return -1;
    int rc = pc_link_ghosts(s, b, &q, h);
    Py_XDECREF(q.obj);
    return rc;
}

/* Whether the linked block's ghost key q is in a ghost list (taken out if so), and what that does. */
static int pc_link_ghosts(PolicyCore *s, int32_t b, const GKey *q, uint64_t h) {
    if (s->kind == K_ARC) {
        Ghost *b1 = &s->ghost[0], *b2 = &s->ghost[1];
        ghost_prefetch(b1, h);
        ghost_prefetch(b2, h);
        Py_ssize_t len1 = b1->len, len2 = b2->len; /* the lengths before the take (the step reads them) */
        int in1 = ghost_take(b1, q, h);
        if (in1 < 0) return -1;
        if (in1) {
            double step = len1 ? (double)len2 / (double)len1 : 0.0, limit = (double)pc_limit(s);
            double grown = s->p + (1.0 >= step ? 1.0 : step);
            s->p = limit <= grown ? limit : grown;
            s->n[b].flag = 1;
            return 0;
        }
        int in2 = ghost_take(b2, q, h);
        if (in2 < 0) return -1;
        if (in2) {
            double step = len2 ? (double)len1 / (double)len2 : 0.0;
            double shrunk = s->p - (1.0 >= step ? 1.0 : step);
            s->p = 0.0 >= shrunk ? 0.0 : shrunk;
            s->n[b].flag = 1;
        }
    } else {
        int in = ghost_take(&s->ghost[0], q, h);
        if (in < 0) return -1;
        s->n[b].s3q = in ? PC_MAIN : PC_SMALL;
        s->n[b].freq = -1;
        s->n[b].seq = s->tick++; /* its FIFO stamp */
        s->n[b].flag = 1 | 2 | 4;
    }
    return 0;
}

/* ---- the Python type ---- */

/* A block id argument; -1 with TypeError set for anything else (the policies take block ids only). */
static Py_ssize_t pc_key(PolicyCore *self, PyObject *o) {
    Py_ssize_t k = order_key(o);
    if (k < 0) {
        PyErr_Format(PyExc_TypeError, "eviction policies take block ids (ints in 0..%d), got %R", ORDER_MAX - 1, o);
        return -1;
    }
    if (pc_reserve(self, k) < 0) return -1;
    return k;
}

static PyObject *pc_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    int kind;
    PyObject *error, *clock = Py_None, *cost_fn = Py_None;
    Py_ssize_t ghost_key = -1;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "PolicyCore() takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iO|OOn:PolicyCore", &kind, &error, &clock, &cost_fn, &ghost_key)) return NULL;
    if (kind < 0 || kind >= K_COUNT || !PyExceptionClass_Check(error)) {
        PyErr_SetString(PyExc_ValueError, "PolicyCore(kind, error class[, clock, cost_fn, ghost_key_bytes])");
        return NULL;
    }
    if ((kind == K_ARC || kind == K_S3FIFO) && ghost_key != PC_GHOST_KEY) { /* the Python side owns the width */
        PyErr_Format(PyExc_ValueError, "PolicyCore keys its ghosts by %d bytes of a digest, the policy asks %zd",
                     PC_GHOST_KEY, ghost_key);
        return NULL;
    }
    PolicyCore *self = (PolicyCore *)type->tp_alloc(type, 0); /* zero-filled */
    if (self == NULL) return NULL;
    self->kind = kind;
    self->queues = (kind == K_ARC || kind == K_S3FIFO) ? 2 : 1;
    self->gens = 1;
    for (int lv = 0; lv < PC_LEVELS; lv++) self->lhead[lv] = self->ltail[lv] = -1;
    self->error = Py_NewRef(error);
    self->clock = Py_NewRef(clock);
    self->cost_fn = Py_NewRef(cost_fn);
    if (ghost_init(&self->ghost[0]) < 0 || ghost_init(&self->ghost[1]) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void pc_free_arrays(PolicyCore *self) {
    for (Py_ssize_t i = 0; i < self->cap; i++) {
        Py_CLEAR(self->c[i].digest);
        Py_CLEAR(self->ints[i]);
    }
    void *arrays[] = {self->nraw, self->c, self->heap[0], self->heap[1], self->costs, self->exp, self->ints};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) PyMem_Free(arrays[i]);
}

static void pc_dealloc(PolicyCore *self) {
    pc_free_arrays(self);
    ghost_dealloc(&self->ghost[0]);
    ghost_dealloc(&self->ghost[1]);
    Py_XDECREF(self->error);
    Py_XDECREF(self->clock);
    Py_XDECREF(self->cost_fn);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *pcm_add(PolicyCore *self, PyObject *key) {
    Py_ssize_t b = pc_key(self, key);
    if (b < 0 || pc_add(self, (int32_t)b) < 0) return NULL;
    Py_RETURN_NONE;
}

/* add_many(blocks): add each in order (stops at the first refused, as the Python loop does). */
static PyObject *pcm_add_many(PolicyCore *self, PyObject *blocks) {
    PyObject *seq = PySequence_Fast(blocks, "add_many takes a sequence of block ids");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *const *items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t b = pc_key(self, items[i]);
        if (b < 0 || pc_add(self, (int32_t)b) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static int pc_remove(PolicyCore *self, PyObject *key) {
    Py_ssize_t b = order_key(key);
    if (b < 0 || b >= self->cap || !self->n[b].ret) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    pc_take(self, (int32_t)b);
    return 0;
}

static PyObject *pcm_remove(PolicyCore *self, PyObject *key) {
    if (pc_remove(self, key) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *pcm_pop_victims(PolicyCore *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    return pc_pop(self, n, 0);
}

/* take_victims(n): pop_victims(n), each victim also forgotten (the pool's eviction when nobody else
 * needs to see the victims before they lose their identity). */
static PyObject *pcm_take_victims(PolicyCore *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    return pc_pop(self, n, 1);
}

static PyObject *pcm_forget(PolicyCore *self, PyObject *key) {
    Py_ssize_t b = order_key(key);
    if (b >= 0) pc_forget(self, (int32_t)b);
    Py_RETURN_NONE;
}

/* link(block, digest, parent, depth) */
static PyObject *pcm_link(PolicyCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "link takes (block, digest, parent, depth)");
        return NULL;
    }
    Py_ssize_t b = pc_key(self, args[0]);
    if (b < 0) return NULL;
    if (args[2] != Py_None) {
        Py_ssize_t p = order_key(args[2]);
        if (p >= 0 && pc_reserve(self, p) < 0) return NULL;
    }
    long depth = PyLong_AsLong(args[3]);
    if (depth == -1 && PyErr_Occurred()) return NULL;
    if (depth < 0 || depth > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "depth must be >= 0");
        return NULL;
    }
    if (pc_link(self, (int32_t)b, args[1], args[2], (int32_t)depth) < 0) return NULL;
    Py_RETURN_NONE;
}

/* set_want(block, priority, expires_at | None): PriorityPolicy's remembered priority; SGLang's keeps the
 * highest given (the Python side checked the value). */
static PyObject *pcm_set_want(PolicyCore *self, PyObject *args) {
    PyObject *key, *expires;
    int priority;
    if (!PyArg_ParseTuple(args, "OiO:set_want", &key, &priority, &expires)) return NULL;
    if (priority < 0 || priority >= PC_LEVELS) {
        PyErr_SetString(PyExc_ValueError, "priority must be in 0..100");
        return NULL;
    }
    Py_ssize_t b = pc_key(self, key);
    if (b < 0) return NULL;
    if (self->kind == K_SGLANG) {
        if (priority > self->n[b].prio) self->n[b].prio = (int16_t)priority;
        Py_RETURN_NONE;
    }
    if (self->kind != K_PRIORITY) Py_RETURN_NONE; /* the others keep no wanted priority (want_exp is PRIO's) */
    double e = Py_NAN;
    if (expires != Py_None) {
        e = PyFloat_AsDouble(expires);
        if (e == -1.0 && PyErr_Occurred()) return NULL;
    }
    if (!self->n[b].flag) self->nwant++;
    self->n[b].flag = 1;
    self->n[b].prio = (int16_t)priority;
    self->c[b].want_exp = e;
    Py_RETURN_NONE;
}

/* The retained blocks as (rank, k1, seq, block) rows, sorted: blocks() (every one) or peek() (leaves only). */
typedef struct {
    int rank;
    double k1;
    int64_t seq;
    int32_t b;
} Row;

static int row_cmp(const void *x, const void *y) {
    const Row *a = x, *b = y;
    if (a->rank != b->rank) return a->rank < b->rank ? -1 : 1;
    if (a->k1 != b->k1) return a->k1 < b->k1 ? -1 : 1;
    return a->seq < b->seq ? -1 : a->seq > b->seq;
}

static PyObject *pc_sorted(PolicyCore *self, int leaves, Py_ssize_t limit) {
    if (self->kind == K_PRIORITY && pc_expire(self) < 0) return NULL;
    int order[2] = {0, 1}, rank[2] = {0, 1};
    int nq = pc_order(self, order);
    for (int j = 0; j < nq; j++) rank[order[j]] = j;
    Row *rows = PyMem_Malloc(sizeof(Row) * (size_t)(self->count > 0 ? self->count : 1));
    if (rows == NULL) return PyErr_NoMemory();
    Py_ssize_t n = 0;
    for (Py_ssize_t b = 0; b < self->cap; b++) {
        if (!self->n[b].ret || (leaves && self->n[b].kids > 0)) continue;
        Row r = {rank[self->n[b].queue], self->n[b].k1, self->n[b].seq, (int32_t)b};
        rows[n++] = r;
    }
    qsort(rows, (size_t)n, sizeof(Row), row_cmp);
    if (limit >= 0 && limit < n) n = limit;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *num = PyLong_FromLong(rows[i].b);
        if (num == NULL) Py_CLEAR(out); else PyList_SET_ITEM(out, i, num);
    }
    PyMem_Free(rows);
    return out;
}

static PyObject *pcm_blocks(PolicyCore *self, PyObject *Py_UNUSED(ignored)) { return pc_sorted(self, 0, -1); }

static PyObject *pcm_peek(PolicyCore *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    return pc_sorted(self, self->kind != K_PRIORITY, n > 0 ? n : 0);
}

static PyObject *pcm_clear(PolicyCore *self, PyObject *Py_UNUSED(ignored)) {
    for (Py_ssize_t b = 0; b < self->cap; b++) {
        Py_CLEAR(self->c[b].digest);
        self->n[b].ret = self->n[b].linked = 0;
        self->n[b].hpos = -1;
        self->n[b].kids = 0;
        self->n[b].uses = 0; /* every kind forgets its per-block facts */
        self->n[b].flag = 0;
        self->n[b].prio = -1;
    }
    self->hlen[0] = self->hlen[1] = self->size[0] = self->size[1] = self->count = 0;
    for (int lv = 0; lv < PC_LEVELS; lv++) self->lhead[lv] = self->ltail[lv] = -1;
    self->lmask[0] = self->lmask[1] = 0;
    self->nwant = self->nexp = 0;
    self->age = 0.0;
    self->p = 0.0;
    ghost_clear(&self->ghost[0]);
    ghost_clear(&self->ghost[1]);
    Py_RETURN_NONE;
}

/* configure(num_blocks): the pool's size (the ghost lists' bound). */
static PyObject *pcm_configure(PolicyCore *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    self->capacity = n;
    Py_RETURN_NONE;
}

/* reset_costs(cost_fn): the block cost by depth changed; cost_fn(depth) -> float is asked again. */
static PyObject *pcm_reset_costs(PolicyCore *self, PyObject *fn) {
    Py_INCREF(fn);
    Py_XSETREF(self->cost_fn, fn);
    for (Py_ssize_t i = 0; i < self->ncosts; i++) self->costs[i] = Py_NAN;
    Py_RETURN_NONE;
}

static PyObject *pcm_depth(PolicyCore *self, PyObject *key) {
    Py_ssize_t b = order_key(key);
    return PyLong_FromLong(b >= 0 && b < self->cap && self->n[b].linked ? self->c[b].depth : 0);
}

static PyObject *pcm_digest(PolicyCore *self, PyObject *key) {
    Py_ssize_t b = order_key(key);
    return Py_NewRef(b >= 0 && b < self->cap && self->n[b].linked ? self->c[b].digest : Py_None);
}

static PyObject *pcm_parent(PolicyCore *self, PyObject *key) {
    Py_ssize_t b = order_key(key);
    int32_t p = b >= 0 && b < self->cap ? pc_parent(self, (int32_t)b) : -1;
    if (p < 0) Py_RETURN_NONE;
    return PyLong_FromLong(p);
}

/* level(block) -> int | None: the priority policy's level of a retained block. */
static PyObject *pcm_level(PolicyCore *self, PyObject *key) {
    Py_ssize_t b = order_key(key);
    if (b < 0 || b >= self->cap || !self->n[b].ret) Py_RETURN_NONE;
    return PyLong_FromLong((long)self->n[b].k1);
}

/* state() -> dict: the scalars and ghost lists (for tests and reports). */
static PyObject *pcm_state(PolicyCore *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *g0 = ghost_list(&self->ghost[0]), *g1 = ghost_list(&self->ghost[1]);
    if (g0 == NULL || g1 == NULL) {
        Py_XDECREF(g0);
        Py_XDECREF(g1);
        return NULL;
    }
    return Py_BuildValue("{s:d,s:d,s:N,s:N,s:n,s:n,s:n}", "age", self->age, "p", self->p, "ghost0", g0, "ghost1", g1,
                         "size0", self->size[0], "size1", self->size[1], "wants", self->nwant + self->nexp);
}

static Py_ssize_t pc_len(PolicyCore *self) { return self->count; }

static int pc_contains(PolicyCore *self, PyObject *key) {
    Py_ssize_t b = order_key(key);
    return b >= 0 && b < self->cap && self->n[b].ret;
}

static PyMethodDef pc_methods[] = {
    {"add", (PyCFunction)pcm_add, METH_O, "A block becomes retained."},
    {"add_many", (PyCFunction)pcm_add_many, METH_O, "Blocks become retained, in order."},
    {"remove", (PyCFunction)pcm_remove, METH_O, "A request took the block back (KeyError if not retained)."},
    {"pop_victims", (PyCFunction)pcm_pop_victims, METH_O, "Take the next n victims."},
    {"take_victims", (PyCFunction)pcm_take_victims, METH_O, "Take the next n victims and forget them."},
    {"forget", (PyCFunction)pcm_forget, METH_O, "The block lost its identity."},
    {"link", (PyCFunction)(void (*)(void))pcm_link, METH_FASTCALL, "The block holds an identity under a parent."},
    {"set_want", (PyCFunction)pcm_set_want, METH_VARARGS, "A request's priority for the block."},
    {"blocks", (PyCFunction)pcm_blocks, METH_NOARGS, "Every retained block, in eviction order."},
    {"peek", (PyCFunction)pcm_peek, METH_O, "The next n likely victims."},
    {"clear", (PyCFunction)pcm_clear, METH_NOARGS, "Forget everything."},
    {"configure", (PyCFunction)pcm_configure, METH_O, "The pool's size."},
    {"reset_costs", (PyCFunction)pcm_reset_costs, METH_O, "A new block cost by depth."},
    {"depth", (PyCFunction)pcm_depth, METH_O, "A linked block's depth (0 otherwise)."},
    {"digest", (PyCFunction)pcm_digest, METH_O, "A linked block's digest (None otherwise)."},
    {"parent", (PyCFunction)pcm_parent, METH_O, "A linked block's parent, if it still holds its identity."},
    {"level", (PyCFunction)pcm_level, METH_O, "A retained block's priority level."},
    {"state", (PyCFunction)pcm_state, METH_NOARGS, "Scalars and ghost lists."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods pc_as_sequence = {
    .sq_length = (lenfunc)pc_len,
    .sq_contains = (objobjproc)pc_contains,
};

static PyTypeObject PolicyCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvledger.core._native.PolicyCore",
    .tp_basicsize = sizeof(PolicyCore),
    .tp_dealloc = (destructor)pc_dealloc,
    .tp_as_sequence = &pc_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The heap-ordered eviction policies' bookkeeping (kvledger.core.eviction_tree).",
    .tp_methods = pc_methods,
    .tp_new = pc_new,
};

/* register_linked(index, digest, group, blocks, digests, start, trust_group, core) -> True | None:
 * register_many, telling a native tree policy each new identity's parent (the block indexed under the
 * previous digest) and depth. */
static PyObject *native_register_linked(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *index, *digest, *group, *blocks, *digests, *trust, *core_obj;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "OOOOOnOO:register_linked", &index, &digest, &group, &blocks, &digests, &start, &trust,
                          &core_obj))
        return NULL;
    if (!PyDict_CheckExact(index) || !PyList_CheckExact(digest) || !PyList_CheckExact(group) ||
        PyList_GET_SIZE(group) != PyList_GET_SIZE(digest) || !PyList_CheckExact(blocks) ||
        !PyList_CheckExact(digests) || start < 0 || PyList_GET_SIZE(blocks) < PyList_GET_SIZE(digests) ||
        !Py_IS_TYPE(core_obj, &PolicyCoreType))
        Py_RETURN_NONE;
    PolicyCore *core = (PolicyCore *)core_obj;
    Py_ssize_t n = PyList_GET_SIZE(digest), stop = PyList_GET_SIZE(digests);
    for (Py_ssize_t i = start; i < stop; i++)
        if (block_id(PyList_GET_ITEM(blocks, i), n) < 0 || !PyBytes_CheckExact(PyList_GET_ITEM(digests, i)))
            Py_RETURN_NONE;
    if (n > 0 && pc_reserve(core, n - 1) < 0) return NULL;
    int prev_new = 0; /* digests[i - 1] was indexed by this call: its block is blocks[i - 1] */
    for (Py_ssize_t i = start; i < stop; i++) {
        PyObject *d = PyList_GET_ITEM(digests, i), *block = PyList_GET_ITEM(blocks, i);
        int has = PyDict_Contains(index, d);
        if (has < 0) return NULL;
        if (has) {
            prev_new = 0;
            continue;
        }
        Py_ssize_t b = block_id(block, n);
        if (PyDict_SetItem(index, d, block) < 0 || set_list_item(digest, b, d) < 0 || set_list_item(group, b, trust) < 0)
            return NULL;
        PyObject *parent = Py_None;
        if (prev_new) {
            parent = PyList_GET_ITEM(blocks, i - 1);
        } else if (i > 0) {
            parent = PyDict_GetItemWithError(index, PyList_GET_ITEM(digests, i - 1)); /* borrowed */
            if (parent == NULL) {
                if (PyErr_Occurred()) return NULL;
                parent = Py_None;
            } else if (order_key(parent) >= core->cap) {
                parent = Py_None; /* never linked: the same as unknown */
            }
        }
        if (pc_link(core, (int32_t)b, d, parent, (int32_t)i) < 0) return NULL;
        prev_new = 1;
    }
    Py_RETURN_TRUE;
}

/* share_blocks(ref, leased, order, blocks) -> int | None: BlockPool.share for each block in order,
 * with the retained order held by a BlockOrder (LRU) or a PolicyCore (the heap policies): ref += 1; a
 * block at ref 0 leaves the order (idle cache taken again) unless it is leased (a deferred release picked up again: the returned count of those
 * is subtracted from the pool's deferred count). None, changing nothing, for any other input --
 * including a block at ref 0 that the order does not hold, so that Python raises as it would. */
static PyObject *native_share_blocks(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ref, *leased, *order_obj, *blocks;
    if (!PyArg_ParseTuple(args, "OOOO:share_blocks", &ref, &leased, &order_obj, &blocks)) return NULL;
    int tree = Py_IS_TYPE(order_obj, &PolicyCoreType);
    if (!PyList_CheckExact(ref) || !PyList_CheckExact(leased) || (!tree && !Py_IS_TYPE(order_obj, &BlockOrderType)) ||
        PyList_GET_SIZE(leased) != PyList_GET_SIZE(ref))
        Py_RETURN_NONE;
    BlockOrder *order = tree ? NULL : (BlockOrder *)order_obj;
    PolicyCore *core = tree ? (PolicyCore *)order_obj : NULL;
    Py_ssize_t n = PyList_GET_SIZE(ref), count = 0;
    Py_ssize_t *ids = block_ids(blocks, n, &count);
    if (ids == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    uint8_t *seen = PyMem_Calloc((size_t)(n > 0 ? n : 1), 1);
    if (seen == NULL) {
        PyMem_Free(ids);
        return PyErr_NoMemory();
    }
    long r, l;
    for (Py_ssize_t i = 0; i < count; i++) { /* check first: the pool's types, every idle block in the order */
        Py_ssize_t b = ids[i];
        if (small_int(PyList_GET_ITEM(ref, b), &r) < 0 || small_int(PyList_GET_ITEM(leased, b), &l) < 0 ||
            r < 0 || r > LONG_MAX / 2 ||
            (!seen[b] && r == 0 && l == 0 &&
             (tree ? (b >= core->cap || !core->n[b].ret) : (b >= order->cap || !order->member[b])))) {
            PyMem_Free(seen);
            PyMem_Free(ids);
            Py_RETURN_NONE;
        }
        seen[b] = 1;
    }
    PyMem_Free(seen);
    Py_ssize_t picked_up = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t b = ids[i];
        small_int(PyList_GET_ITEM(ref, b), &r);
        if (r == 0) {
            small_int(PyList_GET_ITEM(leased, b), &l);
            if (l == 0 && tree)
                pc_take(core, (int32_t)b);
            else if (l == 0)
                order_unlink(order, b);
            else
                picked_up++;
        }
        PyObject *num = PyLong_FromLong(r + 1);
        if (num == NULL || PyList_SetItem(ref, b, num) < 0) {
            PyMem_Free(ids);
            return NULL;
        }
    }
    PyMem_Free(ids);
    return PyLong_FromSsize_t(picked_up);
}

static PyMethodDef native_methods[] = {
    {"blake2b", native_blake2b, METH_VARARGS, "BLAKE2b-512 of a bytes object (RFC 7693)."},
    {"chain_bytes", native_chain_bytes, METH_VARARGS, "Chained BLAKE2b digests of every full block of uint32 token bytes."},
    {"prompt_digests", native_prompt_digests, METH_VARARGS, "Check a prompt's token ids and chain-hash its full blocks (None: use the Python path)."},
    {"block_digest", (PyCFunction)(void (*)(void))native_block_digest, METH_FASTCALL, "Digest of one block of a token list chained to its parent (None: use the Python path)."},
    {"check_tokens", native_check_tokens, METH_O, "Whether every item is a plain int in [0, 2**32)."},
    {"release_scan", native_release_scan, METH_VARARGS, "BlockPool.release_many's per-block decisions in one pass."},
    {"clear_identity", native_clear_identity, METH_VARARGS, "Evicted blocks lose their identity."},
    {"add_refs", native_add_refs, METH_VARARGS, "One more reference on blocks that are all held already."},
    {"set_items", native_set_items, METH_VARARGS, "target[ids[i]] = value for i in range(start, stop)."},
    {"register_many", native_register_many, METH_VARARGS, "Index new full blocks under their digests."},
    {"prefix_hits", native_prefix_hits, METH_VARARGS, "Admission's prefix lookup: hits, idle, pending, ready."},
    {"share_blocks", native_share_blocks, METH_VARARGS, "BlockPool.share for each block, the LRU order in a BlockOrder."},
    {"register_linked", native_register_linked, METH_VARARGS, "register_many, telling a native tree policy each identity's parent and depth."},
    {"decode_fast", native_decode_fast, METH_VARARGS, "KVLedger.decode_step's common case: tokens inside a private tail block."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "kvledger.core._native",
    "The ledger core's optional C part; kvledger.core.native decides whether it is used.", -1, native_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&BlockOrderType) < 0 || PyType_Ready(&PolicyCoreType) < 0) return NULL;
    if ((name_tokens = PyUnicode_InternFromString("tokens")) == NULL ||
        (name_num_prompt = PyUnicode_InternFromString("num_prompt")) == NULL ||
        (name_limit = PyUnicode_InternFromString("limit")) == NULL ||
        (name_cow_tail = PyUnicode_InternFromString("cow_tail")) == NULL ||
        (name_promised = PyUnicode_InternFromString("promised")) == NULL ||
        (name_table = PyUnicode_InternFromString("table")) == NULL ||
        (name_blocks = PyUnicode_InternFromString("blocks")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) return NULL;
    Py_INCREF(&BlockOrderType);
    if (PyModule_AddObject(m, "BlockOrder", (PyObject *)&BlockOrderType) < 0) {
        Py_DECREF(&BlockOrderType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PolicyCoreType);
    if (PyModule_AddObject(m, "PolicyCore", (PyObject *)&PolicyCoreType) < 0) {
        Py_DECREF(&PolicyCoreType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ABI", NATIVE_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
