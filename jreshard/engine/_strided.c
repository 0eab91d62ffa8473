/* Compiled batched strided copies between raw CPU buffers (jreshard.engine.strided).
 *
 * copy_pieces(src, dst, n, run, outer, src_strides, dst_strides, stream) copies n pieces of one copy
 * class: piece k is the blocks of `run` bytes at src_addresses[k] + sum(i_d * src_strides[d]) for every
 * index i of `outer`, written at the same indices from dst_addresses[k] with dst_strides. `src` and
 * `dst` are the addresses of two int64 arrays of n entries. The addresses come from the in-process
 * lowering (jreshard.engine.copies), which checks every piece against the shard it reads and the one
 * it writes; JRESHARD_CHECK_BOUNDS=1 checks them against the call's buffers before this runs.
 *
 * The GIL is released while bytes move, so a call on a copy thread runs beside Python work on
 * another. With `stream`, runs of 256 bytes or more are written with streaming stores (../_stream.h):
 * destination shards are not read again soon, and their lines need not be read from memory first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_stream.h"

#define MAX_OUTER 8
#define STREAM_RUN 256

static int read_dims(PyObject *t, Py_ssize_t nd, int64_t *out, const char *what) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != nd) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: %s must be a tuple of %zd ints", what, nd);
        return 0;
    }
    for (Py_ssize_t d = 0; d < nd; d++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(t, d));
        if (v == -1 && PyErr_Occurred()) {
            return 0;
        }
        out[d] = (int64_t)v;
    }
    return 1;
}

static void copy_piece(char *dst, const char *src, int64_t run, Py_ssize_t nd, const int64_t *outer,
                       const int64_t *ss, const int64_t *ds, int fast) {
    int64_t idx[MAX_OUTER] = {0};
    int64_t blocks = 1;
    for (Py_ssize_t d = 0; d < nd; d++) {
        blocks *= outer[d];
    }
    for (int64_t b = 0; b < blocks; b++) {
        const char *s = src;
        char *t = dst;
        for (Py_ssize_t d = 0; d < nd; d++) {
            s += idx[d] * ss[d];
            t += idx[d] * ds[d];
        }
        if (fast) {
            stream_copy(t, s, (size_t)run);
        } else {
            memcpy(t, s, (size_t)run);
        }
        for (Py_ssize_t d = nd - 1; d >= 0; d--) {
            if (++idx[d] < outer[d]) {
                break;
            }
            idx[d] = 0;
        }
    }
}

static PyObject *py_copy_pieces(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long src_p, dst_p;
    Py_ssize_t n, run;
    PyObject *outer_o, *ss_o, *ds_o;
    int stream;
    if (!PyArg_ParseTuple(args, "KKnnOOOp", &src_p, &dst_p, &n, &run, &outer_o, &ss_o, &ds_o, &stream)) {
        return NULL;
    }
    if (!PyTuple_Check(outer_o) || PyTuple_GET_SIZE(outer_o) > MAX_OUTER) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: outer must be a tuple of at most %d ints", MAX_OUTER);
        return NULL;
    }
    Py_ssize_t nd = PyTuple_GET_SIZE(outer_o);
    int64_t outer[MAX_OUTER], ss[MAX_OUTER], ds[MAX_OUTER];
    if (!read_dims(outer_o, nd, outer, "outer") || !read_dims(ss_o, nd, ss, "src_strides") ||
        !read_dims(ds_o, nd, ds, "dst_strides")) {
        return NULL;
    }
    for (Py_ssize_t d = 0; d < nd; d++) {
        if (outer[d] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_pieces: a negative extent");
            return NULL;
        }
    }
    if (n < 0 || run < 0 || (n > 0 && (src_p == 0 || dst_p == 0))) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: n=%zd, run=%zd (or a null address table)", n, run);
        return NULL;
    }
    const int64_t *src = (const int64_t *)(uintptr_t)src_p, *dst = (const int64_t *)(uintptr_t)dst_p;
    int fast = stream && run >= STREAM_RUN;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        copy_piece((char *)(uintptr_t)dst[k], (const char *)(uintptr_t)src[k], run, nd, outer, ss, ds, fast);
    }
    if (fast) {
        STREAM_FENCE();
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_pieces", py_copy_pieces, METH_VARARGS,
     "copy_pieces(src, dst, n, run, outer, src_strides, dst_strides, stream): copy n strided pieces."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_strided", "Compiled batched strided copies.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__strided(void) { return PyModule_Create(&module); }
