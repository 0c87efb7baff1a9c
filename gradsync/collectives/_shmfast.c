/* gradsync's compiled fast paths: the one-step shared-memory allreduce of the host's segment
 * (transport/host_segment.py) and its barrier, the streaming copy of its pieces road ("The
 * streaming copy"), and the beater of heartbeat.py and the data servers (at the end of this
 * file, "The beater").
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

static PyObject *finish(request *q, uint64_t parity) {
    int status = MISMATCH;
    if (agree(q->g, q->seq, (uint64_t)q->kind, (uint64_t)q->data.len, q->signature)) {
        reduce(q->g, q->data.buf, q->data.len, parity, q->code, q->divisor, q->trunc);
        status = DONE;
    }
    PyBuffer_Release(&q->data);
    return PyLong_FromLong(status);
}

/* call(group, data, seq, signature, code, divisor, trunc[, kind]) -> DONE, WAITING or
 * MISMATCH. The whole one-step allreduce of piece seq (or, with KIND_BARRIER and no data, a
 * barrier: the arrival and the wait alone); on WAITING, Python waits for the arrivals and
 * then calls fold with the same arguments. */
static PyObject *py_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    request q;
    if (parse(args, nargs, &q) < 0) return NULL;
    group *g = q.g;
    uint64_t parity = q.seq & 1, *issued = line(g, g->rank) + ISSUED + 3 * parity;
    if (q.data.len) memcpy(slot(g, g->rank, parity), q.data.buf, (size_t)q.data.len);
    issued[0] = (uint64_t)q.kind;
    issued[1] = (uint64_t)q.data.len;
    issued[2] = q.signature;
    publish(g, ARRIVED, q.seq); /* last: a release store, after the slot and the words */
    if (behind(g, ARRIVED, q.seq) >= 0) {
        int status;
        Py_BEGIN_ALLOW_THREADS
        status = wait_for(g, ARRIVED, q.seq,
                          q.kind == KIND_BARRIER ? g->barrier_yield_ns : g->yield_ns);
        Py_END_ALLOW_THREADS
        if (status == WAITING) {
            PyBuffer_Release(&q.data);
            return PyLong_FromLong(WAITING);
        }
    }
    return finish(&q, parity);
}

/* fold(group, data, seq, signature, code, divisor, trunc[, kind]) -> DONE or MISMATCH: the
 * rest of call() once every rank has arrived at seq. */
static PyObject *py_fold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    request q;
    if (parse(args, nargs, &q) < 0) return NULL;
    return finish(&q, q.seq & 1);
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
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "source_hash", GRADSYNC_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
