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
#define BLOCK 256 /* bytes compared at once before looking unit by unit */

static int check_unit(long unit) {
    if (unit != 1 && unit != 2 && unit != 4 && unit != 8) {
        PyErr_Format(PyExc_ValueError, "delta: unit=%ld must be 1, 2, 4 or 8", unit);
        return 0;
    }
    return 1;
}

static inline Py_ssize_t unit_size(Py_ssize_t u, Py_ssize_t n, Py_ssize_t nbytes, Py_ssize_t unit) {
    return u == n - 1 ? nbytes - u * unit : unit;
}

static inline int differs(const char *a, const char *b, Py_ssize_t len) { return memcmp(a, b, (size_t)len) != 0; }

static inline Py_ssize_t varint_size(uint64_t g) {
    Py_ssize_t b = 1;
    while (g >= 0x80) {
        g >>= 7;
        b++;
    }
    return b;
}

/* Count the changed units and runs; the changed bytes and the bytes of their gaps too. */
static void count(const char *x, const char *y, Py_ssize_t nbytes, Py_ssize_t unit, Py_ssize_t *changed,
                  Py_ssize_t *runs, Py_ssize_t *vbytes, Py_ssize_t *gbytes) {
    Py_ssize_t n = (nbytes + unit - 1) / unit, k = 0, m = 0, v = 0, g = 0, last = -1;
    int prev = 0;
    Py_ssize_t per_block = BLOCK / unit;
    for (Py_ssize_t u0 = 0; u0 < n; u0 += per_block) {
        Py_ssize_t u1 = u0 + per_block < n ? u0 + per_block : n;
        Py_ssize_t lo = u0 * unit, hi = u1 * unit < nbytes ? u1 * unit : nbytes;
        if (!differs(x + lo, y + lo, hi - lo)) {
            prev = 0;
            continue;
        }
        for (Py_ssize_t u = u0; u < u1; u++) {
            Py_ssize_t s = unit_size(u, n, nbytes, unit);
            int c = differs(x + u * unit, y + u * unit, s);
            if (c) {
                k++;
                v += s;
                g += varint_size((uint64_t)(u - last - 1));
                last = u;
                if (!prev) {
                    m++;
                }
            }
            prev = c;
        }
    }
    *changed = k;
    *runs = m;
    *vbytes = v;
    *gbytes = g;
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

static void write_body(int kind, const char *x, const char *y, Py_ssize_t nbytes, Py_ssize_t unit, char *out) {
    Py_ssize_t n = (nbytes + unit - 1) / unit;
    if (kind == KIND_FULL) {
        memcpy(out, x, (size_t)nbytes);
        return;
    }
    if (kind == KIND_SAME) {
        return;
    }
    char *vals;
    char *runs = NULL, *gaps = NULL;
    uint32_t nruns = 0;
    Py_ssize_t last = -1;
    if (kind == KIND_MASK) {
        memset(out, 0, (size_t)((n + 7) / 8));
        vals = out + (n + 7) / 8;
    } else {
        Py_ssize_t k, m, v, g;
        count(x, y, nbytes, unit, &k, &m, &v, &g);
        if (kind == KIND_RUNS) {
            put32(out, (uint32_t)m);
            runs = out + 4;
            vals = out + 4 + 8 * m;
        } else {
            put32(out, (uint32_t)k);
            gaps = out + 4;
            vals = out + 4 + g;
        }
    }
    Py_ssize_t per_block = BLOCK / unit;
    int prev = 0;
    uint32_t start = 0;
    for (Py_ssize_t u0 = 0; u0 < n; u0 += per_block) {
        Py_ssize_t u1 = u0 + per_block < n ? u0 + per_block : n;
        Py_ssize_t lo = u0 * unit, hi = u1 * unit < nbytes ? u1 * unit : nbytes;
        if (!differs(x + lo, y + lo, hi - lo)) {
            if (prev && runs) {
                put32(runs + 8 * nruns, start);
                put32(runs + 8 * nruns + 4, (uint32_t)(u0 - start));
                nruns++;
            }
            prev = 0;
            continue;
        }
        for (Py_ssize_t u = u0; u < u1; u++) {
            Py_ssize_t s = unit_size(u, n, nbytes, unit);
            int c = differs(x + u * unit, y + u * unit, s);
            if (c) {
                if (kind == KIND_MASK) {
                    out[u / 8] |= (char)(1 << (u % 8));
                } else if (gaps) {
                    uint64_t gap = (uint64_t)(u - last - 1);
                    while (gap >= 0x80) {
                        *gaps++ = (char)((gap & 0x7f) | 0x80);
                        gap >>= 7;
                    }
                    *gaps++ = (char)gap;
                    last = u;
                }
                memcpy(vals, x + u * unit, (size_t)s);
                vals += s;
                if (!prev) {
                    start = (uint32_t)u;
                }
            } else if (prev && runs) {
                put32(runs + 8 * nruns, start);
                put32(runs + 8 * nruns + 4, (uint32_t)(u - start));
                nruns++;
            }
            prev = c;
        }
    }
    if (prev && runs) {
        put32(runs + 8 * nruns, start);
        put32(runs + 8 * nruns + 4, (uint32_t)(n - start));
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
    Py_ssize_t nbytes = x.len, n = (nbytes + unit - 1) / unit, k, m, v, g, size;
    int kind;
    Py_BEGIN_ALLOW_THREADS;
    count(x.buf, y.buf, nbytes, unit, &k, &m, &v, &g);
    kind = choose(nbytes, n, k, m, v, g, &size);
    write_body(kind, x.buf, y.buf, nbytes, unit, o.buf);
    Py_END_ALLOW_THREADS;
    res = Py_BuildValue("inn", kind, size, k);
done:
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
        for (Py_ssize_t u = 0; u < n; u++) {
            if (body[u / 8] & (1 << (u % 8))) {
                k++;
                v += unit_size(u, n, nbytes, unit);
            }
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
        for (Py_ssize_t u = 0; u < n; u++) {
            if (body[u / 8] & (1 << (u % 8))) {
                Py_ssize_t s = unit_size(u, n, nbytes, unit);
                memcpy(dst + u * unit, vals, (size_t)s);
                vals += s;
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
            Py_ssize_t s = unit_size(u, n, nbytes, unit);
            memcpy(dst + u * unit, vals, (size_t)s);
            vals += s;
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
