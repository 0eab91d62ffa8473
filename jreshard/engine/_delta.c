/* Compiled delta kernels (jreshard.engine.delta): compare a chunk's new wire bytes with the base the
 * destination holds, encode what changed, and apply an encoding in place.
 *
 * A chunk of `nbytes` bytes is compared in units of `unit` bytes (1, 2, 4 or 8; the last unit may be
 * partial): a unit changed when any of its bits differ, so NaN payloads and -0.0 / 0.0 are changes like any
 * other. Bodies (the format is the numpy fallback's, jreshard/engine/delta.py, and tested against it):
 *   KIND_SAME  nothing changed: an empty body;
 *   KIND_FULL  the whole chunk;
 *   KIND_MASK  a bitmask of ceil(n / 8) bytes (bit u % 8 of byte u / 8: unit u changed), then the changed
 *              units' new bytes in order;
 *   KIND_RUNS  a little-endian uint32 count of runs, then per run (uint32 first unit, uint32 units), runs
 *              ascending and apart, then the changed units' new bytes in order;
 *   KIND_GAPS  a little-endian uint32 count k of changed units, then k LEB128 varints (the units skipped
 *              before each changed one), then the changed units' new bytes in order.
 * encode() picks the smallest; a body is never longer than the chunk (KIND_FULL is).
 *
 * Nothing about a body is trusted in apply(): every count, run and length is checked against the chunk's
 * size and the body's size before the first byte is written, and sizes come from the buffers themselves.
 * The GIL is released while bytes are compared and moved.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { KIND_SAME = 0, KIND_FULL = 1, KIND_MASK = 2, KIND_RUNS = 3, KIND_GAPS = 4 };
#define MAX_VARINT 5 /* a uint32 in LEB128 */

static int check_unit(long unit) {
    if (unit != 1 && unit != 2 && unit != 4 && unit != 8) {
        PyErr_Format(PyExc_ValueError, "delta: unit=%ld must be 1, 2, 4 or 8", unit);
        return 0;
    }
    return 1;
}

static inline Py_ssize_t varint_size(uint64_t g) {
    Py_ssize_t b = 1;
    while (g >= 0x80) {
        g >>= 7;
        b++;
    }
    return b;
}

static inline void put32(char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) {
        p[i] = (char)((v >> (8 * i)) & 0xff);
    }
}

static inline uint32_t get32(const char *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        v |= (uint32_t)(unsigned char)p[i] << (8 * i);
    }
    return v;
}

/* One bit per unit, set where the unit changed: the one pass over the chunk's bytes.
 *
 * Eight bytes at a time: the XOR of the two words is zero where nothing changed (most words of an RL step's
 * chunk: a changed bfloat16 in a word of four is about one word in ten), and otherwise its lanes of `unit`
 * bytes are folded to one bit each (a lane is nonzero when adding 0x7f..f to its low bits, or its top bit,
 * sets its top bit; one multiply gathers the top bits side by side). With SSE2, sixteen bytes are compared at
 * once and their lanes' bits come out of one movemask. */
static inline uint64_t load64(const char *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint64_t lanes_changed(uint64_t d, Py_ssize_t unit) {
    uint64_t t;
    switch (unit) {
    case 1: /* eight lanes: top bits at 7, 15, .., 63 gathered into bits 56..63 */
        t = (((d & 0x7f7f7f7f7f7f7f7fULL) + 0x7f7f7f7f7f7f7f7fULL) | d) >> 7 & 0x0101010101010101ULL;
        return (t * 0x0102040810204080ULL) >> 56;
    case 2: /* four lanes: top bits at 15, 31, 47, 63 gathered into bits 48..51 */
        t = (((d & 0x7fff7fff7fff7fffULL) + 0x7fff7fff7fff7fffULL) | d) >> 15 & 0x0001000100010001ULL;
        return (t * 0x0001000200040008ULL) >> 48 & 0xf;
    case 4:
        t = (((d & 0x7fffffff7fffffffULL) + 0x7fffffff7fffffffULL) | d) >> 31 & 0x0000000100000001ULL;
        return (t | t >> 31) & 3;
    default:
        return d != 0;
    }
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* The changed-unit bits of 16 bytes (16 / unit of them), from a byte mask of where the bytes are equal. */
static inline uint64_t lanes16(const char *a, const char *b, Py_ssize_t unit) {
    __m128i x = _mm_loadu_si128((const __m128i *)a), y = _mm_loadu_si128((const __m128i *)b);
    switch (unit) {
    case 1:
        return (uint64_t)(~_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)) & 0xffff);
    case 2: { /* equal 16-bit lanes as 0xffff, packed to one byte each */
        __m128i e = _mm_cmpeq_epi16(x, y);
        return (uint64_t)(~_mm_movemask_epi8(_mm_packs_epi16(e, e)) & 0xff);
    }
    default: /* 4 or 8: from the two words */
        return lanes_changed(load64(a) ^ load64(b), unit) | lanes_changed(load64(a + 8) ^ load64(b + 8), unit)
                                                                << (8 / unit);
    }
}
#endif

/* The whole 64-unit words of bits; `unit` is a constant where each case below inlines it. */
static inline __attribute__((always_inline)) void diff_words(const char *x, const char *y, Py_ssize_t words,
                                                             Py_ssize_t unit, uint64_t *bits) {
    Py_ssize_t block = 64 * unit; /* the bytes of one word of bits */
    for (Py_ssize_t w = 0; w < words; w++) {
        const char *a = x + w * block, *b = y + w * block;
        uint64_t word = 0;
#if defined(__SSE2__)
        for (Py_ssize_t i = 0; i < block; i += 16) {
            word |= lanes16(a + i, b + i, unit) << (i / unit);
        }
#else
        for (Py_ssize_t i = 0; i < block; i += 8) {
            uint64_t d = load64(a + i) ^ load64(b + i);
            if (d) {
                word |= lanes_changed(d, unit) << (i / unit);
            }
        }
#endif
        bits[w] = word;
    }
}

static void diff_bits(const char *x, const char *y, Py_ssize_t nbytes, Py_ssize_t unit, uint64_t *bits) {
    Py_ssize_t n = (nbytes + unit - 1) / unit, full = nbytes / unit;
    memset(bits, 0, (size_t)((n + 63) / 64) * sizeof(uint64_t));
    switch (unit) {
    case 1:
        diff_words(x, y, full / 64, 1, bits);
        break;
    case 2:
        diff_words(x, y, full / 64, 2, bits);
        break;
    case 4:
        diff_words(x, y, full / 64, 4, bits);
        break;
    default:
        diff_words(x, y, full / 64, 8, bits);
        break;
    }
    for (Py_ssize_t u = full / 64 * 64; u < n; u++) { /* the last units, the partial one included */
        Py_ssize_t s = u == n - 1 ? nbytes - u * unit : unit;
        if (memcmp(x + u * unit, y + u * unit, (size_t)s) != 0) {
            bits[u / 64] |= (uint64_t)1 << (u % 64);
        }
    }
}

static inline Py_ssize_t unit_size(Py_ssize_t u, Py_ssize_t n, Py_ssize_t nbytes, Py_ssize_t unit) {
    return u == n - 1 ? nbytes - u * unit : unit;
}

/* Copy unit `u`'s bytes (the last unit may be partial): a fixed-size copy the compiler inlines. */
static inline void copy_unit(char *to, const char *from, Py_ssize_t u, Py_ssize_t n, Py_ssize_t nbytes,
                             Py_ssize_t unit) {
    if (u == n - 1) {
        memcpy(to, from, (size_t)(nbytes - u * unit));
        return;
    }
    switch (unit) {
    case 1:
        *to = *from;
        break;
    case 2:
        memcpy(to, from, 2);
        break;
    case 4:
        memcpy(to, from, 4);
        break;
    default:
        memcpy(to, from, 8);
        break;
    }
}

/* From the bits: changed units, runs, changed bytes, and the bytes of their gaps as varints. */
static void count(const uint64_t *bits, Py_ssize_t n, Py_ssize_t nbytes, Py_ssize_t unit, Py_ssize_t *changed,
                  Py_ssize_t *runs, Py_ssize_t *vbytes, Py_ssize_t *gbytes) {
    Py_ssize_t k = 0, m = 0, g = 0, last = -1;
    uint64_t carry = 0; /* the bit before this word's first */
    for (Py_ssize_t w = 0; w < (n + 63) / 64; w++) {
        uint64_t word = bits[w];
        k += __builtin_popcountll(word);
        m += __builtin_popcountll(word & ~((word << 1) | carry));
        carry = word >> 63;
        while (word) {
            Py_ssize_t u = w * 64 + __builtin_ctzll(word);
            g += varint_size((uint64_t)(u - last - 1));
            last = u;
            word &= word - 1;
        }
    }
    *changed = k;
    *runs = m;
    *vbytes = k * unit - ((bits[(n - 1) / 64] >> ((n - 1) % 64)) & 1 ? unit * n - nbytes : 0);
    *gbytes = g;
}

/* The size of each body, and the choice: the smallest, the whole chunk when nothing smaller. */
static int choose(Py_ssize_t nbytes, Py_ssize_t n, Py_ssize_t k, Py_ssize_t m, Py_ssize_t v, Py_ssize_t g,
                  Py_ssize_t *size) {
    if (k == 0) {
        *size = 0;
        return KIND_SAME;
    }
    Py_ssize_t mask = (n + 7) / 8 + v;
    Py_ssize_t runs = n <= (Py_ssize_t)UINT32_MAX ? 4 + 8 * m + v : nbytes + 1;
    Py_ssize_t gaps = n <= (Py_ssize_t)UINT32_MAX ? 4 + g + v : nbytes + 1;
    if (mask < nbytes && mask <= runs && mask <= gaps) {
        *size = mask;
        return KIND_MASK;
    }
    if (runs < nbytes && runs <= gaps) {
        *size = runs;
        return KIND_RUNS;
    }
    if (gaps < nbytes) {
        *size = gaps;
        return KIND_GAPS;
    }
    *size = nbytes;
    return KIND_FULL;
}

static void write_body(int kind, const char *x, const uint64_t *bits, Py_ssize_t nbytes, Py_ssize_t unit,
                       Py_ssize_t m, Py_ssize_t k, Py_ssize_t g, char *out) {
    Py_ssize_t n = (nbytes + unit - 1) / unit;
    if (kind == KIND_FULL) {
        memcpy(out, x, (size_t)nbytes);
        return;
    }
    if (kind == KIND_SAME) {
        return;
    }
    char *vals, *runs = NULL, *gaps = NULL;
    if (kind == KIND_MASK) {
        for (Py_ssize_t i = 0; i < (n + 7) / 8; i++) {
            out[i] = (char)((bits[i / 8] >> (8 * (i % 8))) & 0xff);
        }
        vals = out + (n + 7) / 8;
    } else if (kind == KIND_RUNS) {
        put32(out, (uint32_t)m);
        runs = out + 4;
        vals = out + 4 + 8 * m;
    } else {
        put32(out, (uint32_t)k);
        gaps = out + 4;
        vals = out + 4 + g;
    }
    Py_ssize_t last = -1, start = -1;
    for (Py_ssize_t w = 0; w < (n + 63) / 64; w++) {
        uint64_t word = bits[w];
        while (word) {
            Py_ssize_t u = w * 64 + __builtin_ctzll(word);
            word &= word - 1;
            copy_unit(vals, x + u * unit, u, n, nbytes, unit);
            vals += unit_size(u, n, nbytes, unit);
            if (gaps) {
                uint64_t gap = (uint64_t)(u - last - 1);
                while (gap >= 0x80) {
                    *gaps++ = (char)((gap & 0x7f) | 0x80);
                    gap >>= 7;
                }
                *gaps++ = (char)gap;
            } else if (runs) {
                if (start < 0) {
                    start = u;
                } else if (u != last + 1) {
                    put32(runs, (uint32_t)start);
                    put32(runs + 4, (uint32_t)(last + 1 - start));
                    runs += 8;
                    start = u;
                }
            }
            last = u;
        }
    }
    if (runs && start >= 0) {
        put32(runs, (uint32_t)start);
        put32(runs + 4, (uint32_t)(last + 1 - start));
    }
}

/* encode(new, base, out, unit) -> (kind, body bytes, changed units) */
static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer x, y, o;
    long unit;
    if (!PyArg_ParseTuple(args, "y*y*w*l", &x, &y, &o, &unit)) {
        return NULL;
    }
    PyObject *res = NULL;
    uint64_t *bits = NULL;
    if (!check_unit(unit)) {
        goto done;
    }
    if (x.len != y.len) {
        PyErr_Format(PyExc_ValueError, "delta.encode: new has %zd bytes, base %zd", x.len, y.len);
        goto done;
    }
    if (o.len < x.len) {
        PyErr_Format(PyExc_ValueError, "delta.encode: out has %zd bytes, the chunk %zd", o.len, x.len);
        goto done;
    }
    Py_ssize_t nbytes = x.len, n = (nbytes + unit - 1) / unit, k = 0, m = 0, v = 0, g = 0, size = 0;
    int kind = KIND_SAME;
    if (n > 0) {
        bits = PyMem_RawMalloc((size_t)((n + 63) / 64) * sizeof(uint64_t));
        if (bits == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS;
        diff_bits(x.buf, y.buf, nbytes, unit, bits);
        count(bits, n, nbytes, unit, &k, &m, &v, &g);
        kind = choose(nbytes, n, k, m, v, g, &size);
        write_body(kind, x.buf, bits, nbytes, unit, m, k, g, o.buf);
        Py_END_ALLOW_THREADS;
    }
    res = Py_BuildValue("inn", kind, size, k);
done:
    PyMem_RawFree(bits);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    PyBuffer_Release(&o);
    return res;
}

static PyObject *bad(const char *why, Py_ssize_t a, Py_ssize_t b) {
    PyErr_Format(PyExc_ValueError, "delta.apply: %s (%zd, %zd)", why, a, b);
    return NULL;
}

/* apply(body, kind, dst, unit) -> changed units; dst holds the base and is written in place. */
static PyObject *apply(PyObject *self, PyObject *args) {
    Py_buffer b, d;
    int kind;
    long unit;
    if (!PyArg_ParseTuple(args, "y*iw*l", &b, &kind, &d, &unit)) {
        return NULL;
    }
    PyObject *res = NULL;
    if (!check_unit(unit)) {
        goto done;
    }
    const char *body = b.buf;
    char *dst = d.buf;
    Py_ssize_t nbytes = d.len, blen = b.len, n = (nbytes + unit - 1) / unit, k = 0;
    if (kind == KIND_SAME) {
        res = blen == 0 ? PyLong_FromLong(0) : bad("an unchanged chunk with a body", blen, 0);
        goto done;
    }
    if (kind == KIND_FULL) {
        if (blen != nbytes) {
            res = bad("a whole chunk of another size (body, chunk)", blen, nbytes);
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS;
        memcpy(dst, body, (size_t)nbytes);
        Py_END_ALLOW_THREADS;
        res = PyLong_FromSsize_t(n);
        goto done;
    }
    if (kind == KIND_MASK) {
        Py_ssize_t mbytes = (n + 7) / 8, v = 0;
        if (blen < mbytes) {
            res = bad("a mask body shorter than its mask (body, mask)", blen, mbytes);
            goto done;
        }
        for (Py_ssize_t i = 0; i < mbytes; i++) {
            k += __builtin_popcount((unsigned char)body[i]);
        }
        v = k * unit;
        if (n > 0 && (body[(n - 1) / 8] & (1 << ((n - 1) % 8)))) {
            v -= unit * n - nbytes; /* the last unit is partial */
        }
        if (n % 8 && ((unsigned char)body[mbytes - 1] >> (n % 8))) {
            res = bad("a mask with bits past the chunk (units, mask bytes)", n, mbytes);
            goto done;
        }
        if (blen != mbytes + v) {
            res = bad("a mask body whose values do not match its mask (body, expected)", blen, mbytes + v);
            goto done;
        }
        const char *vals = body + mbytes;
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t i = 0; i < mbytes; i++) {
            unsigned int byte = (unsigned char)body[i];
            while (byte) {
                Py_ssize_t u = i * 8 + __builtin_ctz(byte);
                byte &= byte - 1;
                copy_unit(dst + u * unit, vals, u, n, nbytes, unit);
                vals += unit_size(u, n, nbytes, unit);
            }
        }
        Py_END_ALLOW_THREADS;
        res = PyLong_FromSsize_t(k);
        goto done;
    }
    if (kind == KIND_RUNS) {
        if (blen < 4) {
            res = bad("a runs body without its count (body, 4)", blen, 4);
            goto done;
        }
        Py_ssize_t m = get32(body), v = 0, end = 0;
        if (m > (blen - 4) / 8) {
            res = bad("more runs than the body holds (runs, body)", m, blen);
            goto done;
        }
        const char *runs = body + 4;
        for (Py_ssize_t i = 0; i < m; i++) {
            Py_ssize_t s = get32(runs + 8 * i), len = get32(runs + 8 * i + 4);
            if (len == 0 || s < end || s > n || len > n - s) {
                res = bad("a run out of order or past the chunk (first unit, units)", s, len);
                goto done;
            }
            end = s + len + (i + 1 < m ? 1 : 0); /* runs are apart: the next starts after a gap */
            k += len;
            v += (s + len == n) ? (len - 1) * unit + (nbytes - (n - 1) * unit) : len * unit;
        }
        if (blen != 4 + 8 * m + v) {
            res = bad("a runs body whose values do not match its runs (body, expected)", blen, 4 + 8 * m + v);
            goto done;
        }
        const char *vals = runs + 8 * m;
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t i = 0; i < m; i++) {
            Py_ssize_t s = get32(runs + 8 * i), len = get32(runs + 8 * i + 4);
            Py_ssize_t bytes = (s + len == n) ? (len - 1) * unit + (nbytes - (n - 1) * unit) : len * unit;
            memcpy(dst + s * unit, vals, (size_t)bytes);
            vals += bytes;
        }
        Py_END_ALLOW_THREADS;
        res = PyLong_FromSsize_t(k);
        goto done;
    }
    if (kind == KIND_GAPS) {
        if (blen < 4) {
            res = bad("a gaps body without its count (body, 4)", blen, 4);
            goto done;
        }
        Py_ssize_t cnt = get32(body), at = 4, u = -1, v = 0;
        if (cnt > n) {
            res = bad("more changed units than the chunk has (count, units)", cnt, n);
            goto done;
        }
        for (Py_ssize_t i = 0; i < cnt; i++) { /* every gap decoded and bounded before anything is written */
            uint64_t gap = 0;
            int shift = 0, b;
            do {
                if (at >= blen || shift >= 7 * MAX_VARINT) {
                    res = bad("a gap past the body or too long (at, body)", at, blen);
                    goto done;
                }
                b = (unsigned char)body[at++];
                gap |= (uint64_t)(b & 0x7f) << shift;
                shift += 7;
            } while (b & 0x80);
            if (gap >= (uint64_t)(n - u - 1)) {
                res = bad("a gap past the chunk (unit, gap)", u, (Py_ssize_t)gap);
                goto done;
            }
            u += (Py_ssize_t)gap + 1;
            v += unit_size(u, n, nbytes, unit);
        }
        if (blen != at + v) {
            res = bad("a gaps body whose values do not match its gaps (body, expected)", blen, at + v);
            goto done;
        }
        const char *g = body + 4, *vals = body + at;
        Py_BEGIN_ALLOW_THREADS;
        u = -1;
        for (Py_ssize_t i = 0; i < cnt; i++) {
            uint64_t gap = 0;
            int shift = 0, b;
            do {
                b = (unsigned char)*g++;
                gap |= (uint64_t)(b & 0x7f) << shift;
                shift += 7;
            } while (b & 0x80);
            u += (Py_ssize_t)gap + 1;
            copy_unit(dst + u * unit, vals, u, n, nbytes, unit);
            vals += unit_size(u, n, nbytes, unit);
        }
        Py_END_ALLOW_THREADS;
        res = PyLong_FromSsize_t(cnt);
        goto done;
    }
    PyErr_Format(PyExc_ValueError, "delta.apply: unknown encoding kind %d", kind);
done:
    PyBuffer_Release(&b);
    PyBuffer_Release(&d);
    return res;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "encode(new, base, out, unit) -> (kind, body bytes, changed units)"},
    {"apply", apply, METH_VARARGS, "apply(body, kind, dst, unit) -> changed units (dst written in place)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_delta", "Compiled delta encode/apply.", -1, methods};

PyMODINIT_FUNC PyInit__delta(void) { return PyModule_Create(&module); }
