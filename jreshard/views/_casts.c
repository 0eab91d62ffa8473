/* Compiled float32 <-> bfloat16 casts for the views executor (jreshard.views.native).
 *
 * Each function casts a block of `rows` rows of `cols` contiguous elements, rows
 * `src_stride` / `dst_stride` bytes apart, with the GIL released. The results are
 * bit-exact with jnp.astype (and ml_dtypes): see ../_bf16.h.
 *
 * The loops are plain C that compilers vectorise; on x86-64 with GCC or clang an
 * AVX-512 or AVX2 clone is chosen at load time when the CPU has it (target_clones),
 * so the build needs no -march flag and runs on any x86-64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_bf16.h"

JRESHARD_CLONES
static void f32_to_bf16_rows(const char *src, Py_ssize_t src_stride, char *dst, Py_ssize_t dst_stride,
                             Py_ssize_t rows, Py_ssize_t cols) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint32_t *restrict s = (const uint32_t *)(src + r * src_stride);
        uint16_t *restrict d = (uint16_t *)(dst + r * dst_stride);
        for (Py_ssize_t c = 0; c < cols; c++) {
            d[c] = bf16_of_f32_bits(s[c]);
        }
    }
}

JRESHARD_CLONES
static void bf16_to_f32_rows(const char *src, Py_ssize_t src_stride, char *dst, Py_ssize_t dst_stride,
                             Py_ssize_t rows, Py_ssize_t cols) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint16_t *restrict s = (const uint16_t *)(src + r * src_stride);
        uint32_t *restrict d = (uint32_t *)(dst + r * dst_stride);
        for (Py_ssize_t c = 0; c < cols; c++) {
            d[c] = f32_bits_of_bf16(s[c]);
        }
    }
}

/* Cast rows of float32 to bfloat16 and scatter them: for band row r (row r of the source,
 * `src_stride` bytes apart, `row_elems` elements each), the columns of each table entry
 * (row, first column, columns, destination address, destination end) whose row is r go to
 * that address. Every entry is checked before anything is written: its row and columns lie
 * in the band, and its bytes end at or before the destination end (the end of the buffer it
 * writes into); the first entry that does not is returned, and nothing is written.
 * The table is sorted by row. Each row is cast once, in chunks that stay in the first
 * level cache, and copied out from there: every source element is read once and cast
 * once however many destinations need it. */
#include "../_stream.h"

#define SCATTER_CHUNK 4096
#define SCATTER_COLS 5
static Py_ssize_t scatter_check(Py_ssize_t rows, Py_ssize_t row_elems, const int64_t *table, Py_ssize_t entries) {
    for (Py_ssize_t k = 0; k < entries; k++) {
        const int64_t *t = table + SCATTER_COLS * k;
        if (t[0] < 0 || t[0] >= rows || t[1] < 0 || t[2] < 0 || t[1] > row_elems - t[2] || t[3] <= 0 ||
            t[4] < t[3] || t[2] > (t[4] - t[3]) / 2 || (k > 0 && t[0] < t[-SCATTER_COLS])) {
            return k;
        }
    }
    return -1;
}

static void f32_to_bf16_scatter_rows(const char *src, Py_ssize_t src_stride, Py_ssize_t rows, Py_ssize_t row_elems,
                                     const int64_t *table, Py_ssize_t entries) {
    uint16_t scratch[SCATTER_CHUNK];
    Py_ssize_t e = 0;
    for (Py_ssize_t r = 0; r < rows && e < entries; r++) {
        Py_ssize_t end = e;
        while (end < entries && table[SCATTER_COLS * end] == r) {
            end++;
        }
        if (end == e) {
            continue;
        }
        const char *row = src + r * src_stride;
        for (Py_ssize_t c0 = 0; c0 < row_elems; c0 += SCATTER_CHUNK) {
            Py_ssize_t c1 = c0 + SCATTER_CHUNK < row_elems ? c0 + SCATTER_CHUNK : row_elems;
            int cast = 0;
            for (Py_ssize_t k = e; k < end; k++) {
                Py_ssize_t lo = table[SCATTER_COLS * k + 1], hi = lo + table[SCATTER_COLS * k + 2];
                lo = lo > c0 ? lo : c0;
                hi = hi < c1 ? hi : c1;
                if (lo >= hi) {
                    continue;
                }
                if (!cast) {
                    f32_to_bf16_rows(row + 4 * c0, 0, (char *)scratch, 0, 1, c1 - c0);
                    cast = 1;
                }
                char *dst = (char *)(uintptr_t)table[SCATTER_COLS * k + 3] + 2 * (lo - table[SCATTER_COLS * k + 1]);
                stream_copy(dst, (const char *)(scratch + (lo - c0)), (size_t)(2 * (hi - lo)));
            }
        }
        e = end;
    }
    STREAM_FENCE();
}

static PyObject *py_f32_to_bf16_scatter(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long src, table;
    Py_ssize_t src_stride, rows, row_elems, entries;
    if (!PyArg_ParseTuple(args, "KnnnKn", &src, &src_stride, &rows, &row_elems, &table, &entries)) {
        return NULL;
    }
    if (rows < 0 || row_elems < 0 || entries < 0) {
        PyErr_Format(PyExc_ValueError, "rows=%zd, row_elems=%zd and entries=%zd must not be negative", rows, row_elems,
                     entries);
        return NULL;
    }
    Py_ssize_t bad = scatter_check(rows, row_elems, (const int64_t *)(uintptr_t)table, entries);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError,
                     "f32_to_bf16_scatter: table entry %zd lies outside the band (%zd rows of %zd) or past the end "
                     "of its destination buffer; nothing was written",
                     bad, rows, row_elems);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    f32_to_bf16_scatter_rows((const char *)(uintptr_t)src, src_stride, rows, row_elems,
                             (const int64_t *)(uintptr_t)table, entries);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

typedef void (*rows_fn)(const char *, Py_ssize_t, char *, Py_ssize_t, Py_ssize_t, Py_ssize_t);

static PyObject *run(rows_fn fn, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t src_stride, dst_stride, rows, cols;
    if (!PyArg_ParseTuple(args, "KnKnnn", &src, &src_stride, &dst, &dst_stride, &rows, &cols)) {
        return NULL;
    }
    if (rows < 0 || cols < 0) {
        PyErr_Format(PyExc_ValueError, "rows=%zd and cols=%zd must not be negative", rows, cols);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fn((const char *)(uintptr_t)src, src_stride, (char *)(uintptr_t)dst, dst_stride, rows, cols);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_f32_to_bf16(PyObject *self, PyObject *args) {
    (void)self;
    return run(f32_to_bf16_rows, args);
}

static PyObject *py_bf16_to_f32(PyObject *self, PyObject *args) {
    (void)self;
    return run(bf16_to_f32_rows, args);
}

static PyMethodDef methods[] = {
    {"f32_to_bf16", py_f32_to_bf16, METH_VARARGS,
     "f32_to_bf16(src, src_stride, dst, dst_stride, rows, cols): cast rows of float32 at address src to bfloat16."},
    {"bf16_to_f32", py_bf16_to_f32, METH_VARARGS,
     "bf16_to_f32(src, src_stride, dst, dst_stride, rows, cols): cast rows of bfloat16 at address src to float32."},
    {"f32_to_bf16_scatter", py_f32_to_bf16_scatter, METH_VARARGS,
     "f32_to_bf16_scatter(src, src_stride, rows, row_elems, table, entries): cast float32 rows to bfloat16 and "
     "copy the columns of each int64 table entry (row, column, columns, address, end of the destination buffer), "
     "sorted by row, to its address; an entry outside the band or past its end raises ValueError, nothing written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_casts", "Compiled float32 <-> bfloat16 casts.", -1, methods};

PyMODINIT_FUNC PyInit__casts(void) { return PyModule_Create(&module); }
