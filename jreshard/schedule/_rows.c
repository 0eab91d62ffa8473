/* Compiled byte rows of a descriptor table (jreshard.schedule.kernels): pack and unpack.
 *
 * copy_rows(table, rows, addresses, sizes, buffers, staging, staging_size, unpack) moves the
 * bytes of every row of a C-ordered int64 descriptor table (kernels.py's columns: the byte
 * rows, CAST 0 and innermost stride 1, and the float32 <-> bfloat16 cast rows below) between the shard buffers (a base address and a
 * byte size per buffer index; address 0 is a missing buffer) and the staging buffer:
 * from the buffers into staging (unpack 0) or back (unpack 1).
 *
 * Every row is checked before any byte moves: its buffer is given, its dimensions and
 * extents are in range, its strides are not negative, NBYTES is the product of its
 * extents, and its last byte lies inside its buffer and inside staging, with every sum and
 * product checked for overflow. The index of the first row that fails is returned and
 * nothing is written; -1 when every row was copied. Sizes come from the buffers, never from
 * the table.
 *
 * A call that moves at least STREAM_MIN bytes writes its runs of 256 bytes or more with
 * streaming stores (../_stream.h): the rows write shard or staging memory that the next
 * step reads from memory anyway, and a run of a few KiB inside a strided box is written
 * faster without the read-for-ownership of every line it writes. The GIL is released
 * while bytes move.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "../_bf16.h"
#include "_rows.h"

/* Cast rows (kernels.py's CAST column, here only the two casts a view's rows make on the way to and from the
 * wire): a pack row reads float32 elements from its buffer (SHAPE counts elements, STRIDE is in bytes) and stages
 * them as bfloat16, back to back; an unpack row reads bfloat16 from staging and writes float32 into its buffer.
 * NBYTES is what the row takes in staging (2 bytes an element). The codes are kernels.chain_code's, which
 * jreshard.schedule.kernels checks against CAST_F32_BF16 and CAST_BF16_F32 before it hands this module a cast
 * row. Unaligned elements are read and written through memcpy. */
#define CAST_F32_BF16 33 /* chain_code(("float32", "bfloat16")): a pack row */
#define CAST_BF16_F32 18 /* chain_code(("bfloat16", "float32")): an unpack row */

#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define JRESHARD_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
#endif
#ifndef JRESHARD_CLONES
#define JRESHARD_CLONES
#endif

/* Whether row r is a cast row of this direction that lies inside its buffer and inside staging. */
static int cast_row_ok(const int64_t *r, const int64_t *addresses, const int64_t *sizes, int64_t buffers,
                       int64_t staging_size, int unpack) {
    int64_t b = r[C_BUF], nd = r[C_NDIM];
    if (r[C_CAST] != (unpack ? CAST_BF16_F32 : CAST_F32_BF16) || b < 0 || b >= buffers || addresses[b] == 0 ||
        nd < 1 || nd > MAX_DIMS || r[C_OFF] < 0 || r[C_STAGE] < 0) {
        return 0;
    }
    int64_t count = 1, last = r[C_OFF], span, staged, end, stage_end;
    for (int64_t d = 0; d < nd; d++) {
        int64_t n = r[C_SHAPE0 + d], stride = r[C_STRIDE0 + d];
        if (n < 0 || stride < 0 || __builtin_mul_overflow(count, n, &count)) {
            return 0;
        }
        if (n > 0 && (__builtin_mul_overflow(n - 1, stride, &span) || __builtin_add_overflow(last, span, &last))) {
            return 0;
        }
    }
    if (__builtin_mul_overflow(count, 2, &staged) || staged != r[C_NBYTES]) {
        return 0;
    }
    if (count == 0) {
        return 1;
    }
    if (__builtin_add_overflow(last, 4, &end) || end > sizes[b] || __builtin_add_overflow(r[C_STAGE], staged, &stage_end) ||
        stage_end > staging_size) {
        return 0;
    }
    return 1;
}

JRESHARD_CLONES
static void f32_to_bf16_run(const char *src, int64_t stride, char *dst, int64_t n) {
    if (stride == 4) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, src + 4 * i, 4);
            uint16_t h = bf16_of_f32_bits(u);
            memcpy(dst + 2 * i, &h, 2);
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i * stride, 4);
        uint16_t h = bf16_of_f32_bits(u);
        memcpy(dst + 2 * i, &h, 2);
    }
}

JRESHARD_CLONES
static void bf16_to_f32_run(const char *src, char *dst, int64_t stride, int64_t n) {
    if (stride == 4) {
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            uint32_t u = f32_bits_of_bf16(h);
            memcpy(dst + 4 * i, &u, 4);
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        uint32_t u = f32_bits_of_bf16(h);
        memcpy(dst + i * stride, &u, 4);
    }
}

/* Cast one row that cast_row_ok accepted: its innermost extent is a run of elements STRIDE bytes apart in the
 * buffer, back to back in staging; the outer extents are walked in C order. */
static void cast_row(const int64_t *r, const int64_t *addresses, char *staging, int unpack) {
    int64_t nd = r[C_NDIM];
    if (r[C_NBYTES] == 0) {
        return;
    }
    char *base = (char *)(uintptr_t)addresses[r[C_BUF]] + r[C_OFF];
    char *stage = staging + r[C_STAGE];
    int64_t run = r[C_SHAPE0 + nd - 1], stride = r[C_STRIDE0 + nd - 1], outer = 1;
    int64_t idx[MAX_DIMS] = {0};
    for (int64_t d = 0; d + 1 < nd; d++) {
        outer *= r[C_SHAPE0 + d];
    }
    for (int64_t o = 0; o < outer; o++, stage += 2 * run) {
        char *at = base;
        for (int64_t d = 0; d + 1 < nd; d++) {
            at += idx[d] * r[C_STRIDE0 + d];
        }
        if (unpack) {
            bf16_to_f32_run(stage, at, stride, run);
        } else {
            f32_to_bf16_run(at, stride, stage, run);
        }
        for (int64_t d = nd - 2; d >= 0; d--) {
            if (++idx[d] < r[C_SHAPE0 + d]) {
                break;
            }
            idx[d] = 0;
        }
    }
}

static PyObject *py_copy_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long table_p, addresses_p, sizes_p, staging_p;
    Py_ssize_t rows, buffers, staging_size;
    int unpack;
    if (!PyArg_ParseTuple(args, "KnKKnKnp", &table_p, &rows, &addresses_p, &sizes_p, &buffers, &staging_p,
                          &staging_size, &unpack)) {
        return NULL;
    }
    if (rows < 0 || buffers < 0 || staging_size < 0 || (rows > 0 && (table_p == 0 || staging_p == 0))) {
        PyErr_Format(PyExc_ValueError, "copy_rows: rows=%zd, buffers=%zd, staging_size=%zd (or a null address)", rows,
                     buffers, staging_size);
        return NULL;
    }
    const int64_t *table = (const int64_t *)(uintptr_t)table_p;
    const int64_t *addresses = (const int64_t *)(uintptr_t)addresses_p, *sizes = (const int64_t *)(uintptr_t)sizes_p;
    int64_t total = 0;
    for (Py_ssize_t k = 0; k < rows; k++) {
        const int64_t *r = table + COLUMNS * k;
        if (r[C_CAST] ? !cast_row_ok(r, addresses, sizes, buffers, staging_size, unpack)
                      : !row_ok(r, addresses, sizes, buffers, staging_size)) {
            return PyLong_FromSsize_t(k);
        }
        total += r[C_NBYTES];
    }
    int stream = total >= STREAM_MIN;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < rows; k++) {
        const int64_t *r = table + COLUMNS * k;
        if (r[C_CAST]) {
            cast_row(r, addresses, (char *)(uintptr_t)staging_p, unpack);
        } else {
            copy_row(r, addresses, (char *)(uintptr_t)staging_p, unpack, stream);
        }
    }
    if (stream) {
        STREAM_FENCE();
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-1);
}

static PyMethodDef methods[] = {
    {"copy_rows", py_copy_rows, METH_VARARGS,
     "copy_rows(table, rows, addresses, sizes, buffers, staging, staging_size, unpack): move the byte rows of an "
     "int64 descriptor table between the buffers (int64 addresses and byte sizes) and staging; returns -1, or the "
     "index of the first row that is not a byte row inside its buffer and staging (then nothing was written)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", "Compiled byte rows of descriptor tables.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__rows(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_DIMS", MAX_DIMS) || PyModule_AddIntConstant(m, "BUF", C_BUF) ||
        PyModule_AddIntConstant(m, "OFF", C_OFF) || PyModule_AddIntConstant(m, "STAGE", C_STAGE) ||
        PyModule_AddIntConstant(m, "NBYTES", C_NBYTES) || PyModule_AddIntConstant(m, "NDIM", C_NDIM) ||
        PyModule_AddIntConstant(m, "SHAPE0", C_SHAPE0) || PyModule_AddIntConstant(m, "STRIDE0", C_STRIDE0) ||
        PyModule_AddIntConstant(m, "CAST", C_CAST) || PyModule_AddIntConstant(m, "COLUMNS", COLUMNS) ||
        PyModule_AddIntConstant(m, "STREAM_MIN", STREAM_MIN) ||
        PyModule_AddIntConstant(m, "CAST_F32_BF16", CAST_F32_BF16) ||
        PyModule_AddIntConstant(m, "CAST_BF16_F32", CAST_BF16_F32)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
