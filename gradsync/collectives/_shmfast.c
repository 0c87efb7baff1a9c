/* gradsync's compiled fast paths: the one-step shared-memory allreduce of the host's segment
 * (transport/host_segment.py) and its barrier, the streaming copy of its pieces road ("The
 * streaming copy"), the small call's steps on the way to the one-step allreduce ("The small
 * call's steps, compiled"), and the beater of heartbeat.py and the data servers (at the end
 * of this file, "The beater").
 *
 * A small allreduce among the ranks of one host is one synchronisation: every rank copies
 * its data into its slot, publishes its arrival counter, waits until every other rank has
 * arrived, then folds all the slots itself in local-rank order (rank 0's first), so every
 * rank ends with bitwise identical bytes. Done in Python that is ~20 interpreter-level steps
 * (views, copies, a counter loop, a ufunc per rank, the division of an Average); here it is
 * one call, so a 4 KiB allreduce costs a few hundred nanoseconds of work plus the wait.
 *
 * This file is a second implementation of ShmGroup._allreduce_small, not a new protocol: it
 * reads and writes the same segment in the same layout (transport/host_segment.py describes
 * it; the constants below must match it), publishes the same counters and issued words,
 * sleeps on the same futex words announcing itself in the same _SLEEPING word. A rank on this path
 * and a rank on the Python path therefore meet in the same collective (tests/test_shm.py
 * mixes them). A barrier is the same call with no data and its own kind in the issued words
 * (ShmGroup.barrier's _arrive in Python): the arrival and the wait, nothing to fold.
 *
 * The wait, as in ShmGroup._wait: spin (spin_ns), then yield the core between looks (until
 * yield_ns after the wait began), then sleep on a futex (or nap nap_ns where there is none),
 * until budget_ns after the wait began; the four come from transport/wait.py at open(). Past
 * the budget the call returns WAITING and Python takes over the wait: it owns the deadline,
 * the liveness checks and on_idle, which all run on the same 50 ms schedule as before, so a
 * lost peer ends in the same PeerLostError or timeout, never in a hang here.
 *
 * Memory order (x86-64 only, like the Python path: ShmGroup refuses other machines): the
 * slot bytes and the issued words are written before the counter with a release store; a
 * reader loads the counter with an acquire load before it reads the slots. The full fence
 * between publishing a counter and reading the peers' _SLEEPING words is the one
 * transport/futex.py explains (no lost wake-up).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <emmintrin.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The segment's layout (transport/host_segment.py). */
#define WORDS 8 /* 64-bit words per cache line */
enum { ARRIVED = 0, SLEEPING = 5, ISSUED = WORDS };
/* Kinds of collective in the issued words (segment_layout.py's _ALLREDUCE .. _ALLREDUCE_SHARED):
 * an allreduce, or a barrier (no bytes, nothing folded), the two this file runs. */
enum { KIND_ALLREDUCE = 1, KIND_BARRIER = 3 };

/* What call() and fold() return to Python. */
enum { DONE = 0, WAITING = 1, MISMATCH = 2 };

/* Kernel codes: op << 4 | dtype (transport/host_segment.py builds them). */
enum { OP_SUM = 0, OP_MIN = 1, OP_MAX = 2, OP_PROD = 3 };
enum { T_F32 = 0, T_F64 = 1, T_I32 = 2, T_I64 = 3 };
static const Py_ssize_t ITEMSIZE[] = {4, 8, 4, 8};

typedef struct {
    Py_buffer segment;      /* held while the group lives: the mapping cannot go under a call */
    uint64_t *ctl;          /* the control lines: line 0 the layout, then 2 per local rank */
    char *slots;            /* slot (r, parity) starts at slots + (2 r + parity) slot_bytes */
    Py_ssize_t slot_bytes;
    int rank, size, futex;
    int64_t spin_ns, yield_ns, budget_ns, nap_ns; /* transport/wait.py's native_ladder */
    int64_t barrier_yield_ns; /* a barrier's yield_ns (the ladder's fifth rung) */
} group;

static const char CAPSULE[] = "gradsync._shmfast.group";

static inline uint64_t *line(const group *g, int r) { return g->ctl + (1 + 2 * r) * WORDS; }
static inline char *slot(const group *g, int r, uint64_t parity) {
    return g->slots + (2 * (Py_ssize_t)r + (Py_ssize_t)parity) * g->slot_bytes;
}
static inline uint64_t load(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Shared (not private) futexes: the Python path's transport/futex.py uses the same ops. */
static long futex(uint64_t *word, int op, uint32_t value, const struct timespec *timeout) {
    return syscall(SYS_futex, (uint32_t *)word, op, value, timeout, NULL, 0);
}

/* The first local rank whose counter `word` is below seq, or -1 when all have reached it. */
static int behind(const group *g, int word, uint64_t seq) {
    for (int r = 0; r < g->size; r++)
        if (r != g->rank && load(line(g, r) + word) < seq) return r;
    return -1;
}

/* Raises my counter `word` to seq and wakes a rank that announced it sleeps on it. */
static void publish(const group *g, int word, uint64_t seq) {
    uint64_t *mine = line(g, g->rank) + word;
    store(mine, seq);
    if (!g->futex) return;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t asleep_on_me = 1 + ((uint64_t)g->rank << 4 | (uint64_t)word);
    for (int r = 0; r < g->size; r++)
        if (r != g->rank && load(line(g, r) + SLEEPING) == asleep_on_me) {
            futex(mine, FUTEX_WAKE, INT_MAX, NULL);
            return;
        }
}

/* Waits (GIL released by the caller) until every other rank's counter `word` reaches seq,
 * yielding until yield_ns, at most budget_ns; returns DONE or WAITING. */
static int wait_for(const group *g, int word, uint64_t seq, int64_t yield_ns) {
    int64_t started = now_ns(), now = started;
    int r;
    while ((r = behind(g, word, seq)) >= 0) {
        now = now_ns();
        if (now - started < g->spin_ns) {
            __builtin_ia32_pause();
        } else if (now - started < yield_ns) {
            sched_yield();
        } else if (now - started < g->budget_ns) {
            if (!g->futex) {
                struct timespec nap = {g->nap_ns / 1000000000, g->nap_ns % 1000000000};
                nanosleep(&nap, NULL);
                continue;
            }
            uint64_t *sleeping = line(g, g->rank) + SLEEPING, *at = line(g, r) + word;
            store(sleeping, 1 + ((uint64_t)r << 4 | (uint64_t)word));
            uint64_t seen = load(at);
            if (seen < seq) {
                int64_t left = g->budget_ns - (now - started);
                struct timespec ts = {left / 1000000000, left % 1000000000};
                /* The kernel sleeps only while the word still holds `seen`'s low half. */
                futex(at, FUTEX_WAIT, (uint32_t)seen, &ts);
            }
            store(sleeping, 0);
        } else {
            return WAITING;
        }
    }
    return DONE;
}

/* Whether every rank issued what I issued at seq (else Python reports who issued what). */
static int agree(const group *g, uint64_t seq, uint64_t kind, uint64_t nbytes,
                 uint64_t signature) {
    int at = ISSUED + 3 * (int)(seq & 1);
    for (int r = 0; r < g->size; r++) {
        const uint64_t *w = line(g, r) + at;
        if (w[0] != kind || w[1] != nbytes || w[2] != signature) return 0;
    }
    return 1;
}

/* Element-wise kernels. Integer sums and products wrap (computed unsigned), as NumPy's do.
 * Min and max return a NaN operand, the first one, as np.minimum / np.maximum do. */
#define FOLD(T, U)                                                                          \
    static void fold_##T(T *d, const T *s, Py_ssize_t n, int op) {                         \
        switch (op) {                                                                       \
        case OP_SUM:                                                                        \
            for (Py_ssize_t i = 0; i < n; i++) d[i] = (T)((U)d[i] + (U)s[i]);               \
            break;                                                                          \
        case OP_PROD:                                                                       \
            for (Py_ssize_t i = 0; i < n; i++) d[i] = (T)((U)d[i] * (U)s[i]);               \
            break;                                                                          \
        case OP_MIN:                                                                        \
            for (Py_ssize_t i = 0; i < n; i++) d[i] = (d[i] <= s[i] || d[i] != d[i]) ? d[i] : s[i]; \
            break;                                                                          \
        default:                                                                            \
            for (Py_ssize_t i = 0; i < n; i++) d[i] = (d[i] >= s[i] || d[i] != d[i]) ? d[i] : s[i]; \
        }                                                                                   \
    }
FOLD(float, float)
FOLD(double, double)
FOLD(int32_t, uint32_t)
FOLD(int64_t, uint64_t)

/* An Average's division, as ops.scale does it: in the element type; integers
 * rounded down (floor_divide), or toward zero with trunc (Horovod's). */
#define DIVIDE_FLOAT(T)                                                                     \
    static void divide_##T(T *d, Py_ssize_t n, int64_t by, int trunc) {                    \
        (void)trunc;                                                                        \
        T q = (T)by;                                                                        \
        for (Py_ssize_t i = 0; i < n; i++) d[i] = d[i] / q;                                 \
    }
#define DIVIDE_INT(T)                                                                       \
    static void divide_##T(T *d, Py_ssize_t n, int64_t by, int trunc) {                    \
        T q = (T)by;                                                                        \
        for (Py_ssize_t i = 0; i < n; i++) {                                                \
            T x = d[i] / q;                                                                 \
            d[i] = (!trunc && d[i] % q != 0 && (d[i] < 0) != (q < 0)) ? x - 1 : x;          \
        }                                                                                   \
    }
DIVIDE_FLOAT(float)
DIVIDE_FLOAT(double)
DIVIDE_INT(int32_t)
DIVIDE_INT(int64_t)

/* The result into data: rank 0's slot (my own data if I am rank 0), then every other slot
 * folded in local-rank order, then the division. */
static void reduce(const group *g, char *data, Py_ssize_t nbytes, uint64_t parity, int code,
                   int64_t divisor, int trunc) {
    int op = code >> 4, type = code & 15;
    Py_ssize_t n = nbytes / ITEMSIZE[type];
    if (n == 0) return;
    if (g->rank) memcpy(data, slot(g, 0, parity), (size_t)nbytes);
    for (int r = 1; r < g->size; r++) {
        const char *s = slot(g, r, parity);
        switch (type) {
        case T_F32: fold_float((float *)data, (const float *)s, n, op); break;
        case T_F64: fold_double((double *)data, (const double *)s, n, op); break;
        case T_I32: fold_int32_t((int32_t *)data, (const int32_t *)s, n, op); break;
        default: fold_int64_t((int64_t *)data, (const int64_t *)s, n, op);
        }
    }
    if (divisor) {
        switch (type) {
        case T_F32: divide_float((float *)data, n, divisor, trunc); break;
        case T_F64: divide_double((double *)data, n, divisor, trunc); break;
        case T_I32: divide_int32_t((int32_t *)data, n, divisor, trunc); break;
        default: divide_int64_t((int64_t *)data, n, divisor, trunc);
        }
    }
}

/* --- Python bindings ------------------------------------------------------------------ */

static void free_group(PyObject *capsule) {
    group *g = PyCapsule_GetPointer(capsule, CAPSULE);
    PyBuffer_Release(&g->segment);
    PyMem_Free(g);
}

/* open(segment, rank, size, slot_bytes, control_bytes, futex, spin_ns, yield_ns, budget_ns,
 * nap_ns, barrier_yield_ns) -> capsule. The five durations are the wait's ladder
 * (transport/wait.py's native_ladder; a barrier yields until barrier_yield_ns instead of
 * yield_ns); this file keeps none of its own. The capsule holds a buffer export of the
 * segment until it is freed, so the mmap refuses to close while a call (which holds the
 * capsule) may still read it; ShmGroup drops its capsule before it closes the segment. */
static PyObject *py_open(PyObject *self, PyObject *args) {
    PyObject *segment;
    int rank, size, use_futex;
    Py_ssize_t slot_bytes, control_bytes;
    long long spin_ns, yield_ns, budget_ns, nap_ns, barrier_yield_ns;
    if (!PyArg_ParseTuple(args, "OiinnpLLLLL", &segment, &rank, &size, &slot_bytes,
                          &control_bytes, &use_futex, &spin_ns, &yield_ns, &budget_ns, &nap_ns,
                          &barrier_yield_ns))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(segment, &view, PyBUF_WRITABLE) < 0) return NULL;
    char *base = view.buf;
    if (size < 1 || rank < 0 || rank >= size || slot_bytes < 64 ||
        view.len != control_bytes + 2 * size * slot_bytes) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "segment does not match the group's layout");
        return NULL;
    }
    group *g = PyMem_Calloc(1, sizeof(group));
    if (!g) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    *g = (group){view, (uint64_t *)base, base + control_bytes, slot_bytes, rank, size,
                 use_futex, spin_ns, yield_ns, budget_ns, nap_ns, barrier_yield_ns};
    PyObject *capsule = PyCapsule_New(g, CAPSULE, free_group);
    if (!capsule) {
        PyBuffer_Release(&g->segment);
        PyMem_Free(g);
    }
    return capsule;
}

/* Parses (capsule, data, seq, signature, code, divisor, trunc[, kind]) shared by call and
 * fold. kind (default KIND_ALLREDUCE) is KIND_BARRIER for a barrier: empty data, any code. */
typedef struct {
    group *g;
    Py_buffer data;
    uint64_t seq, signature;
    int code, trunc, kind;
    int64_t divisor;
} request;

static int parse(PyObject *const *args, Py_ssize_t nargs, request *q) {
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "expected 7 or 8 arguments");
        return -1;
    }
    q->kind = nargs == 8 ? (int)PyLong_AsLong(args[7]) : KIND_ALLREDUCE;
    q->g = PyCapsule_GetPointer(args[0], CAPSULE);
    if (!q->g) return -1;
    q->seq = PyLong_AsUnsignedLongLong(args[2]);
    q->signature = PyLong_AsUnsignedLongLongMask(args[3]);
    q->code = (int)PyLong_AsLong(args[4]);
    q->divisor = PyLong_AsLongLong(args[5]);
    q->trunc = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred()) return -1;
    int op = q->code >> 4, type = q->code & 15;
    if (op < OP_SUM || op > OP_PROD || type < T_F32 || type > T_I64 || q->divisor < 0 ||
        (q->kind != KIND_ALLREDUCE && q->kind != KIND_BARRIER)) {
        PyErr_Format(PyExc_ValueError, "bad kernel code %d, divisor or kind %d", q->code,
                     q->kind);
        return -1;
    }
    if (PyObject_GetBuffer(args[1], &q->data, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (q->data.len > q->g->slot_bytes || q->data.len % ITEMSIZE[type] ||
        (q->kind == KIND_BARRIER && q->data.len)) {
        PyBuffer_Release(&q->data);
        PyErr_Format(PyExc_ValueError, "%zd bytes do not fit a %zd-byte slot in whole elements"
                     " (a barrier takes none)", q->data.len, q->g->slot_bytes);
        return -1;
    }
    return 0;
}

/* The fold of request q once every rank has arrived: DONE, or MISMATCH when the issued words
 * differ; releases q's buffer. */
static int fold_request(request *q) {
    int status = MISMATCH;
    if (agree(q->g, q->seq, (uint64_t)q->kind, (uint64_t)q->data.len, q->signature)) {
        reduce(q->g, q->data.buf, q->data.len, q->seq & 1, q->code, q->divisor, q->trunc);
        status = DONE;
    }
    PyBuffer_Release(&q->data);
    return status;
}

/* The whole one-step allreduce of request q (or its barrier): copy in, publish, wait up to
 * the budget (the GIL released), agree and fold. Returns DONE, WAITING or MISMATCH and
 * releases q's buffer. */
static int run_request(request *q) {
    group *g = q->g;
    uint64_t parity = q->seq & 1, *issued = line(g, g->rank) + ISSUED + 3 * parity;
    if (q->data.len) memcpy(slot(g, g->rank, parity), q->data.buf, (size_t)q->data.len);
    issued[0] = (uint64_t)q->kind;
    issued[1] = (uint64_t)q->data.len;
    issued[2] = q->signature;
    publish(g, ARRIVED, q->seq); /* last: a release store, after the slot and the words */
    if (behind(g, ARRIVED, q->seq) >= 0) {
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = wait_for(g, ARRIVED, q->seq,
                          q->kind == KIND_BARRIER ? g->barrier_yield_ns : g->yield_ns);
        Py_END_ALLOW_THREADS
        if (status == WAITING) {
            PyBuffer_Release(&q->data);
            return WAITING;
        }
    }
    return fold_request(q);
}

/* call(group, data, seq, signature, code, divisor, trunc[, kind]) -> DONE, WAITING or
 * MISMATCH. The whole one-step allreduce of piece seq (or, with KIND_BARRIER and no data, a
 * barrier: the arrival and the wait alone); on WAITING, Python waits for the arrivals and
 * then calls fold with the same arguments. */
static PyObject *py_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    request q;
    if (parse(args, nargs, &q) < 0) return NULL;
    return PyLong_FromLong(run_request(&q));
}

/* fold(group, data, seq, signature, code, divisor, trunc[, kind]) -> DONE or MISMATCH: the
 * rest of call() once every rank has arrived at seq. */
static PyObject *py_fold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    request q;
    if (parse(args, nargs, &q) < 0) return NULL;
    return PyLong_FromLong(fold_request(&q));
}

/* --- The streaming copy ------------------------------------------------------------------
 *
 * stream(dst, src) copies src's bytes into dst (the same length) with non-temporal stores:
 * the lines go towards memory, not into this core's cache, and no line is read for ownership
 * first. Then a store fence, so that the bytes are visible before the counter that publishes
 * them (the release store of publish() orders ordinary stores only). The pieces road of
 * transport/host_segment.py writes its slot this way where the ranks measured it faster
 * (transport/segment_stores.py says when and why: on some machines a line written by one
 * core and read by another crosses several times slower than through memory). The GIL is
 * released: a piece is up to a slot, and a training step's thread may run meanwhile.
 */

static void stream_bytes(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    for (; n >= 16; n -= 16, d += 16, s += 16)
        _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
    memcpy(d, s, n);
    _mm_sfence();
}

static PyObject *py_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "stream(dst, src) takes two buffers");
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    int same = dst.len == src.len;
    if (same) {
        Py_BEGIN_ALLOW_THREADS
        stream_bytes(dst.buf, src.buf, (size_t)dst.len);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_Format(PyExc_ValueError, "stream: %zd bytes into %zd", src.len, dst.len);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (!same) return NULL;
    Py_RETURN_NONE;
}

/* --- The small call's steps, compiled ------------------------------------------------------
 *
 * A small synchronous allreduce on one host (api._quick, the pipeline's fast case) is a few
 * microseconds, and the Python on the way to call() took as long as the exchange itself:
 * some ten Python functions, each a frame of the interpreter. Three objects take those
 * steps in C:
 *
 * - Prepared (below, "The prepared run, compiled"): a named prepared allreduce's run, the
 *   Comm's begin, then the segment's entry and call();
 * - Inline ("The engine's inline run, compiled"): pipeline/engine.py's Engine.run on the
 *   caller's thread, the claim, the record issued started (flight_recorder.py's
 *   Track.issue), the World's failure, the run (a Prepared's in C, any other callable
 *   called), the record's end and the pace meter's count (Record.done), the release and the
 *   blocked time;
 * - Quick ("The front, compiled"): api._quick for a named call on a NumPy array.
 *
 * Like call() for _allreduce_small, each is a second implementation of Python steps, not new
 * steps: it reads and writes the same fields in the same order, and hands each case it does
 * not take to the Python that does (named in each section). tests/test_express.py runs the
 * fast case both ways; tests/test_small_call_compiled.py compares what each leaves behind. A
 * change to one of those Python steps is a change here too (each says so).
 *
 * What C saves is the interpreter's frames and calls, not its attribute traffic: an
 * attribute of an ordinary object read from C by name (PyObject_GetAttr) costs about 190
 * machine instructions, more than the interpreter's specialised bytecode, and a first
 * Prepared written that way ran 900 instructions more than the Python it replaced
 * (docs/benchmarks.md, "The small call's steps in C"). So the fields these objects touch per
 * call are the classes' __slots__, found once by their member descriptors (slot_offset) and
 * then read and written at their offsets, which is what the interpreter itself does with a
 * slot.
 */

/* --- The engine's inline run, compiled: Inline(engine, meter, Record, states, kind), called
 * as inline(fn, name, shape, dtype, call): Engine.run(fn, name, kind, shape, dtype, None,
 * call) on the caller's thread. A claim refused, or a track other than the one it was made
 * with, goes to Engine.run (which queues); an error to the engine's _failed (which fails the
 * record and the World, and raises). */

enum {
    A_TRACK, A_FAILURE, A_STEP_BY_OPS, A_WAKE, A_RUN, A_FAILED, A_RUNNING, A_WORLD,
    A_RECORDER, A_IDS, A_SEQS, A_ACQUIRE, A_RELEASE, A_EXPRESS, A_FAST_REST, A_FAIL, N_NAMES
};
static const char *const NAME_TEXT[N_NAMES] = {
    "track", "failure", "step_by_ops", "wake", "run", "_failed", "_running", "world",
    "recorder", "_ids", "_seqs", "acquire", "release", "allreduce_express", "_fast_rest",
    "_fail"};
static PyObject *NAME[N_NAMES]; /* interned at the module's init */

/* flight_recorder.Record's fields (its _FIELDS, in that order). */
enum {
    F_RECORD_ID, F_TRACK, F_KIND, F_NAME, F_SHAPE, F_DTYPE, F_OUT_SHAPE, F_SEQ, F_PEER,
    F_CREATED_NS, F_STARTED_NS, F_ENDED_NS, F_STATE, F_ERROR, N_FIELDS
};
static const char *const FIELD_TEXT[N_FIELDS] = {
    "record_id", "track", "kind", "name", "shape", "dtype", "out_shape", "seq", "peer",
    "created_ns", "started_ns", "ended_ns", "state", "error"};

static PyObject *MINUS_ONE, *ZERO, *ONE, *NO_WAIT; /* made at the module's init (NO_WAIT:
                                                        (False,)) */

/* The pending exception, normalized, its traceback on it (what `except ... as exc` holds);
 * the error indicator is cleared. */
static PyObject *take_error(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* Raises `exc` again (stolen), or, if another error is pending (raised while handling it),
 * lets that one go on with `exc` as its context, as Python does. */
static void raise_again(PyObject *exc) {
    if (PyErr_Occurred()) {
        PyObject *later = take_error();
        PyException_SetContext(later, exc);
        PyErr_SetObject((PyObject *)Py_TYPE(later), later);
        Py_DECREF(later);
        return;
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
}

/* The offset of `name`, a writable object slot (__slots__) of `type`, or -1 with an error
 * set. Found once; a read or a write at it is then what the interpreter's own is. */
static Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
    PyObject *d = PyObject_GetAttrString((PyObject *)type, name);
    if (!d) return -1;
    PyMemberDef *m = Py_IS_TYPE(d, &PyMemberDescr_Type) ? ((PyMemberDescrObject *)d)->d_member
                                                         : NULL;
    Py_ssize_t offset = m && m->type == T_OBJECT_EX && !(m->flags & READONLY) ? m->offset : -1;
    Py_DECREF(d);
    if (offset < 0)
        PyErr_Format(PyExc_TypeError, "%s's %s is not a writable slot", type->tp_name, name);
    return offset;
}

/* The object in obj's slot at `offset` (borrowed), or NULL with AttributeError when unset. */
static inline PyObject *slot_get(PyObject *obj, Py_ssize_t offset) {
    PyObject *value = *(PyObject **)((char *)obj + offset);
    if (!value) PyErr_SetString(PyExc_AttributeError, "a slot read before it was set");
    return value;
}

/* obj's slot at `offset` = value. */
static inline void slot_set(PyObject *obj, Py_ssize_t offset, PyObject *value) {
    PyObject **slot = (PyObject **)((char *)obj + offset), *old = *slot;
    Py_INCREF(value);
    *slot = value;
    Py_XDECREF(old);
}

/* --- The prepared run, compiled: Prepared(segment, comm, description, signature, code,
 * divisor, on_idle), called with the data: a named prepared allreduce's run (pipeline/
 * operations.py's Prepared.run): the Comm's begin_signed(description, signature)
 * (transport/comm.py), then the segment's allreduce_express(data, code, divisor, deadline,
 * on_idle, signature) (transport/segment_small.py), whose C call it makes itself, without
 * parsing seven arguments. The Comm's and the segment's fields it reads and writes are
 * their __slots__; a group failed or closed, or a buffer the kernel would refuse, goes to
 * the Python allreduce_express (which raises what it raises), a wait past the budget or a
 * mismatch to _fast_rest, an error to the segment's _fail, as in the Python. */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *segment, *comm, *description, *signature, *on_idle, *code_obj, *divisor_obj;
    uint64_t signature64, calls; /* calls: runs that made the kernel's call here */
    int code;
    long long divisor;
    /* the offsets of the Comm's seq, description, signature, timeout, _deadline, _sent and
     * _received, and of the segment's _failed, _segment, _fast_group, moved and _seq */
    Py_ssize_t c_seq, c_description, c_signature, c_timeout, c_deadline, c_sent, c_received,
        s_failed, s_segment, s_group, s_moved, s_seq;
} prepared;

static PyTypeObject PreparedType;

/* `if obj.<slot>: obj.<slot>.clear()` for a dict (or anything with clear). */
static int clear_if_any(PyObject *obj, Py_ssize_t offset) {
    PyObject *held = slot_get(obj, offset);
    if (!held) return -1;
    if (PyDict_CheckExact(held)) {
        if (PyDict_GET_SIZE(held)) PyDict_Clear(held);
        return 0;
    }
    int any = PyObject_IsTrue(held);
    if (any <= 0) return any;
    PyObject *r = PyObject_CallMethod(held, "clear", NULL);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* obj.<slot> += by (an int); the new value into *now. */
static int slot_add(PyObject *obj, Py_ssize_t offset, long long by, long long *now) {
    PyObject *was = slot_get(obj, offset), *step, *more;
    if (!was || !(step = PyLong_FromLongLong(by))) return -1;
    more = PyNumber_Add(was, step);
    Py_DECREF(step);
    if (!more) return -1;
    long long value = now ? PyLong_AsLongLong(more) : 0;
    if (value == -1 && PyErr_Occurred()) {
        Py_DECREF(more);
        return -1;
    }
    slot_set(obj, offset, more);
    Py_DECREF(more);
    if (now) *now = value;
    return 0;
}

/* The segment's allreduce_express in Python, for what the C does not take. */
static PyObject *express_in_python(prepared *p, PyObject *data, PyObject *deadline) {
    PyObject *args[] = {p->segment, data, p->code_obj, p->divisor_obj, deadline, p->on_idle,
                        p->signature};
    return PyObject_VectorcallMethod(NAME[A_EXPRESS], args, 7, NULL);
}

/* The segment's allreduce_express(data, code, divisor, deadline, on_idle, signature). */
static PyObject *express(prepared *p, PyObject *data, PyObject *deadline) {
    PyObject *seg = p->segment, *failed, *mapped, *capsule;
    if (!(failed = slot_get(seg, p->s_failed)) || !(mapped = slot_get(seg, p->s_segment)) ||
        !(capsule = slot_get(seg, p->s_group)))
        return NULL;
    if (failed != Py_None || mapped == Py_None || !PyCapsule_IsValid(capsule, CAPSULE))
        return express_in_python(p, data, deadline);
    group *g = PyCapsule_GetPointer(capsule, CAPSULE);
    request q;
    if (PyObject_GetBuffer(data, &q.data, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear(); /* the Python entry raises what the kernel raises */
        return express_in_python(p, data, deadline);
    }
    if (q.data.len > g->slot_bytes || q.data.len % ITEMSIZE[p->code & 15]) {
        PyBuffer_Release(&q.data);
        return express_in_python(p, data, deadline);
    }
    long long seq;
    if (slot_add(seg, p->s_moved, 2 * (long long)q.data.len, NULL) < 0 ||
        slot_add(seg, p->s_seq, 1, &seq) < 0) {
        PyBuffer_Release(&q.data);
        return NULL;
    }
    Py_INCREF(capsule); /* the group lives through the wait, which lets the GIL go */
    q.g = g;
    q.seq = (uint64_t)seq;
    q.signature = p->signature64;
    q.code = p->code;
    q.divisor = p->divisor;
    q.trunc = 0;
    q.kind = KIND_ALLREDUCE;
    int status = run_request(&q); /* releases the buffer */
    Py_DECREF(capsule);
    p->calls++;
    if (status == DONE) Py_RETURN_NONE;
    /* _fast_rest(status, data, seq, signature, code, divisor, False, deadline, on_idle); an
     * error there fails the group (_fail), then goes on */
    PyObject *st = PyLong_FromLong(status), *sq = PyLong_FromLongLong(seq),
             *sig = PyLong_FromUnsignedLongLong(p->signature64), *r = NULL;
    if (st && sq && sig) {
        PyObject *args[] = {seg, st, data, sq, sig, p->code_obj, p->divisor_obj, Py_False,
                            deadline, p->on_idle};
        r = PyObject_VectorcallMethod(NAME[A_FAST_REST], args, 10, NULL);
    }
    Py_XDECREF(st);
    Py_XDECREF(sq);
    Py_XDECREF(sig);
    if (r) {
        Py_DECREF(r);
        Py_RETURN_NONE;
    }
    PyObject *exc = take_error();
    PyObject *arg[] = {seg, exc};
    PyObject *done = PyObject_VectorcallMethod(NAME[A_FAIL], arg, 2, NULL);
    Py_XDECREF(done);
    raise_again(exc);
    return NULL;
}

/* The run: the Comm's begin_signed(description, signature), then the express entry. */
static PyObject *prepared_run(prepared *p, PyObject *data) {
    PyObject *comm = p->comm, *timeout;
    if (slot_add(comm, p->c_seq, 1, NULL) < 0) return NULL;
    slot_set(comm, p->c_description, p->description);
    slot_set(comm, p->c_signature, p->signature);
    if (!(timeout = slot_get(comm, p->c_timeout))) return NULL;
    double seconds = PyFloat_AsDouble(timeout);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *deadline = PyFloat_FromDouble((double)now_ns() / 1e9 + seconds), *result = NULL;
    if (!deadline) return NULL;
    slot_set(comm, p->c_deadline, deadline);
    if (clear_if_any(comm, p->c_sent) == 0 && clear_if_any(comm, p->c_received) == 0)
        result = express(p, data, deadline);
    Py_DECREF(deadline);
    return result;
}

static PyObject *prepared_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "a prepared run takes one argument, the data");
        return NULL;
    }
    return prepared_run((prepared *)self, args[0]);
}

static int prepared_traverse(prepared *p, visitproc visit, void *arg) {
    Py_VISIT(p->segment);
    Py_VISIT(p->comm);
    Py_VISIT(p->on_idle);
    return 0;
}

static int prepared_clear(prepared *p) {
    Py_CLEAR(p->segment);
    Py_CLEAR(p->comm);
    Py_CLEAR(p->on_idle);
    Py_CLEAR(p->description);
    Py_CLEAR(p->signature);
    Py_CLEAR(p->code_obj);
    Py_CLEAR(p->divisor_obj);
    return 0;
}

static void prepared_dealloc(prepared *p) {
    PyObject_GC_UnTrack(p);
    prepared_clear(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyObject *prepared_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *segment, *comm, *description, *signature, *on_idle;
    int code;
    long long divisor;
    static char *keywords[] = {"segment", "comm", "description", "signature", "code",
                               "divisor", "on_idle", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOUO!iLO:Prepared", keywords, &segment,
                                     &comm, &description, &PyLong_Type, &signature, &code,
                                     &divisor, &on_idle))
        return NULL;
    int op = code >> 4, dtype = code & 15;
    if (op < OP_SUM || op > OP_PROD || dtype < T_F32 || dtype > T_I64 || divisor < 0) {
        PyErr_Format(PyExc_ValueError, "bad kernel code %d or divisor %lld", code, divisor);
        return NULL;
    }
    uint64_t signature64 = PyLong_AsUnsignedLongLongMask(signature);
    if (signature64 == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    prepared *p = (prepared *)type->tp_alloc(type, 0);
    if (!p) return NULL;
    p->vectorcall = prepared_vectorcall;
    p->segment = Py_NewRef(segment);
    p->comm = Py_NewRef(comm);
    p->description = Py_NewRef(description);
    p->signature = Py_NewRef(signature);
    p->on_idle = Py_NewRef(on_idle);
    p->signature64 = signature64;
    p->code = code;
    p->divisor = divisor;
    PyTypeObject *c = Py_TYPE(comm), *s = Py_TYPE(segment);
    if (!(p->code_obj = PyLong_FromLong(code)) ||
        !(p->divisor_obj = PyLong_FromLongLong(divisor)) ||
        (p->c_seq = slot_offset(c, "seq")) < 0 ||
        (p->c_description = slot_offset(c, "description")) < 0 ||
        (p->c_signature = slot_offset(c, "signature")) < 0 ||
        (p->c_timeout = slot_offset(c, "timeout")) < 0 ||
        (p->c_deadline = slot_offset(c, "_deadline")) < 0 ||
        (p->c_sent = slot_offset(c, "_sent")) < 0 ||
        (p->c_received = slot_offset(c, "_received")) < 0 ||
        (p->s_failed = slot_offset(s, "_failed")) < 0 ||
        (p->s_segment = slot_offset(s, "_segment")) < 0 ||
        (p->s_group = slot_offset(s, "_fast_group")) < 0 ||
        (p->s_moved = slot_offset(s, "moved")) < 0 || (p->s_seq = slot_offset(s, "_seq")) < 0) {
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static PyMemberDef prepared_members[] = {
    {"description", T_OBJECT, offsetof(prepared, description), READONLY,
     "What the Comm's begin records."},
    {"signature", T_OBJECT, offsetof(prepared, signature), READONLY,
     "The description's signature (0: checks off)."},
    {"calls", T_ULONGLONG, offsetof(prepared, calls), READONLY,
     "Runs that made the kernel's call in C (not handed to the Python entry)."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject PreparedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gradsync.collectives._shmfast.Prepared",
    .tp_doc = "Prepared(segment, comm, description, signature, code, divisor, on_idle): a "
              "named prepared allreduce's run, called with its data, in one C call.",
    .tp_basicsize = sizeof(prepared),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(prepared, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = prepared_new,
    .tp_traverse = (traverseproc)prepared_traverse,
    .tp_clear = (inquiry)prepared_clear,
    .tp_dealloc = (destructor)prepared_dealloc,
    .tp_members = prepared_members,
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *engine, *acquire, *release, *track, *recorder, *ids, *seqs, *world, *meter;
    PyObject *record_type, *scheduled, *started, *completed, *kind;
    Py_ssize_t field[N_FIELDS]; /* the offset of each of the record's slots */
    /* the offsets of the engine's track, _queue and _sleepers, the recorder's _slots, and
     * the meter's on, ops, next_mark, blocked_until and blocked_ns */
    Py_ssize_t e_track, e_queue, e_sleepers, r_slots, m_on, m_ops, m_next_mark, m_until,
        m_blocked;
} inline_run;

static inline PyObject *field_of(inline_run *x, PyObject *rec, int f) { /* borrowed, or NULL */
    return *(PyObject **)((char *)rec + x->field[f]);
}

static inline void put(inline_run *x, PyObject *rec, int f, PyObject *value) {
    slot_set(rec, x->field[f], value);
}

/* A record the ring's slot can take: no __init__ runs (issue sets every field). */
static inline PyObject *blank(inline_run *x) {
    PyTypeObject *type = (PyTypeObject *)x->record_type;
    return type->tp_alloc(type, 0);
}

/* Track.issue(kind, name, shape, dtype, None, None, True, True), made at `now`. */
static PyObject *issue(inline_run *x, PyObject *name, PyObject *shape, PyObject *dtype,
                       PyObject *now) {
    PyObject *slots = slot_get(x->recorder, x->r_slots); /* one read: (ring, size) */
    if (!slots) return NULL;
    if (!PyTuple_Check(slots) || PyTuple_GET_SIZE(slots) != 2 ||
        !PyList_Check(PyTuple_GET_ITEM(slots, 0))) {
        PyErr_SetString(PyExc_TypeError, "the recorder's slots are not (ring, size)");
        return NULL;
    }
    Py_INCREF(slots); /* held while its ring is used */
    PyObject *id = PyIter_Next(x->ids), *rec = NULL, *seq = NULL;
    if (!id) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "record numbers ran out");
        goto error;
    }
    PyObject *ring = PyTuple_GET_ITEM(slots, 0);
    Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(slots, 1));
    if (size == -1 && PyErr_Occurred()) goto error;
    if (size > 0) {
        long long n = PyLong_AsLongLong(id);
        if (n == -1 && PyErr_Occurred()) goto error;
        Py_ssize_t at = (Py_ssize_t)(n % size);
        if (at >= PyList_GET_SIZE(ring)) {
            PyErr_SetString(PyExc_IndexError, "the recorder's ring is shorter than its size");
            goto error;
        }
        rec = PyList_GET_ITEM(ring, at);
        PyObject *state = Py_IS_TYPE(rec, (PyTypeObject *)x->record_type)
                              ? field_of(x, rec, F_STATE) : x->started;
        if (state == x->scheduled || state == x->started) {
            /* in flight a whole ring later (or not a Record): its holder keeps it, a new
             * one goes here */
            if (!(rec = blank(x))) goto error;
            Py_INCREF(rec);
            PyList_SetItem(ring, at, rec); /* takes one reference */
        } else {
            Py_INCREF(rec);
        }
    } else if (!(rec = blank(x))) {
        goto error;
    }
    if (!(seq = PyIter_Next(x->seqs))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "sequence numbers ran out");
        goto error;
    }
    put(x, rec, F_RECORD_ID, MINUS_ONE); /* readers leave it alone until it is whole again */
    put(x, rec, F_TRACK, x->track);
    put(x, rec, F_KIND, x->kind);
    put(x, rec, F_NAME, name);
    put(x, rec, F_SHAPE, shape);
    put(x, rec, F_DTYPE, dtype);
    put(x, rec, F_OUT_SHAPE, Py_None);
    put(x, rec, F_PEER, Py_None);
    put(x, rec, F_SEQ, seq);
    put(x, rec, F_CREATED_NS, now);
    put(x, rec, F_ENDED_NS, ZERO);
    put(x, rec, F_ERROR, Py_None);
    put(x, rec, F_STARTED_NS, now);
    put(x, rec, F_STATE, x->started);
    put(x, rec, F_RECORD_ID, id);
    Py_DECREF(id);
    Py_DECREF(slots);
    Py_DECREF(seq);
    return rec;
error:
    Py_XDECREF(id);
    Py_DECREF(slots);
    Py_XDECREF(rec);
    return NULL;
}

/* Record.done(): the end, and the pace meter's count of operations. */
static int record_done(inline_run *x, PyObject *rec, PyObject *ended) {
    put(x, rec, F_ENDED_NS, ended);
    put(x, rec, F_STATE, x->completed);
    PyObject *on = slot_get(x->meter, x->m_on), *ops, *mark, *more;
    if (!on) return -1;
    int counting = PyObject_IsTrue(on);
    if (counting <= 0) return counting;
    if (!(ops = slot_get(x->meter, x->m_ops)) || !(more = PyNumber_Add(ops, ONE))) return -1;
    slot_set(x->meter, x->m_ops, more);
    mark = slot_get(x->meter, x->m_next_mark);
    int step = mark ? PyObject_RichCompareBool(more, mark, Py_EQ) : -1;
    Py_DECREF(more);
    if (step > 0) {
        PyObject *r = PyObject_CallMethodNoArgs(x->meter, NAME[A_STEP_BY_OPS]);
        if (!r) return -1;
        Py_DECREF(r);
    }
    return step < 0 ? -1 : 0;
}

/* Engine.run's finally: the release, a wake-up for whoever waits, the meter's blocked time
 * from `began` to `end` (the record's end; `end_obj` its int where made, else NULL). An error
 * pending stays pending, unless one of these raises (then that one goes on, the first as its
 * context). */
static void finish_claim(inline_run *x, int64_t began, int64_t end, PyObject *end_obj) {
    PyObject *pending = PyErr_Occurred() ? take_error() : NULL, *r, *sleepers, *was;
    if (!(r = PyObject_CallNoArgs(x->release))) goto out;
    Py_DECREF(r);
    if (!(sleepers = slot_get(x->engine, x->e_sleepers))) goto out;
    int wake = PyObject_IsTrue(sleepers);
    if (wake < 0) goto out;
    if (wake) {
        if (!(r = PyObject_CallMethodNoArgs(x->engine, NAME[A_WAKE]))) goto out;
        Py_DECREF(r);
    }
    if (!(was = slot_get(x->meter, x->m_until))) goto out;
    int over = 0; /* (a clock's nanoseconds: several digits, which AsLongLong converts slowly) */
    long long until = PyLong_AsLongLongAndOverflow(was, &over);
    if (until == -1 && PyErr_Occurred()) goto out;
    if (over) {
        PyErr_SetString(PyExc_OverflowError, "the meter's blocked_until is out of range");
        goto out;
    }
    if (end > until) {
        PyObject *blocked = slot_get(x->meter, x->m_blocked), *more = NULL,
                 *by = PyLong_FromLongLong(end - (began > until ? began : until)),
                 *e = end_obj ? Py_NewRef(end_obj) : PyLong_FromLongLong(end);
        if (blocked && by && e && (more = PyNumber_Add(blocked, by))) {
            slot_set(x->meter, x->m_blocked, more);
            slot_set(x->meter, x->m_until, e);
        }
        Py_XDECREF(more);
        Py_XDECREF(by);
        Py_XDECREF(e);
    }
out:
    if (pending) raise_again(pending);
}

/* Engine.run(fn, name, kind, shape, dtype, None, call): the Python, which queues. */
static PyObject *run_in_python(inline_run *x, PyObject *const *args) {
    PyObject *call[] = {x->engine, args[0], args[1], x->kind, args[2], args[3], Py_None,
                        args[4]};
    return PyObject_VectorcallMethod(NAME[A_RUN], call, 8, NULL);
}

/* inline(fn, name, shape, dtype, call), args those five: Engine.run(fn, name, kind, shape,
 * dtype, None, call) on the caller's thread (the header above). */
static PyObject *inline_run_args(inline_run *x, PyObject *const *args) {
    /* The claim (Serial.claim): the engine's track as made, nothing queued, the running lock
     * taken without blocking; else the Python, which queues behind what runs. */
    PyObject *queue = slot_get(x->engine, x->e_queue);
    if (!queue) return NULL;
    Py_ssize_t queued = *(PyObject **)((char *)x->engine + x->e_track) == x->track
                            ? PyObject_Length(queue) : 1;
    if (queued < 0) return NULL;
    if (queued) return run_in_python(x, args);
    /* acquire(False), its arguments a tuple made once: the lock's method takes a tuple */
    PyObject *got = PyObject_Call(x->acquire, NO_WAIT, NULL);
    if (!got) return NULL;
    int claimed = got == Py_True;
    Py_DECREF(got);
    if (!claimed) return run_in_python(x, args);

    int64_t began = now_ns(), end;
    PyObject *result = NULL, *rec = NULL, *at = PyLong_FromLongLong(began);
    if (at) {
        rec = issue(x, args[1], args[2], args[3], at);
        Py_DECREF(at);
    }
    if (rec) {
        PyObject *failure = PyObject_GetAttr(x->world, NAME[A_FAILURE]);
        if (failure && failure != Py_None)
            PyErr_SetObject((PyObject *)Py_TYPE(failure), failure); /* raise world.failure */
        else if (failure)
            result = Py_IS_TYPE(args[0], &PreparedType)
                         ? prepared_run((prepared *)args[0], args[4])
                         : PyObject_CallOneArg(args[0], args[4]);
        Py_XDECREF(failure);
    }
    PyObject *ended = NULL; /* (the end's int, for the meter too) */
    if (result) {
        end = now_ns();
        ended = PyLong_FromLongLong(end);
        if (!ended || record_done(x, rec, ended) < 0) Py_CLEAR(result);
    } else {
        /* engine._failed(record, exc): fails the record (and the World), raises */
        PyObject *exc = take_error();
        PyObject *arg[] = {x->engine, rec ? rec : Py_None, exc};
        PyObject *r = PyObject_VectorcallMethod(NAME[A_FAILED], arg, 3, NULL);
        if (r) { /* it always raises; if not, the error goes on as it was */
            Py_DECREF(r);
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        }
        Py_DECREF(exc);
        end = now_ns(); /* the record's end, as Record.fail read it, or now without one */
        PyObject *failed_at = rec ? field_of(x, rec, F_ENDED_NS) : NULL;
        int over = 0;
        long long e = failed_at && PyLong_Check(failed_at)
                          ? PyLong_AsLongLongAndOverflow(failed_at, &over) : -1;
        if (e > 0 && !over) end = e; /* (raises nothing: the error _failed raised stays) */
    }
    finish_claim(x, began, end, ended);
    Py_XDECREF(ended);
    Py_XDECREF(rec);
    if (result && PyErr_Occurred()) Py_CLEAR(result); /* the finally raised */
    return result;
}

static PyObject *inline_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                   PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 5 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "inline takes (fn, name, shape, dtype, call)");
        return NULL;
    }
    return inline_run_args((inline_run *)self, args);
}

static int inline_traverse(inline_run *x, visitproc visit, void *arg) {
    Py_VISIT(x->engine);
    Py_VISIT(x->acquire);
    Py_VISIT(x->release);
    Py_VISIT(x->track);
    Py_VISIT(x->recorder);
    Py_VISIT(x->ids);
    Py_VISIT(x->seqs);
    Py_VISIT(x->world);
    Py_VISIT(x->meter);
    Py_VISIT(x->record_type);
    return 0;
}

static int inline_clear(inline_run *x) {
    Py_CLEAR(x->engine);
    Py_CLEAR(x->acquire);
    Py_CLEAR(x->release);
    Py_CLEAR(x->track);
    Py_CLEAR(x->recorder);
    Py_CLEAR(x->ids);
    Py_CLEAR(x->seqs);
    Py_CLEAR(x->world);
    Py_CLEAR(x->meter);
    Py_CLEAR(x->record_type);
    Py_CLEAR(x->scheduled);
    Py_CLEAR(x->started);
    Py_CLEAR(x->completed);
    Py_CLEAR(x->kind);
    return 0;
}

static void inline_dealloc(inline_run *x) {
    PyObject_GC_UnTrack(x);
    inline_clear(x);
    Py_TYPE(x)->tp_free((PyObject *)x);
}

/* Inline(engine, meter, record, states, kind): reads what it keeps off the engine (its
 * queue, its running lock's acquire and release, its track, its World) and the track (the
 * recorder's record numbers, the track's sequence numbers), and each field's slot offset
 * off the record class. */
static PyObject *inline_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *engine, *meter, *record_type, *kind, *scheduled, *started, *completed;
    PyObject *running = NULL;
    static char *keywords[] = {"engine", "meter", "record", "states", "kind", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!(UUU)U:Inline", keywords, &engine,
                                     &meter, &PyType_Type, &record_type, &scheduled, &started,
                                     &completed, &kind))
        return NULL;
    inline_run *x = (inline_run *)type->tp_alloc(type, 0);
    if (!x) return NULL;
    x->vectorcall = inline_vectorcall;
    x->engine = Py_NewRef(engine);
    x->meter = Py_NewRef(meter);
    x->record_type = Py_NewRef(record_type);
    x->scheduled = Py_NewRef(scheduled);
    x->started = Py_NewRef(started);
    x->completed = Py_NewRef(completed);
    x->kind = Py_NewRef(kind);
    if (!(running = PyObject_GetAttr(engine, NAME[A_RUNNING])) ||
        !(x->acquire = PyObject_GetAttr(running, NAME[A_ACQUIRE])) ||
        !(x->release = PyObject_GetAttr(running, NAME[A_RELEASE])) ||
        !(x->track = PyObject_GetAttr(engine, NAME[A_TRACK])) ||
        !(x->world = PyObject_GetAttr(engine, NAME[A_WORLD])))
        goto error;
    Py_CLEAR(running);
    if (x->track == Py_None) {
        PyErr_SetString(PyExc_ValueError, "Inline records on the engine's track: it has none");
        goto error;
    }
    if (!(x->recorder = PyObject_GetAttr(x->track, NAME[A_RECORDER])) ||
        !(x->ids = PyObject_GetAttr(x->recorder, NAME[A_IDS])) ||
        !(x->seqs = PyObject_GetAttr(x->track, NAME[A_SEQS])))
        goto error;
    if (!PyIter_Check(x->ids) || !PyIter_Check(x->seqs)) {
        PyErr_SetString(PyExc_TypeError, "the record and sequence numbers are not iterators");
        goto error;
    }
    PyTypeObject *e = Py_TYPE(engine), *r = Py_TYPE(x->recorder), *m = Py_TYPE(meter);
    if ((x->e_track = slot_offset(e, "track")) < 0 ||
        (x->e_queue = slot_offset(e, "_queue")) < 0 ||
        (x->e_sleepers = slot_offset(e, "_sleepers")) < 0 ||
        (x->r_slots = slot_offset(r, "_slots")) < 0 || (x->m_on = slot_offset(m, "on")) < 0 ||
        (x->m_ops = slot_offset(m, "ops")) < 0 ||
        (x->m_next_mark = slot_offset(m, "next_mark")) < 0 ||
        (x->m_until = slot_offset(m, "blocked_until")) < 0 ||
        (x->m_blocked = slot_offset(m, "blocked_ns")) < 0)
        goto error;
    for (int f = 0; f < N_FIELDS; f++)
        if ((x->field[f] = slot_offset((PyTypeObject *)record_type, FIELD_TEXT[f])) < 0)
            goto error;
    return (PyObject *)x;
error:
    Py_XDECREF(running);
    Py_DECREF(x);
    return NULL;
}

static PyTypeObject InlineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gradsync.collectives._shmfast.Inline",
    .tp_doc = "Inline(engine, meter, record, states, kind): the engine's inline run of an "
              "operation, called as (fn, name, shape, dtype, call), in one C call.",
    .tp_basicsize = sizeof(inline_run),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(inline_run, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = inline_new,
    .tp_traverse = (traverseproc)inline_traverse,
    .tp_clear = (inquiry)inline_clear,
    .tp_dealloc = (destructor)inline_dealloc,
};

/* --- The front, compiled: Quick(job, ndarray, ReduceOp, python), called as api._quick is,
 * (tensor, op, name, algorithm, inplace): the pipeline's fast case from the public call
 * (api.py's _quick) for the call it is made for, a named synchronous allreduce of a NumPy
 * array: the job, its World on one host, the array's checks (C-contiguous, writable in
 * place: one buffer request), the prepared call looked up under _quick's own key, a copy
 * for an allreduce out of place, then the engine's compiled inline run with the prepared
 * run. Anything else (no job, another tensor, an unnamed call, a call not prepared yet, one
 * that cannot be, an array the buffer request refuses) is `python(...)`'s, api._quick
 * itself, which prepares what the next call finds here. The fields it reads are __slots__
 * (job.Job's world and engine, the Engine's prepared and inline, operations.Prepared's run),
 * their offsets found at the first call of each class.
 *
 * The memo, by name. A training loop repeats its calls, and the key's look-up was a seventh
 * of the call (the shape's tuple built, the five-tuple hashed and compared: about 1,300 of
 * 8,700 instructions, valgrind). So Quick remembers, for each name, the last call of that
 * name it found prepared: (the engine's memory, the World, dtype, op value, algorithm,
 * shape, Prepared), each the object the call had. A call whose name's entry has its memory
 * (the dict itself), World, dtype, op value and algorithm, and a shape of the same numbers,
 * takes the entry's Prepared and shape tuple, one look-up by a string (its hash kept), and
 * skips the World's shares_host (true when the entry was made; a World's host sharing is
 * fixed). What it finds is what the dict held for the key: a key's entry never changes
 * there (operations.prepare_into only adds), and a dict emptied at operations.PREPARED_KEPT
 * (a bound on its memory) would prepare the key again on the same World the same way;
 * another job, World or engine is another dict. The memo is emptied at as many names, at the
 * first call on another memory (a new job: the old World is not held past it), and by
 * forget() (api.shutdown). */

#define MEMO_KEPT 4096 /* names the memo holds before it starts again empty */

enum { M_KEPT, M_WORLD, M_DTYPE, M_VALUE, M_ALGORITHM, M_SHAPE, M_PREPARED, M_FIELDS };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *job_dict, *ndarray, *reduce_op, *python, *last_op, *last_value;
    PyObject *memo; /* {name: (kept, world, dtype, value, algorithm, shape, prepared)} */
    uintptr_t memo_of; /* the memory its entries are of (its address: the entries hold it) */
    PyTypeObject *job_type, *engine_type, *prepared_type; /* the classes the offsets are of */
    Py_ssize_t j_world, j_engine, e_prepared, e_inline, p_run;
} quick;

/* Whether `entry` (the name's memo entry, or NULL) remembers this call: its World and memory
 * (`view` NULL), or everything, the array's view too. */
static int memo_holds(quick *q, PyObject *entry, PyObject *kept, PyObject *world,
                      PyObject *dtype, PyObject *algorithm, const Py_buffer *view) {
    if (!entry || PyTuple_GET_ITEM(entry, M_KEPT) != kept ||
        PyTuple_GET_ITEM(entry, M_WORLD) != world)
        return 0;
    if (!view) return 1;
    PyObject *shape = PyTuple_GET_ITEM(entry, M_SHAPE);
    if (PyTuple_GET_ITEM(entry, M_DTYPE) != dtype ||
        PyTuple_GET_ITEM(entry, M_VALUE) != q->last_value ||
        PyTuple_GET_ITEM(entry, M_ALGORITHM) != algorithm ||
        PyTuple_GET_SIZE(shape) != view->ndim)
        return 0;
    for (int i = 0; i < view->ndim; i++)
        if (PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i)) != view->shape[i])
            return 0; /* (the view's numbers: never -1 with an error) */
    return 1;
}

/* Remembers a call found prepared under `name`; 0, or -1 with an error set. */
static int memo_set(quick *q, PyObject *name, PyObject *kept, PyObject *world,
                    PyObject *dtype, PyObject *algorithm, PyObject *shape,
                    PyObject *prepared) {
    if (PyDict_GET_SIZE(q->memo) >= MEMO_KEPT) PyDict_Clear(q->memo);
    PyObject *entry = PyTuple_Pack(M_FIELDS, kept, world, dtype, q->last_value, algorithm,
                                   shape, prepared);
    if (!entry) return -1;
    int r = PyDict_SetItem(q->memo, name, entry);
    Py_DECREF(entry);
    return r;
}

static PyObject *S_JOB, *S_SHARES_HOST, *S_DTYPE, *S_VALUE, *S_COPY; /* interned at init */

/* The offsets of `names` in `type` into `offsets`, unless they are of `type` already; 0, or
 * -1 (no error set) where one is not a slot of it: a stand-in, which `python` takes. */
static int offsets_of(PyTypeObject **cached, PyTypeObject *type, const char *const *names,
                      Py_ssize_t *const *offsets, int n) {
    if (*cached == type) return 0;
    for (int i = 0; i < n; i++)
        if ((*offsets[i] = slot_offset(type, names[i])) < 0) {
            PyErr_Clear();
            return -1;
        }
    *cached = type; /* (held by the objects that have it, which outlive this call) */
    return 0;
}

static PyObject *quick_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames) {
    quick *q = (quick *)self;
    if (PyVectorcall_NARGS(nargsf) != 5 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "quick takes (tensor, op, name, algorithm, inplace)");
        return NULL;
    }
    PyObject *tensor = args[0], *op = args[1], *name = args[2], *algorithm = args[3];
    int inplace = args[4] == Py_True;
    PyObject *job = PyDict_GetItemWithError(q->job_dict, S_JOB); /* job._job, borrowed */
    if (!job) {
        if (PyErr_Occurred()) return NULL;
        goto python;
    }
    if (job == Py_None || !Py_IS_TYPE(tensor, (PyTypeObject *)q->ndarray) || name == Py_None ||
        !PyUnicode_CheckExact(name) || !Py_IS_TYPE(op, (PyTypeObject *)q->reduce_op) ||
        (!inplace && args[4] != Py_False))
        goto python;
    static const char *const job_fields[] = {"world", "engine"};
    Py_ssize_t *const job_offsets[] = {&q->j_world, &q->j_engine};
    if (offsets_of(&q->job_type, Py_TYPE(job), job_fields, job_offsets, 2) < 0) goto python;
    PyObject *world = slot_get(job, q->j_world), *engine, *kept, *inline_fn, *shares;
    if (!world || !(engine = slot_get(job, q->j_engine))) return NULL;
    static const char *const engine_fields[] = {"prepared", "inline"};
    Py_ssize_t *const engine_offsets[] = {&q->e_prepared, &q->e_inline};
    if (offsets_of(&q->engine_type, Py_TYPE(engine), engine_fields, engine_offsets, 2) < 0)
        goto python;
    if (!(kept = slot_get(engine, q->e_prepared)) || !(inline_fn = slot_get(engine, q->e_inline)))
        return NULL;
    if (!PyDict_CheckExact(kept) || !Py_IS_TYPE(inline_fn, &InlineType)) goto python;
    if ((uintptr_t)kept != q->memo_of) { /* another job's memory: the old one's entries go */
        PyDict_Clear(q->memo);
        q->memo_of = (uintptr_t)kept;
    }
    PyObject *entry = PyDict_GetItemWithError(q->memo, name); /* borrowed (a tuple) */
    if (!entry && PyErr_Occurred()) return NULL;
    if (!memo_holds(q, entry, kept, world, NULL, NULL, NULL)) {
        entry = NULL; /* (a World on one host when its entry was made) */
        if (!(shares = PyObject_GetAttr(world, S_SHARES_HOST))) return NULL;
        int on_one_host = PyObject_IsTrue(shares);
        Py_DECREF(shares);
        if (on_one_host < 0) return NULL;
        if (!on_one_host) goto python;
    }
    /* Held from here: what follows allocates (a collection may run finalizers) and calls out. */
    Py_INCREF(kept);
    Py_INCREF(inline_fn);
    Py_XINCREF(entry);
    PyObject *shape = NULL, *dtype = NULL, *key = NULL, *flat = NULL, *result = NULL,
             *prepared = NULL, *run = NULL;
    /* What _quick checks of the array (C-contiguous, writable in place), and its shape. */
    Py_buffer view;
    if (PyObject_GetBuffer(tensor, &view, PyBUF_C_CONTIGUOUS | (inplace ? PyBUF_WRITABLE : 0))
        < 0) {
        PyErr_Clear();
        goto in_python;
    }
    if (op != q->last_op) { /* op._value_: ReduceOp's members are few, and live for good */
        PyObject *value = PyObject_GetAttr(op, S_VALUE);
        if (!value) {
            PyBuffer_Release(&view);
            goto done;
        }
        Py_XSETREF(q->last_value, value);
        Py_XSETREF(q->last_op, Py_NewRef(op));
    }
    if (!(dtype = PyObject_GetAttr(tensor, S_DTYPE))) {
        PyBuffer_Release(&view);
        goto done;
    }
    if (memo_holds(q, entry, kept, world, dtype, algorithm, &view)) {
        PyBuffer_Release(&view);
        shape = Py_NewRef(PyTuple_GET_ITEM(entry, M_SHAPE));
        prepared = Py_NewRef(PyTuple_GET_ITEM(entry, M_PREPARED));
    } else {
        shape = PyTuple_New(view.ndim);
        for (int i = 0; shape && i < view.ndim; i++) {
            PyObject *n = PyLong_FromSsize_t(view.shape[i]);
            if (!n) Py_CLEAR(shape);
            else PyTuple_SET_ITEM(shape, i, n);
        }
        PyBuffer_Release(&view);
        if (!shape || !(key = PyTuple_Pack(5, name, dtype, shape, q->last_value, algorithm)))
            goto done;
        prepared = PyDict_GetItemWithError(kept, key); /* borrowed, then held */
        if (!prepared || prepared == Py_None) {
            prepared = NULL;
            if (PyErr_Occurred()) goto done;
            goto in_python; /* not prepared yet (_quick prepares it), or not preparable */
        }
        Py_INCREF(prepared);
        if (memo_set(q, name, kept, world, dtype, algorithm, shape, prepared) < 0) goto done;
    }
    static const char *const prepared_fields[] = {"run"};
    Py_ssize_t *const prepared_offsets[] = {&q->p_run};
    if (offsets_of(&q->prepared_type, Py_TYPE(prepared), prepared_fields, prepared_offsets, 1)
        < 0)
        goto in_python;
    if (!(run = slot_get(prepared, q->p_run))) goto done;
    if (run == Py_None) { /* (an unnamed call's: not one this takes) */
        run = NULL;
        goto in_python;
    }
    Py_INCREF(run);
    flat = inplace ? Py_NewRef(tensor) : PyObject_CallMethodNoArgs(tensor, S_COPY);
    if (!flat) goto done;
    PyObject *call[] = {run, name, shape, dtype, flat};
    PyObject *r = inline_run_args((inline_run *)inline_fn, call);
    if (r) {
        Py_DECREF(r);
        result = Py_NewRef(flat);
    }
    goto done;
in_python:
    result = PyObject_Vectorcall(q->python, args, 5, NULL);
done:
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(key);
    Py_XDECREF(flat);
    Py_XDECREF(run);
    Py_XDECREF(prepared);
    Py_XDECREF(entry);
    Py_DECREF(inline_fn);
    Py_DECREF(kept);
    return result;
python:
    return PyObject_Vectorcall(q->python, args, 5, NULL);
}

static int quick_traverse(quick *q, visitproc visit, void *arg) {
    Py_VISIT(q->job_dict);
    Py_VISIT(q->ndarray);
    Py_VISIT(q->reduce_op);
    Py_VISIT(q->python);
    Py_VISIT(q->last_op);
    Py_VISIT(q->last_value);
    Py_VISIT(q->memo);
    return 0;
}

static int quick_clear(quick *q) {
    Py_CLEAR(q->job_dict);
    Py_CLEAR(q->ndarray);
    Py_CLEAR(q->reduce_op);
    Py_CLEAR(q->python);
    Py_CLEAR(q->last_op);
    Py_CLEAR(q->last_value);
    Py_CLEAR(q->memo);
    return 0;
}

static void quick_dealloc(quick *q) {
    PyObject_GC_UnTrack(q);
    quick_clear(q);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static PyObject *quick_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *job, *ndarray, *reduce_op, *python;
    static char *keywords[] = {"job", "ndarray", "reduce_op", "python", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!O:Quick", keywords, &PyModule_Type,
                                     &job, &PyType_Type, &ndarray, &PyType_Type, &reduce_op,
                                     &python))
        return NULL;
    if (!PyCallable_Check(python)) {
        PyErr_SetString(PyExc_TypeError, "Quick's python must be callable");
        return NULL;
    }
    quick *q = (quick *)type->tp_alloc(type, 0);
    if (!q) return NULL;
    if (!(q->memo = PyDict_New())) {
        Py_DECREF(q);
        return NULL;
    }
    q->vectorcall = quick_vectorcall;
    q->job_dict = Py_NewRef(PyModule_GetDict(job));
    q->ndarray = Py_NewRef(ndarray);
    q->reduce_op = Py_NewRef(reduce_op);
    q->python = Py_NewRef(python);
    return (PyObject *)q;
}

static PyObject *quick_forget(quick *q, PyObject *unused) {
    PyDict_Clear(q->memo);
    q->memo_of = 0;
    Py_RETURN_NONE;
}

static PyMethodDef quick_methods[] = {
    {"forget", (PyCFunction)quick_forget, METH_NOARGS,
     "Empties the memo (what it holds of the job's World and prepared calls)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject QuickType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gradsync.collectives._shmfast.Quick",
    .tp_doc = "Quick(job, ndarray, reduce_op, python): api._quick for a named synchronous "
              "allreduce of a NumPy array, in one C call; python(...) for anything else.",
    .tp_basicsize = sizeof(quick),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(quick, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = quick_new,
    .tp_methods = quick_methods,
    .tp_traverse = (traverseproc)quick_traverse,
    .tp_clear = (inquiry)quick_clear,
    .tp_dealloc = (destructor)quick_dealloc,
};


/* --- The beater: heartbeats that need no GIL ---------------------------------------------
 *
 * A heartbeat link (heartbeat.py) carries a BEAT byte every heartbeat interval, and a data
 * server counts up the beat word of each worker's slot table (data/server.py, slots.py): the
 * evidence that the process runs. Sent by a Python thread, a beat waits for the GIL, so one C
 * call that holds the GIL silences the process for as long as it runs: `import torch` holds
 * it up to 0.4 s on an idle machine and over a second on a loaded one, `sum(range(10**9))`
 * as long as it runs, and a watcher that hears nothing for the timeout takes a live process
 * for a stopped one. The beater is a thread of its own that never takes the GIL: every
 * interval it writes one byte on each registered socket and adds one to each registered
 * word. A stopped process (SIGSTOP, a debugger) stops it with every other thread, so a stop
 * is still found; a process that dies takes it along.
 *
 * Targets. A socket is registered as a descriptor of the beater's own (a dup, close-on-exec),
 * written with MSG_DONTWAIT (a full buffer drops the beat: its reader is stopped, and its
 * timeout says so) and MSG_NOSIGNAL (a broken link raises no SIGPIPE; its reader reports it).
 * A word is an aligned int64 of a buffer (a slot table's mapped memory), added to atomically;
 * the buffer is held (a buffer export) while it is registered, so it is never unmapped under
 * the thread.
 *
 * Lifetime. The thread beats under the beater's mutex, and remove() takes that mutex: once
 * remove() returns, the thread is not inside a write to that target and never writes it
 * again, so Python may send its BYE and close the socket. The dup keeps even a close made
 * before remove() harmless: the number the thread writes is its own, never one that the
 * process reuses for another socket or file (that would put beats into someone else's
 * stream). remove() takes an id that names one registration, never reused, so removing
 * twice is harmless. close() stops and joins the thread and removes every target.
 *
 * Fork. A child of fork() has no beater thread (only the forking thread is copied), and its
 * copy of the mutex may be held by the thread that is not there: in a child, remove() and
 * close() release the targets without the mutex and without a join, and add() refuses.
 *
 * Python holds the beater as a capsule (gradsync/liveness/beater.py), which closes it when freed.
 */

typedef struct {
    uint64_t id;        /* 0: a free entry */
    int fd;             /* the beater's dup of a socket, or -1 for a word */
    unsigned char byte; /* what goes on the socket */
    int64_t *word;      /* the word counted up, in view */
    Py_buffer view;
} beat_target;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake; /* close() -> the thread */
    pthread_t thread;
    pid_t pid;           /* the process that started the thread */
    int running, stopping;
    int64_t interval_ns;
    uint64_t next_id, rounds;
    beat_target *targets; /* `capacity` entries (malloc), grown by add */
    int capacity;
} beater;

static const char BEATER[] = "gradsync._shmfast.beater";

static void beat_once(beat_target *t) {
    if (t->fd >= 0)
        (void)send(t->fd, &t->byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    else
        __atomic_add_fetch(t->word, 1, __ATOMIC_RELEASE);
}

static void *beat_loop(void *arg) {
    beater *b = arg;
    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    pthread_mutex_lock(&b->lock);
    while (!b->stopping) {
        for (int i = 0; i < b->capacity; i++)
            if (b->targets[i].id) beat_once(&b->targets[i]);
        b->rounds++;
        int64_t at = (int64_t)next.tv_sec * 1000000000 + next.tv_nsec + b->interval_ns;
        int64_t now = now_ns();
        if (at <= now) at = now + b->interval_ns; /* it ran late (starved): no burst */
        next.tv_sec = at / 1000000000;
        next.tv_nsec = at % 1000000000;
        while (!b->stopping && pthread_cond_timedwait(&b->wake, &b->lock, &next) != ETIMEDOUT)
            ;
    }
    pthread_mutex_unlock(&b->lock);
    return NULL;
}

/* Releases a target taken out of the table (the GIL held, for the buffer). */
static void release_target(beat_target *t) {
    if (t->fd >= 0) close(t->fd);
    else PyBuffer_Release(&t->view);
}

static int in_owner(const beater *b) { return getpid() == b->pid; }

/* Stops the thread (in the process that started it) and releases every target. The targets
 * are released after the mutex is let go: a buffer's release may free Python objects, whose
 * finalizers may call back into the beater. */
static void stop_beater(beater *b) {
    int owner = in_owner(b);
    if (owner) pthread_mutex_lock(&b->lock);
    int join = owner && b->running;
    b->stopping = 1;
    b->running = 0;
    beat_target *gone = b->targets;
    int n = b->capacity;
    b->targets = NULL;
    b->capacity = 0;
    if (owner) {
        pthread_cond_signal(&b->wake);
        pthread_mutex_unlock(&b->lock);
    }
    if (join) {
        /* The thread never takes the GIL: holding it here cannot deadlock, and the thread
         * ends within one round of writes. */
        pthread_join(b->thread, NULL);
    }
    for (int i = 0; i < n; i++)
        if (gone[i].id) release_target(&gone[i]);
    free(gone);
}

static void free_beater(PyObject *capsule) {
    beater *b = PyCapsule_GetPointer(capsule, BEATER);
    stop_beater(b);
    if (in_owner(b)) {
        pthread_cond_destroy(&b->wake);
        pthread_mutex_destroy(&b->lock);
    }
    PyMem_Free(b);
}

/* beater_open(interval) -> capsule: a running beater with no targets. */
static PyObject *py_beater_open(PyObject *self, PyObject *args) {
    double interval;
    if (!PyArg_ParseTuple(args, "d", &interval)) return NULL;
    if (!(interval > 0)) {
        PyErr_SetString(PyExc_ValueError, "the beat interval must be positive");
        return NULL;
    }
    beater *b = PyMem_Calloc(1, sizeof(beater));
    if (!b) return PyErr_NoMemory();
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); /* timedwait's deadline: now_ns()'s */
    pthread_cond_init(&b->wake, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&b->lock, NULL);
    b->pid = getpid();
    b->interval_ns = (int64_t)(interval * 1e9);
    b->next_id = 1;
    /* Every signal blocked in the thread (it inherits the mask): a signal is the business
     * of the threads that run Python, and must not interrupt a beat. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = pthread_create(&b->thread, NULL, beat_loop, b);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        pthread_cond_destroy(&b->wake);
        pthread_mutex_destroy(&b->lock);
        PyMem_Free(b);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* Named before this returns, so that top -H, py-spy and /proc/PID/task/TID/comm tell it
     * from the others at once (a name the thread gave itself would come when it first ran). */
    (void)pthread_setname_np(b->thread, "gs-beater");
    b->running = 1;
    PyObject *capsule = PyCapsule_New(b, BEATER, free_beater);
    if (!capsule) {
        stop_beater(b);
        PyMem_Free(b);
    }
    return capsule;
}

/* Puts `t` in a free entry (the table doubles when full) and beats it once at once; returns
 * its id, or 0 with an error set. */
static uint64_t add_target(beater *b, beat_target *t) {
    uint64_t id = 0;
    int owner = in_owner(b), closed = 0, slot = -1;
    if (owner) pthread_mutex_lock(&b->lock);
    if (!b->running || !owner) { /* a child of fork() has no thread to beat it */
        closed = 1;
    } else {
        for (int i = 0; i < b->capacity && slot < 0; i++)
            if (!b->targets[i].id) slot = i;
        if (slot < 0) {
            int grown = b->capacity ? 2 * b->capacity : 4;
            beat_target *more = realloc(b->targets, (size_t)grown * sizeof(beat_target));
            if (more) {
                memset(more + b->capacity, 0, (size_t)(grown - b->capacity) * sizeof(beat_target));
                slot = b->capacity;
                b->targets = more;
                b->capacity = grown;
            }
        }
        if (slot >= 0) {
            t->id = id = b->next_id++;
            b->targets[slot] = *t;
            beat_once(t); /* the other end's clock starts now: no wait for the round */
        }
    }
    if (owner) pthread_mutex_unlock(&b->lock);
    if (closed)
        PyErr_SetString(PyExc_ValueError, owner ? "the beater is closed"
                                                : "the beater's thread is in the parent process");
    else if (!id)
        PyErr_NoMemory();
    return id;
}

/* beater_add_socket(beater, fd, byte) -> id: `byte` on (a dup of) socket fd each interval. */
static PyObject *py_beater_add_socket(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int fd;
    unsigned char byte;
    if (!PyArg_ParseTuple(args, "Oib", &capsule, &fd, &byte)) return NULL;
    beater *b = PyCapsule_GetPointer(capsule, BEATER);
    if (!b) return NULL;
    beat_target t = {0};
    t.fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (t.fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    t.byte = byte;
    uint64_t id = add_target(b, &t);
    if (!id) {
        close(t.fd);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(id);
}

/* beater_add_word(beater, buffer, index) -> id: int64 word `index` of a writable buffer
 * counted up each interval. */
static PyObject *py_beater_add_word(PyObject *self, PyObject *args) {
    PyObject *capsule, *buffer;
    Py_ssize_t index;
    if (!PyArg_ParseTuple(args, "OOn", &capsule, &buffer, &index)) return NULL;
    beater *b = PyCapsule_GetPointer(capsule, BEATER);
    if (!b) return NULL;
    beat_target t = {0};
    t.fd = -1;
    if (PyObject_GetBuffer(buffer, &t.view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (index < 0 || (index + 1) * 8 > t.view.len || (uintptr_t)t.view.buf % 8) {
        PyBuffer_Release(&t.view);
        PyErr_SetString(PyExc_ValueError, "no aligned int64 word at that index");
        return NULL;
    }
    t.word = (int64_t *)t.view.buf + index;
    uint64_t id = add_target(b, &t);
    if (!id) {
        PyBuffer_Release(&t.view);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(id);
}

/* beater_remove(beater, id): once it returns, the thread never writes that target again. */
static PyObject *py_beater_remove(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long id;
    if (!PyArg_ParseTuple(args, "OK", &capsule, &id)) return NULL;
    beater *b = PyCapsule_GetPointer(capsule, BEATER);
    if (!b) return NULL;
    beat_target gone = {0};
    int owner = in_owner(b);
    if (owner) pthread_mutex_lock(&b->lock);
    for (int i = 0; id && i < b->capacity; i++)
        if (b->targets[i].id == id) {
            gone = b->targets[i];
            b->targets[i].id = 0;
            break;
        }
    if (owner) pthread_mutex_unlock(&b->lock);
    if (gone.id) release_target(&gone);
    Py_RETURN_NONE;
}

/* beater_close(beater): stops the thread and releases every target (also when freed). */
static PyObject *py_beater_close(PyObject *self, PyObject *args) {
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule)) return NULL;
    beater *b = PyCapsule_GetPointer(capsule, BEATER);
    if (!b) return NULL;
    stop_beater(b);
    Py_RETURN_NONE;
}

/* beater_rounds(beater) -> how many rounds of beats the thread has made (for tests). */
static PyObject *py_beater_rounds(PyObject *self, PyObject *args) {
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule)) return NULL;
    beater *b = PyCapsule_GetPointer(capsule, BEATER);
    if (!b) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&b->rounds, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"open", py_open, METH_VARARGS, "Binds a group's segment; returns a capsule."},
    {"call", (PyCFunction)(void (*)(void))py_call, METH_FASTCALL,
     "The one-step allreduce: DONE (0), WAITING (1) or MISMATCH (2)."},
    {"fold", (PyCFunction)(void (*)(void))py_fold, METH_FASTCALL,
     "The fold of call() once every rank has arrived: DONE (0) or MISMATCH (2)."},
    {"stream", (PyCFunction)(void (*)(void))py_stream, METH_FASTCALL,
     "Copies src into dst (same length) with non-temporal stores, then a store fence."},
    {"beater_open", py_beater_open, METH_VARARGS, "A running beater: beats every interval."},
    {"beater_add_socket", py_beater_add_socket, METH_VARARGS,
     "A byte on (a dup of) a socket each interval; returns its id."},
    {"beater_add_word", py_beater_add_word, METH_VARARGS,
     "An int64 word of a buffer counted up each interval; returns its id."},
    {"beater_remove", py_beater_remove, METH_VARARGS, "Stops beating one target, by id."},
    {"beater_close", py_beater_close, METH_VARARGS, "Stops the thread; releases every target."},
    {"beater_rounds", py_beater_rounds, METH_VARARGS, "Rounds of beats made so far."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shmfast", NULL, -1, methods};

/* The hash of this file that the build passed (setup.py, _native.py): gradsync loads a module
 * only when it matches the source beside it, so a stale build is never used. */
#ifndef GRADSYNC_SOURCE_HASH
#define GRADSYNC_SOURCE_HASH ""
#endif

PyMODINIT_FUNC PyInit__shmfast(void) {
    for (int i = 0; i < N_NAMES; i++)
        if (!NAME[i] && !(NAME[i] = PyUnicode_InternFromString(NAME_TEXT[i]))) return NULL;
    if ((!MINUS_ONE && !(MINUS_ONE = PyLong_FromLong(-1))) ||
        (!NO_WAIT && !(NO_WAIT = PyTuple_Pack(1, Py_False))) ||
        (!ZERO && !(ZERO = PyLong_FromLong(0))) || (!ONE && !(ONE = PyLong_FromLong(1))) ||
        PyType_Ready(&PreparedType) < 0 || PyType_Ready(&InlineType) < 0 ||
        PyType_Ready(&QuickType) < 0)
        return NULL;
    if ((!S_JOB && !(S_JOB = PyUnicode_InternFromString("_job"))) ||
        (!S_SHARES_HOST && !(S_SHARES_HOST = PyUnicode_InternFromString("shares_host"))) ||
        (!S_DTYPE && !(S_DTYPE = PyUnicode_InternFromString("dtype"))) ||
        (!S_VALUE && !(S_VALUE = PyUnicode_InternFromString("_value_"))) ||
        (!S_COPY && !(S_COPY = PyUnicode_InternFromString("copy"))))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "source_hash", GRADSYNC_SOURCE_HASH) < 0 ||
        PyModule_AddObjectRef(m, "Prepared", (PyObject *)&PreparedType) < 0 ||
        PyModule_AddObjectRef(m, "Inline", (PyObject *)&InlineType) < 0 ||
        PyModule_AddObjectRef(m, "Quick", (PyObject *)&QuickType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
