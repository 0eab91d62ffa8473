/* A prepared refit, replayed in one call (jreshard.engine.replay): packs, starts, deadline-bounded waits
 * and unpacks of every round, with the GIL released.
 *
 * A prepared schedule is a list of operations, OP_WORDS int64 words each, built once per (schedule, ranks,
 * transport) in Python:
 *
 *   PACK   rows n seg nbuf arena bytes table  gather the byte rows of ``table`` from the buffers
 *                                             addr[seg:seg+nbuf] into the staging arena addr[arena]
 *   UNPACK rows n seg nbuf arena bytes table  scatter them back
 *   START  group . . . phase . .              start the group's requests, then copy its in-process messages
 *   WAIT   group . . . phase . .              poll the group's requests until all completed, within timeout_ns
 *                                             of its START; check every receive got the bytes it expected
 *
 * ``table`` is the descriptor table (kernels.py's columns), which ``validate`` checks; ``rows`` is the same n rows
 * compacted, which ``run`` copies: per row (buffer, offset, staging offset, nbytes, ndim), then for a row of more
 * than one dimension its (extent, stride) pairs (a one-dimensional row is a run of nbytes bytes); a cast row
 * (../schedule/_rows.h: a pack's float32 -> bfloat16, an unpack's bfloat16 -> float32) has -ndim and all its pairs.
 * A refit reads a few words of each row instead of its 22 columns; ``bytes`` is the total the table moves.
 *
 * The buffers are named by index into two arrays that the caller refreshes every step: their addresses and
 * byte sizes (``addresses``, read from this step's shard and staging buffers). ``validate`` checks every row
 * and every in-process copy against those sizes; the caller runs it whenever a size changed since the last check,
 * so ``run`` trusts them. The transport is three C functions given by address, with MPI's signatures
 * (MPI_Startall, MPI_Test, MPI_Get_count): the requests are opaque handles of ``req_size`` bytes, the status
 * ``status_size`` bytes; this file includes no MPI header and links no MPI library.
 *
 * ``run`` may be given any contiguous part of the list (the caller cuts the list where it has work of its own
 * between two operations, e.g. digesting what a group sent or received): a group's start time, which bounds its
 * wait, is kept in the caller's ``posted`` array, so a START and its WAIT may fall in two calls.
 *
 * ``run`` adds the time of each run of operations of one phase to that phase (pack, network, fan-out, unpack;
 * ``times[4]`` gets the part of the waits spent idle, see wait_group) and returns 0; on a failure
 * it stops at once and fills ``fail`` = (code, group, request, value): FAIL_TIMEOUT (a group past its
 * deadline), FAIL_TRANSPORT (a start or poll returned ``value``), FAIL_SIZE (receive ``request`` got ``value``
 * bytes). A signal (Ctrl-C) while it waits raises in Python with ``fail`` = (FAIL_SIGNAL, group, ...), so the
 * caller can give the posted group up. Nothing is left posted except on failure, which the caller handles.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <time.h>

#include "../schedule/_rows.h"

#define OP_WORDS 8
#define OP_PACK 1
#define OP_UNPACK 2
#define OP_START 3
#define OP_WAIT 4
#define GROUP_WORDS 4 /* req_lo, req_hi, copy_lo, copy_hi */
#define COPY_WORDS 5  /* src buffer, src offset, dst buffer, dst offset, nbytes */
#define PHASES 4

#define FAIL_TIMEOUT 1
#define FAIL_TRANSPORT 2
#define FAIL_SIZE 3
#define FAIL_SIGNAL 4

#define TIGHT_POLLS 16         /* polls before the first yield: a round's messages usually land within these */
#define YIELD_NS 200000        /* then polls that yield the core (sched_yield) for up to 200 us before sleeping */
#define MAX_SLEEP_NS 1000000   /* the poll's sleep backs off to 1 ms (8 processes on 2 cores stay responsive) */
#define SIGNAL_EVERY_NS 50000000 /* while sleeping, look for a pending signal every 50 ms */

typedef int (*start_fn)(int, void *);
typedef int (*test_fn)(void *, int *, void *);
typedef int (*count_fn)(const void *, long, int *);

#ifdef REPLAY_PROFILE
/* Counters of where a replay's time goes, for profiling (built with -DREPLAY_PROFILE only, never in a release: the
 * clock reads cost; ``profile()`` reads and clears them): ns in starts, ns in polls, polls, polls that completed
 * nothing, ns in packs and unpacks, groups waited on. */
static int64_t prof[6];
#define PROF_ADD(i, v) (prof[i] += (v))
#else
#define PROF_ADD(i, v) ((void)0)
#endif

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Copy one compacted row (see the top; its descriptor row passed ``validate``); returns the words it takes. */
static inline int64_t copy_compact(const int64_t *r, const int64_t *addr, char *staging, int unpack, int stream) {
    int64_t nd = r[4], n = r[3];
    if (nd < 0) { /* a cast row (its descriptor row passed cast_row_ok): -ndim, then every (extent, stride) pair */
        int64_t full[COLUMNS] = {0};
        nd = -nd;
        full[C_BUF] = r[0], full[C_OFF] = r[1], full[C_STAGE] = r[2], full[C_NBYTES] = n, full[C_NDIM] = nd;
        full[C_CAST] = unpack ? CAST_BF16_F32 : CAST_F32_BF16;
        for (int64_t d = 0; d < nd; d++) {
            full[C_SHAPE0 + d] = r[5 + 2 * d], full[C_STRIDE0 + d] = r[6 + 2 * d];
        }
        cast_row(full, addr, staging, unpack, stream);
        return 5 + 2 * nd;
    }
    if (nd == 1) {
        if (n > 0) {
            char *at = (char *)(uintptr_t)addr[r[0]] + r[1], *stage = staging + r[2];
            char *dst = unpack ? at : stage;
            const char *src = unpack ? stage : at;
            if (stream && n >= STREAM_RUN) {
                stream_copy(dst, src, (size_t)n);
            } else {
                memcpy(dst, src, (size_t)n);
            }
        }
        return 5;
    }
    int64_t full[COLUMNS] = {0};
    full[C_BUF] = r[0], full[C_OFF] = r[1], full[C_STAGE] = r[2], full[C_NBYTES] = n, full[C_NDIM] = nd;
    for (int64_t d = 0; d < nd; d++) {
        full[C_SHAPE0 + d] = r[5 + 2 * d], full[C_STRIDE0 + d] = r[6 + 2 * d];
    }
    copy_row(full, addr, staging, unpack, stream);
    return 5 + 2 * nd;
}

/* The prepared schedule, as ``run`` and ``validate`` read it. */
typedef struct {
    const int64_t *ops, *groups, *copies, *addr, *size, *expect;
    Py_ssize_t nops, ngroups, ncopies, nbuf;
    char *reqs, *status;
    Py_ssize_t req_size, status_size;
    long byte_type;
    start_fn start;
    test_fn test;
    count_fn count;
} prepared;

static int parse(PyObject *args, prepared *p, int with_transport) {
    unsigned long long ops, groups, copies, addr, size, expect = 0, reqs = 0, status = 0, start = 0, test = 0,
                       count = 0;
    long byte_type = 0;
    Py_ssize_t req_size = 0, status_size = 0;
    if (with_transport) {
        if (!PyArg_ParseTuple(args, "KnKnKnKKnKKnKnlKKK", &ops, &p->nops, &groups, &p->ngroups, &copies,
                              &p->ncopies, &addr, &size, &p->nbuf, &expect, &reqs, &req_size, &status, &status_size,
                              &byte_type, &start, &test, &count)) {
            return 0;
        }
    } else if (!PyArg_ParseTuple(args, "KnKnKnKKn", &ops, &p->nops, &groups, &p->ngroups, &copies, &p->ncopies, &addr,
                                 &size, &p->nbuf)) {
        return 0;
    }
    if (p->nops < 0 || p->ngroups < 0 || p->ncopies < 0 || p->nbuf < 0 || req_size < 0 || status_size < 0 ||
        (p->nops && !ops) || (p->ngroups && !groups) || (p->ncopies && !copies) || (p->nbuf && (!addr || !size)) ||
        (with_transport && p->ngroups && (!start || !test || !count || !status || !expect || !reqs))) {
        PyErr_SetString(PyExc_ValueError, "replay: a negative count or a null address");
        return 0;
    }
    p->ops = (const int64_t *)(uintptr_t)ops, p->groups = (const int64_t *)(uintptr_t)groups;
    p->copies = (const int64_t *)(uintptr_t)copies, p->addr = (const int64_t *)(uintptr_t)addr;
    p->size = (const int64_t *)(uintptr_t)size, p->expect = (const int64_t *)(uintptr_t)expect;
    p->reqs = (char *)(uintptr_t)reqs, p->status = (char *)(uintptr_t)status;
    p->req_size = req_size, p->status_size = status_size, p->byte_type = byte_type;
    p->start = (start_fn)(uintptr_t)start, p->test = (test_fn)(uintptr_t)test, p->count = (count_fn)(uintptr_t)count;
    return 1;
}

/* Whether the in-process copy c lies inside both of its buffers. */
static int copy_ok(const int64_t *c, const prepared *p) {
    int64_t end;
    for (int side = 0; side < 2; side++) {
        int64_t b = c[2 * side], off = c[2 * side + 1];
        if (b < 0 || b >= p->nbuf || p->addr[b] == 0 || off < 0 || c[4] < 0 ||
            __builtin_add_overflow(off, c[4], &end) || end > p->size[b]) {
            return 0;
        }
    }
    return 1;
}

/* validate(ops, nops, groups, ngroups, copies, ncopies, addresses, sizes, nbuf): -1 when every row of every
 * PACK and UNPACK and every in-process copy lies inside its buffers; else the index of the first operation (or
 * nops + k for in-process copy k) that does not. */
static PyObject *py_validate(PyObject *self, PyObject *args) {
    (void)self;
    prepared p = {0};
    if (!parse(args, &p, 0)) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < p.nops; i++) {
        const int64_t *op = p.ops + OP_WORDS * i;
        if (op[0] == OP_PACK || op[0] == OP_UNPACK) {
            const int64_t *table = (const int64_t *)(uintptr_t)op[7];
            int64_t seg = op[3], n = op[4], arena = op[5];
            if (seg < 0 || n < 0 || seg > p.nbuf - n || arena < 0 || arena >= p.nbuf || p.addr[arena] == 0) {
                return PyLong_FromSsize_t(i);
            }
            for (int64_t k = 0; k < op[2]; k++) {
                const int64_t *r = table + COLUMNS * k;
                if (r[C_CAST] ? !cast_row_ok(r, p.addr + seg, p.size + seg, n, p.size[arena], op[0] == OP_UNPACK)
                              : !row_ok(r, p.addr + seg, p.size + seg, n, p.size[arena])) {
                    return PyLong_FromSsize_t(i);
                }
            }
        } else if (op[0] == OP_START || op[0] == OP_WAIT) {
            if (op[1] < 0 || op[1] >= p.ngroups) {
                return PyLong_FromSsize_t(i);
            }
        } else {
            return PyLong_FromSsize_t(i);
        }
    }
    for (Py_ssize_t g = 0; g < p.ngroups; g++) {
        const int64_t *gr = p.groups + GROUP_WORDS * g;
        if (gr[0] < 0 || gr[1] < gr[0] || gr[2] < 0 || gr[3] < gr[2] || gr[3] > p.ncopies) {
            return PyLong_FromSsize_t(p.nops + p.ncopies);
        }
    }
    for (Py_ssize_t k = 0; k < p.ncopies; k++) {
        if (!copy_ok(p.copies + COPY_WORDS * k, &p)) {
            return PyLong_FromSsize_t(p.nops + k);
        }
    }
    return PyLong_FromLong(-1);
}

/* Wait for group g's requests, in order, until all completed or its deadline passed; 0, or a FAIL_ code with fail
 * filled. The poll is MPI_Test's on the first request not yet seen complete: a request that completed while an
 * earlier one was polled costs no progress call when its turn comes, so a group of n requests takes n polls
 * plus one per poll that found its request incomplete (MPI_Testsome scans every request of the group each
 * poll: a group of a hundred receives, each landing in its own progress call, costs quadratic time). Each
 * receive's byte count is checked as it completes. While polls find nothing, the loop backs off: a few tight
 * polls, then polls that yield the core (sched_yield) for YIELD_NS, then sleeps that double up to MAX_SLEEP_NS.
 * ``idle`` gets the time from the end of the first poll of each stretch of polls that completed nothing to the
 * end of its last (the later polls and the back-off between them): the host waited on its peers or the wire. The
 * polls that completed a request, the first failed one of each stretch and the checks count as the host's work. */
static int wait_group(const prepared *p, Py_ssize_t g, int64_t deadline, int64_t *fail, double *idle,
                      PyThreadState **save) {
    const int64_t *gr = p->groups + GROUP_WORDS * g;
    int64_t k = gr[0], hi = gr[1], sleep_ns = 0, signal_at = 0, idle_from = 0, last = 0, waited = 0;
    int polls = 0;
    while (k < hi) {
        int flag = 0;
#ifdef REPLAY_PROFILE
        int64_t t0 = now_ns();
#endif
        int rc = p->test(p->reqs + k * p->req_size, &flag, p->status);
#ifdef REPLAY_PROFILE
        PROF_ADD(1, now_ns() - t0), PROF_ADD(2, 1), PROF_ADD(3, !flag);
#endif
        if (rc != 0) {
            fail[0] = FAIL_TRANSPORT, fail[1] = g, fail[2] = -1, fail[3] = rc;
            return FAIL_TRANSPORT;
        }
        if (flag) {
            int64_t want = p->expect[k];
            if (want >= 0) { /* a receive that got other than the planned bytes: the sides differ */
                int got = -1;
                rc = p->count(p->status, p->byte_type, &got);
                if (rc != 0 || got != want) {
                    fail[0] = FAIL_SIZE, fail[1] = g, fail[2] = k, fail[3] = rc != 0 ? -1 : got;
                    return FAIL_SIZE;
                }
            }
            k++;
            if (polls) { /* the end of a stretch of failed polls: the next starts anew */
                last = 0, idle_from = 0, sleep_ns = 0, polls = 0;
            }
            continue;
        }
        int64_t t = now_ns();
        if (!idle_from) {
            idle_from = t;
        }
        waited += last ? t - last : 0; /* this poll and the back-off before it, after a stretch's first */
        last = t;
        if (t > deadline) {
            fail[0] = FAIL_TIMEOUT, fail[1] = g, fail[2] = -1, fail[3] = 0;
            *idle += (double)waited * 1e-9;
            return FAIL_TIMEOUT;
        }
        if (polls++ < TIGHT_POLLS) {
            continue;
        }
        if (t - idle_from < YIELD_NS) { /* the peer is a round trip away: give the core to whoever needs it */
            sched_yield();
            continue;
        }
        if (t >= signal_at) {
            PyEval_RestoreThread(*save);
            int sig = PyErr_CheckSignals();
            *save = PyEval_SaveThread();
            if (sig < 0) {
                fail[0] = FAIL_SIGNAL, fail[1] = g, fail[2] = -1, fail[3] = 0;
                return FAIL_SIGNAL;
            }
            signal_at = t + SIGNAL_EVERY_NS;
        }
        struct timespec ts = {0, (long)sleep_ns};
        nanosleep(&ts, NULL);
        sleep_ns = 2 * sleep_ns + 10000;
        if (sleep_ns > MAX_SLEEP_NS) {
            sleep_ns = MAX_SLEEP_NS;
        }
    }
    *idle += (double)waited * 1e-9;
    return 0;
}

/* run(ops, nops, groups, ngroups, copies, ncopies, addresses, sizes, nbuf, expect, requests, req_size, status,
 * status_size, byte_type, start, test, count, timeout_ns, times, fail, posted): the operations ``ops`` of a
 * prepared schedule, all or a part (see the top); ``status`` is scratch for one status; ``posted`` is
 * int64[ngroups], each group's start time (written by its START, read by its WAIT). */
static PyObject *py_run(PyObject *self, PyObject *args) {
    (void)self;
    prepared p = {0};
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n != 22) {
        PyErr_SetString(PyExc_TypeError, "replay.run takes 22 arguments");
        return NULL;
    }
    PyObject *head = PyTuple_GetSlice(args, 0, 18);
    if (head == NULL) {
        return NULL;
    }
    int ok = parse(head, &p, 1);
    Py_DECREF(head);
    long long timeout_ns = PyLong_AsLongLong(PyTuple_GET_ITEM(args, 18));
    unsigned long long times_p = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, 19));
    unsigned long long fail_p = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, 20));
    unsigned long long posted_p = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, 21));
    if (!ok || PyErr_Occurred()) {
        return NULL;
    }
    if (!times_p || !fail_p || (p.ngroups && !posted_p) || timeout_ns < 0) {
        PyErr_SetString(PyExc_ValueError, "replay.run: a null times, fail or posted array, or a negative timeout");
        return NULL;
    }
    double *times = (double *)(uintptr_t)times_p;
    int64_t *fail = (int64_t *)(uintptr_t)fail_p;
    int64_t *posted = (int64_t *)(uintptr_t)posted_p;
    int code = 0;
    PyThreadState *save = PyEval_SaveThread();
    /* Each phase's time is taken per run of operations of that phase: the clock (about 40 ns a read on a VM) is read
     * where the phase changes and at each START (its group's deadline counts from it), not after every operation. */
    int64_t t = now_ns();
    int run = -1; /* the phase of the run of operations since t */
    for (Py_ssize_t i = 0; i < p.nops && code == 0; i++) {
        const int64_t *op = p.ops + OP_WORDS * i;
        int phase = op[0] == OP_PACK ? 0 : op[0] == OP_UNPACK ? 3 : (int)op[5];
        if (op[0] == OP_START || phase != run) {
            int64_t t2 = now_ns();
            if (run >= 0) {
                times[run] += (double)(t2 - t) * 1e-9;
            }
            t = t2, run = phase;
        }
        if (op[0] == OP_PACK || op[0] == OP_UNPACK) {
            const int64_t *row = (const int64_t *)(uintptr_t)op[1];
            int unpack = op[0] == OP_UNPACK, stream = op[6] >= STREAM_MIN;
            const int64_t *addr = p.addr + op[3];
            char *staging = (char *)(uintptr_t)p.addr[op[5]];
#ifdef REPLAY_PROFILE
            int64_t t0 = now_ns();
#endif
            for (int64_t k = 0; k < op[2]; k++) {
                row += copy_compact(row, addr, staging, unpack, stream);
            }
            if (stream) {
                STREAM_FENCE();
            }
#ifdef REPLAY_PROFILE
            PROF_ADD(4, now_ns() - t0);
#endif
        } else {
            Py_ssize_t g = (Py_ssize_t)op[1];
            const int64_t *gr = p.groups + GROUP_WORDS * g;
            if (op[0] == OP_START) {
                posted[g] = t; /* read just above */
                int rc = gr[1] > gr[0] ? p.start((int)(gr[1] - gr[0]), p.reqs + gr[0] * p.req_size) : 0;
                PROF_ADD(0, now_ns() - posted[g]);
                if (rc != 0) {
                    fail[0] = FAIL_TRANSPORT, fail[1] = g, fail[2] = -1, fail[3] = rc;
                    code = FAIL_TRANSPORT;
                    break;
                }
                for (int64_t k = gr[2]; k < gr[3]; k++) {
                    const int64_t *c = p.copies + COPY_WORDS * k;
                    memcpy((char *)(uintptr_t)p.addr[c[2]] + c[3], (const char *)(uintptr_t)p.addr[c[0]] + c[1],
                           (size_t)c[4]);
                }
            } else if (gr[1] > gr[0]) {
                code = wait_group(&p, g, posted[g] + timeout_ns, fail, times + PHASES, &save);
                PROF_ADD(5, 1);
            }
        }
    }
    if (run >= 0) {
        times[run] += (double)(now_ns() - t) * 1e-9;
    }
    PyEval_RestoreThread(save);
    if (code == FAIL_SIGNAL) {
        return NULL; /* the signal's exception is set; fail says which group was posted */
    }
    return PyLong_FromLong(code);
}

/* addresses(buffers, addresses, sizes, readonly): for each object of the sequence ``buffers`` (None, or one that
 * exports a contiguous buffer), write its address and byte size (0 and -1 for None; address 0 for an empty one) and whether it is read-only,
 * into the int64 arrays at the three addresses. Raises TypeError for an object with no contiguous buffer. */
static PyObject *py_addresses(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seq;
    unsigned long long addr_p, size_p, ro_p;
    if (!PyArg_ParseTuple(args, "OKKK", &seq, &addr_p, &size_p, &ro_p)) {
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "addresses: buffers must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    int64_t *addr = (int64_t *)(uintptr_t)addr_p, *size = (int64_t *)(uintptr_t)size_p, *ro = (int64_t *)(uintptr_t)ro_p;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == Py_None) {
            addr[i] = 0, size[i] = -1, ro[i] = 1;
            continue;
        }
        Py_buffer view;
        if (PyObject_GetBuffer(items[i], &view, PyBUF_SIMPLE) < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        addr[i] = (int64_t)(uintptr_t)view.buf, size[i] = (int64_t)view.len, ro[i] = view.readonly;
        if (view.len == 0) {
            addr[i] = 0; /* an empty buffer is no buffer: no row may name it */
        }
        PyBuffer_Release(&view);
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(n);
}

#ifdef REPLAY_PROFILE
static PyObject *py_profile(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    PyObject *out = Py_BuildValue("(LLLLLL)", (long long)prof[0], (long long)prof[1], (long long)prof[2],
                                  (long long)prof[3], (long long)prof[4], (long long)prof[5]);
    memset(prof, 0, sizeof(prof));
    return out;
}
#endif

static PyMethodDef methods[] = {
#ifdef REPLAY_PROFILE
    {"profile", py_profile, METH_NOARGS, "profile(): (start ns, poll ns, polls, empty polls, copy ns, waits); cleared."},
#endif
    {"run", py_run, METH_VARARGS, "run(...): replay a prepared schedule (see jreshard/engine/_replay.c)."},
    {"validate", py_validate, METH_VARARGS, "validate(...): -1, or the first operation that leaves its buffers."},
    {"addresses", py_addresses, METH_VARARGS, "addresses(buffers, addresses, sizes, readonly): read buffers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replay", "Prepared refits replayed in one call.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__replay(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "OP_WORDS", OP_WORDS) || PyModule_AddIntConstant(m, "OP_PACK", OP_PACK) ||
        PyModule_AddIntConstant(m, "OP_UNPACK", OP_UNPACK) || PyModule_AddIntConstant(m, "OP_START", OP_START) ||
        PyModule_AddIntConstant(m, "OP_WAIT", OP_WAIT) || PyModule_AddIntConstant(m, "GROUP_WORDS", GROUP_WORDS) ||
        PyModule_AddIntConstant(m, "COPY_WORDS", COPY_WORDS) || PyModule_AddIntConstant(m, "COLUMNS", COLUMNS) ||
        PyModule_AddIntConstant(m, "FAIL_TIMEOUT", FAIL_TIMEOUT) ||
        PyModule_AddIntConstant(m, "FAIL_TRANSPORT", FAIL_TRANSPORT) ||
        PyModule_AddIntConstant(m, "FAIL_SIZE", FAIL_SIZE) || PyModule_AddIntConstant(m, "FAIL_SIGNAL", FAIL_SIGNAL) ||
        PyModule_AddIntConstant(m, "CAST_F32_BF16", CAST_F32_BF16) ||
        PyModule_AddIntConstant(m, "CAST_BF16_F32", CAST_BF16_F32)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
