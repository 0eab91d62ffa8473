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
 *
 * Copies(workers) is a batch of such calls that runs while its caller goes on. post(...) takes the
 * arguments of copy_pieces plus an object kept referenced until the batch ends (the address tables),
 * queues the call and starts one more of the batch's `workers` threads; the threads take the queued
 * calls in order and never take the GIL, so Python work on the caller's thread (making the result
 * arrays) neither waits for them nor they for it. wait() releases the GIL, copies what is still queued
 * on the calling thread too, and returns once every posted call has ended. A batch dropped unwaited
 * waits in its destructor. Without POSIX threads (Windows) a batch has no threads: wait() copies it all.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifndef _WIN32
#include <pthread.h>
#define HAVE_THREADS 1
#else
#define HAVE_THREADS 0
#endif

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

/* One call's worth of pieces, parsed: what copy_pieces runs and what a batch queues. */
typedef struct {
    const int64_t *src, *dst;
    Py_ssize_t n, nd;
    int64_t run;
    int64_t outer[MAX_OUTER], ss[MAX_OUTER], ds[MAX_OUTER];
    int fast;
} task_t;

/* Parse (src, dst, n, run, outer, src_strides, dst_strides, stream) from `args` into `t`; 0 on error. */
static int parse_task(PyObject *args, task_t *t) {
    unsigned long long src_p, dst_p;
    Py_ssize_t n, run;
    PyObject *outer_o, *ss_o, *ds_o;
    int stream;
    if (!PyArg_ParseTuple(args, "KKnnOOOp", &src_p, &dst_p, &n, &run, &outer_o, &ss_o, &ds_o, &stream)) {
        return 0;
    }
    if (!PyTuple_Check(outer_o) || PyTuple_GET_SIZE(outer_o) > MAX_OUTER) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: outer must be a tuple of at most %d ints", MAX_OUTER);
        return 0;
    }
    Py_ssize_t nd = PyTuple_GET_SIZE(outer_o);
    if (!read_dims(outer_o, nd, t->outer, "outer") || !read_dims(ss_o, nd, t->ss, "src_strides") ||
        !read_dims(ds_o, nd, t->ds, "dst_strides")) {
        return 0;
    }
    for (Py_ssize_t d = 0; d < nd; d++) {
        if (t->outer[d] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_pieces: a negative extent");
            return 0;
        }
    }
    if (n < 0 || run < 0 || (n > 0 && (src_p == 0 || dst_p == 0))) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: n=%zd, run=%zd (or a null address table)", n, run);
        return 0;
    }
    t->src = (const int64_t *)(uintptr_t)src_p;
    t->dst = (const int64_t *)(uintptr_t)dst_p;
    t->n = n;
    t->nd = nd;
    t->run = (int64_t)run;
    t->fast = stream && run >= STREAM_RUN;
    return 1;
}

/* Copy every piece of `t` (called without the GIL). */
static void run_task(const task_t *t) {
    for (Py_ssize_t k = 0; k < t->n; k++) {
        copy_piece((char *)(uintptr_t)t->dst[k], (const char *)(uintptr_t)t->src[k], t->run, t->nd, t->outer, t->ss,
                   t->ds, t->fast);
    }
    if (t->fast) {
        STREAM_FENCE();
    }
}

static PyObject *py_copy_pieces(PyObject *self, PyObject *args) {
    (void)self;
    task_t t;
    if (!parse_task(args, &t)) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    run_task(&t);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- Copies: a batch of copy_pieces calls run by worker threads while the caller goes on ---- */

#define MAX_WORKERS 64

typedef struct {
    PyObject_HEAD
    task_t *tasks;       /* queued calls; tasks[next..count) are not taken yet */
    Py_ssize_t count, cap, next;
    PyObject *keep;      /* a list: what the queued calls read and write through, alive until wait() */
    int workers;         /* threads to start with the first post */
    int started;         /* threads started */
    int closed;          /* wait() has begun: a thread that finds the queue empty ends */
#if HAVE_THREADS
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t threads[MAX_WORKERS];
#endif
} CopiesObject;

/* Take the next queued call into `out` (the lock held); 0 when the queue is empty. */
static int take_task(CopiesObject *c, task_t *out) {
    if (c->next >= c->count) {
        return 0;
    }
    *out = c->tasks[c->next++];
    return 1;
}

#if HAVE_THREADS
static void *worker_main(void *arg) {
    CopiesObject *c = (CopiesObject *)arg;
    task_t t;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (take_task(c, &t)) {
            pthread_mutex_unlock(&c->mu);
            run_task(&t);
            pthread_mutex_lock(&c->mu);
        } else if (c->closed) {
            break;
        } else {
            pthread_cond_wait(&c->cv, &c->mu);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}
#endif

/* Copy what is still queued on this thread, then join the workers (called without the GIL). */
static void finish(CopiesObject *c) {
    task_t t;
#if HAVE_THREADS
    pthread_mutex_lock(&c->mu);
    c->closed = 1;
    pthread_cond_broadcast(&c->cv);
    while (take_task(c, &t)) {
        pthread_mutex_unlock(&c->mu);
        run_task(&t);
        pthread_mutex_lock(&c->mu);
    }
    int started = c->started;
    c->started = 0;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < started; i++) {
        pthread_join(c->threads[i], NULL);
    }
#else
    c->closed = 1;
    while (take_task(c, &t)) {
        run_task(&t);
    }
#endif
}

static PyObject *copies_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    int workers = 0;
    static char *kwlist[] = {"workers", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i", kwlist, &workers)) {
        return NULL;
    }
    if (workers < 0 || workers > MAX_WORKERS) {
        PyErr_Format(PyExc_ValueError, "Copies: workers=%d must be in [0, %d]", workers, MAX_WORKERS);
        return NULL;
    }
    CopiesObject *c = (CopiesObject *)type->tp_alloc(type, 0);
    if (c == NULL) {
        return NULL;
    }
#if HAVE_THREADS
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
#endif
    c->workers = HAVE_THREADS ? workers : 0;
    c->keep = PyList_New(0);
    if (c->keep == NULL) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static PyObject *copies_post(CopiesObject *c, PyObject *args) {
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError,
                     "Copies.post takes (src, dst, n, run, outer, src_strides, dst_strides, stream, keep), got %zd "
                     "arguments", nargs);
        return NULL;
    }
    PyObject *head = PyTuple_GetSlice(args, 0, 8);
    if (head == NULL) {
        return NULL;
    }
    task_t t;
    int ok = parse_task(head, &t);
    Py_DECREF(head);
    if (!ok) {
        return NULL;
    }
    /* (The keep list is only touched with the GIL held, and wait() clears it after every call ended.) */
    if (PyList_Append(c->keep, PyTuple_GET_ITEM(args, 8)) < 0) {
        return NULL;
    }
#if HAVE_THREADS
    pthread_mutex_lock(&c->mu);
#endif
    int closed = c->closed, grown = 1;
    if (!closed && t.n > 0 && c->count == c->cap) {
        Py_ssize_t cap = c->cap ? 2 * c->cap : 16;
        task_t *tasks = (task_t *)realloc(c->tasks, (size_t)cap * sizeof(task_t));
        if (tasks == NULL) {
            grown = 0;
        } else {
            c->tasks = tasks;
            c->cap = cap;
        }
    }
    if (closed || !grown || t.n == 0) {
#if HAVE_THREADS
        pthread_mutex_unlock(&c->mu);
#endif
        if (closed) {
            PyErr_SetString(PyExc_ValueError, "Copies.post after wait(): start a new batch");
            return NULL;
        }
        if (!grown) {
            return PyErr_NoMemory();
        }
        Py_RETURN_NONE;
    }
    c->tasks[c->count++] = t;
#if HAVE_THREADS
    /* One more thread per call queued, up to `workers`: never more threads than calls. A thread that
     * cannot start leaves its share to wait(). */
    if (c->started < c->workers) {
        if (pthread_create(&c->threads[c->started], NULL, worker_main, c) == 0) {
            c->started++;
        } else {
            c->workers = c->started;
        }
    }
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
#endif
    Py_RETURN_NONE;
}

static PyObject *copies_wait(CopiesObject *c, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    finish(c);
    Py_END_ALLOW_THREADS
    if (PyList_SetSlice(c->keep, 0, PyList_GET_SIZE(c->keep), NULL) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static void copies_dealloc(CopiesObject *c) {
    Py_BEGIN_ALLOW_THREADS
    finish(c);  /* never free what a thread still reads */
    Py_END_ALLOW_THREADS
#if HAVE_THREADS
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
#endif
    free(c->tasks);
    Py_XDECREF(c->keep);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef copies_methods[] = {
    {"post", (PyCFunction)copies_post, METH_VARARGS,
     "post(src, dst, n, run, outer, src_strides, dst_strides, stream, keep): queue one copy_pieces call; `keep` "
     "stays referenced until wait() returns."},
    {"wait", (PyCFunction)copies_wait, METH_NOARGS,
     "wait(): copy what is still queued on this thread too, and return once every posted call has ended."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopiesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "jreshard.engine._strided.Copies",
    .tp_basicsize = sizeof(CopiesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Copies(workers=0): copy_pieces calls run by `workers` threads while the caller goes on.",
    .tp_new = copies_new,
    .tp_dealloc = (destructor)copies_dealloc,
    .tp_methods = copies_methods,
};

static PyMethodDef methods[] = {
    {"copy_pieces", py_copy_pieces, METH_VARARGS,
     "copy_pieces(src, dst, n, run, outer, src_strides, dst_strides, stream): copy n strided pieces."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_strided", "Compiled batched strided copies.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__strided(void) {
    if (PyType_Ready(&CopiesType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&CopiesType);
    if (PyModule_AddObject(m, "Copies", (PyObject *)&CopiesType) < 0) {
        Py_DECREF(&CopiesType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
