/* Compiled byte rows of a descriptor table (jreshard.schedule.kernels): pack and unpack.
 *
 * copy_rows(table, rows, addresses, sizes, buffers, staging, staging_size, unpack) moves the
 * bytes of every row of a C-ordered int64 descriptor table (kernels.py's columns: the byte
 * rows, CAST 0 and innermost stride 1, and the float32 <-> bfloat16 cast rows of _rows.h)
 * between the shard buffers (a base address and a byte size per buffer index; address 0 is
 * a missing buffer) and the staging buffer: from the buffers into staging (unpack 0) or
 * back (unpack 1).
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
#include "_rows.h"

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
            cast_row(r, addresses, (char *)(uintptr_t)staging_p, unpack, stream);
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
