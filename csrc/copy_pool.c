/* Native batch copier of the mmap engine (mmap_offload/transfer/native_pool.py wraps it).
 *
 * One GIL-free call per batch: Python hands over (src, dst, nbytes) triples, where src is an
 * address in a read-only mapping of a cache file (page cache) and dst a device address. A pool of
 * pthreads cuts the batch into chunks; per chunk a worker takes a pinned ring slot (waiting for
 * the slot's event: a slot is never refilled before its last device copy completed), copies the
 * bytes into it on the CPU, issues cudaMemcpyAsync(dst, slot) for each piece on the one copy
 * stream and records the slot's event. After the batch's last chunk it records the batch's event
 * (the caller's torch.cuda.Event) and marks the batch issued in a status array the caller owns.
 *
 * No CUDA headers or libraries are linked: the CUDA runtime functions come in as pointers (the
 * ones of the libcudart torch loaded), so this builds with a plain C compiler. Without a GPU the
 * same pool runs over mo_fake_* below: a CPU "stream" thread that executes copies in order and
 * CPU events, so the ring and batch logic are tested on machines without CUDA.
 *
 * Lifetime: mo_pool_shutdown cancels what is queued and joins the workers (every batch issued);
 * only then may the caller, once no thread is inside mo_pool_wait, call mo_pool_destroy.
 *
 * Built with fastcopy.c as the library mo_native (mmap_offload/native.py: at pip install, else at
 * run time; by hand, then at $MMAP_OFFLOAD_NATIVE_MO_NATIVE):
 *   cc -O3 -mavx2 -shared -fPIC csrc/copy_pool.c csrc/fastcopy.c -lpthread -o libmo_native.so */
#define _GNU_SOURCE
#include "fastcopy.h"
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include "sigbus_guard.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MO_POOL_ABI 7
int mo_pool_abi(void) { return MO_POOL_ABI; }

/* --- the CUDA runtime calls the pool makes (cudaError_t = int, cudaStream_t/Event_t = void *) */
typedef int (*fn_memcpy_async)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*fn_event_create)(void **ev, unsigned flags);
typedef int (*fn_event_record)(void *ev, void *stream);
typedef int (*fn_event_sync)(void *ev);
typedef int (*fn_event_query)(void *ev); /* 0: complete */
typedef int (*fn_event_destroy)(void *ev);
typedef int (*fn_set_device)(int device);
typedef void (*fn_host)(void *arg); /* cudaHostFn_t */
typedef int (*fn_launch_host_func)(void *stream, fn_host fn, void *arg);

enum { H2D = 1, EV_BLOCKING_SYNC = 0x1, EV_DISABLE_TIMING = 0x2 };
/* mo_pool_create flags. HOT_SLOTS: take the most recently freed slot whose copy has completed
 * (its lines are likely still in the CPU caches, where the DMA can read them), the oldest
 * otherwise; without it slots are reused oldest first. */
enum { POOL_HOT_SLOTS = 1 };

/* Status words of one batch, in an int64 array the caller owns and keeps alive until issued. */
/* ST_FAULT: with ERR_FAULT, the address in the mapping whose read raised SIGBUS. */
enum { ST_CHUNKS = 0, ST_DONE = 1, ST_ISSUED = 2, ST_ERROR = 3, ST_FAULT = 4, ST_LEN = 5 };
/* > 0: the CUDA error code of the first failed call; ERR_FAULT: a chunk's read of the mapping
 * raised SIGBUS (file truncated under the mapping, or an I/O error on a mapped page) */
enum { ERR_CANCELLED = -1, ERR_FAULT = -2 };
enum { SUBMIT_CLOSED = -1, SUBMIT_INVALID = -2 }; /* mo_pool_submit: nothing was queued */
/* mo_gate_submit, besides those: no arena / no cudaLaunchHostFunc; the batch is larger than the
 * arena; the arena already serves another stream (nothing was queued, the caller takes the
 * ordinary path) */
enum { GATE_UNSUPPORTED = -3, GATE_TOO_BIG = -4, GATE_OTHER_STREAM = -5 };
/* a gated batch's status has one more word: the CUDA error of the copies or of the gate's launch,
 * written by the submitting thread before mo_gate_submit returns */
enum { ST_CUDA = 5, ST_GATED_LEN = 6 };

typedef struct { uint64_t src, dst, n; } mo_piece;              /* input triple */
typedef struct { uint64_t src, dst, n, off; } planned_piece;    /* off: offset in the slot */
typedef struct { uint32_t first, count; } chunk;                /* pieces [first, first+count) */

typedef struct batch {
    struct batch *next;
    planned_piece *pieces;
    chunk *chunks;
    uint32_t nchunks, taken;
    int64_t *status;
    void *event; /* recorded after the last chunk's copies; may be NULL */
} batch;

typedef struct mo_pool mo_pool;

/* A stream-ordered ("gated") batch: see the section "Stream-ordered batches" below. A batch is
 * one or more groups, each behind its own gate; the parent publishes the batch's status once
 * every group's fill finished. */
typedef struct gparent {
    int64_t *status;         /* the caller's words, until ST_ISSUED is set */
    uint32_t left;           /* groups whose fill has not finished */
    uint32_t done;           /* chunks finished */
    int err;
    uint64_t fault;
} gparent;

typedef struct gbatch {      /* one group */
    struct gbatch *next;
    mo_pool *p;
    gparent *parent;
    uint64_t seq, wait_seq;  /* its fill waits until p->g_released >= wait_seq */
    planned_piece *pieces;   /* off: offset in the arena */
    chunk *chunks;
    uint32_t npieces, nchunks, taken, done;
    int filled, refs;        /* refs (atomic): its fill + its gate (if launched) + the submitting call */
    char *base;              /* where its offsets point: NULL, the arena; mo_fill_queue's caller's buffer */
    uint64_t *flags;         /* mo_fill_queue: per chunk, 1 (filled) or 2 (failed), stored once it is done */
    int fill_err;            /* mo_fill_queue: the batch's first error, set when it is filled */
    int movsb;               /* mo_fill_queue: 1 cached stores (rep movsb), 0 streaming (nt4), -1 the pool's rule */
    uint64_t fill_fault;
} gbatch;

enum { OWN_SLOTS = 2 }; /* POOL_HOT_SLOTS: the slots a worker released last, newest first */
typedef struct { mo_pool *p; int own[OWN_SLOTS]; } worker_arg;

struct mo_pool {
    fn_memcpy_async memcpy_async;
    fn_event_create event_create;
    fn_event_record event_record;
    fn_event_sync event_sync;
    fn_event_destroy event_destroy;
    fn_set_device set_device;
    fn_event_query event_query;         /* POOL_HOT_SLOTS only */
    int flags;
    int device;
    void *stream;

    char *ring;
    size_t slot_bytes;
    int nslots;
    void **slot_event;
    int *slot_used;   /* 1 once an event was recorded for the slot */
    int *fifo;        /* free slots fifo[0 .. fifo_count), oldest release first */
    char *slot_free;  /* 1 while the slot is in fifo */
    int fifo_count;

    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv, slot_cv;
    batch *head, *tail;
    int closing, joined;
    int nthreads;
    pthread_t *threads;
    worker_arg *args;
    int copy_kind; /* COPY_NT4 or COPY_MIXED (see run_chunk) */

    /* stats (under mu): bytes, chunks, nanoseconds filling / issuing / waiting for a slot */
    uint64_t st_bytes, st_chunks, st_fill_ns, st_issue_ns, st_slot_wait_ns;

    /* stream-ordered batches (mo_gate_init): the arena is ring slots [g_first, nslots) */
    fn_launch_host_func launch_host_func;
    char *g_base;
    size_t g_size, g_head, g_granule;
    int g_first, g_ngran, g_nthreads, g_gates_pending;
    uint64_t *g_owner;       /* per granule of the arena: seq of the last batch placed on it */
    uint64_t g_seq, g_released;
    void *g_stream, *g_last_event; /* g_stream: the stream of every gated batch (set by the first) */
    int g_event_recorded;
    gbatch *g_head_q, *g_tail_q;
    pthread_cond_t g_work_cv, g_rel_cv;
    pthread_t *g_threads;
    /* stats (under mu): batches, bytes, fill ns, gates run, gates that waited, ns they waited */
    uint64_t st_g_batches, st_g_bytes, st_g_fill_ns, st_g_gates, st_g_gates_waited, st_g_gate_wait_ns;
    uint64_t st_g_fill_waits; /* fills queued by mo_fill_queue */
    uint64_t st_g_ungated; /* batches whose gate could not be launched (the submit waited) */
    uint64_t st_g_submit_ns; /* time inside mo_gate_submit (the caller's thread) */
};

void mo_pool_shutdown(mo_pool *p);

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* "mixed": rep movsb for chunks of at least MIXED_MOVSB_MIN, nt4 below. rep movsb leaves the slot's
 * lines in the caches, where the DMA reads them without touching memory: with hot slot reuse that
 * won 6-15 points of H2D on whole layers. A small chunk, though, sits whole in the writing core's
 * L2 (2 MiB on the machine measured), and DMA reads that snoop it there landed a 1-expert batch 2x
 * later than non-temporal stores, which write it to memory at once (TRANSFER.md, session 3). */
enum { MIXED_MOVSB_MIN = 4 << 20 };
/* mo_pool_create copy_kind: "nt4" (4 interleaved non-temporal AVX2 streams: the kernel where the
 * CPU lacks ERMS) or "mixed" (the default where it has it). Other kernels measured slower and were
 * removed (TRANSFER.md, "Removed after measurement"). */
enum { COPY_NT4 = 0, COPY_MIXED = 1 };
enum { PREFETCH = 1024 }; /* nt4's software prefetch distance, bytes */

/* under mu: take the free slot at position k (from the oldest) out of the free list */
static int take_free_at(mo_pool *p, int k) {
    int s = p->fifo[k];
    memmove(&p->fifo[k], &p->fifo[k + 1], (size_t)(p->fifo_count - k - 1) * sizeof(int));
    p->fifo_count--;
    p->slot_free[s] = 0;
    return s;
}

/* under mu: 1 if slot s has no copy in flight (an event query costs microseconds: callers bound
 * how many they make under the lock) */
static int slot_idle(mo_pool *p, int s) {
    if (p->slot_used[s] && p->event_query(p->slot_event[s]) != 0) return 0;
    p->slot_used[s] = 0; /* complete: no wait needed */
    return 1;
}

/* under mu, POOL_HOT_SLOTS: a free slot with no copy in flight whose lines are likely still in
 * the caches: one of the worker's own last slots (the lines are in its core's cache, not in
 * another core's, which a write would first have to snoop), else one of the HOT_SCAN newest
 * free ones; -1 if none is idle. */
enum { HOT_SCAN = 4 };
static int take_hot_slot(mo_pool *p, worker_arg *w) {
    for (int i = 0; w && i < OWN_SLOTS; i++) {
        int s = w->own[i];
        if (s < 0 || !p->slot_free[s] || !slot_idle(p, s)) continue;
        for (int k = p->fifo_count - 1; k >= 0; k--)
            if (p->fifo[k] == s) return take_free_at(p, k);
    }
    int queried = 0;
    for (int k = p->fifo_count - 1; k >= 0 && queried < HOT_SCAN; k--) {
        int s = p->fifo[k];
        queried += p->slot_used[s];
        if (slot_idle(p, s)) return take_free_at(p, k);
    }
    return -1;
}

static int acquire_slot(mo_pool *p, worker_arg *w) {
    uint64_t t0 = now_ns();
    pthread_mutex_lock(&p->mu);
    while (p->fifo_count == 0)
        pthread_cond_wait(&p->slot_cv, &p->mu);
    int s = (p->flags & POOL_HOT_SLOTS) ? take_hot_slot(p, w) : -1;
    if (s < 0) s = take_free_at(p, 0); /* the oldest */
    int used = p->slot_used[s];
    pthread_mutex_unlock(&p->mu);
    if (used) p->event_sync(p->slot_event[s]); /* its last device copy has completed */
    uint64_t dt = now_ns() - t0;
    pthread_mutex_lock(&p->mu);
    p->st_slot_wait_ns += dt;
    pthread_mutex_unlock(&p->mu);
    return s;
}

static void release_slot(mo_pool *p, int s, int recorded, worker_arg *w) {
    if (w) { /* remember it, newest first */
        for (int i = OWN_SLOTS - 1; i > 0; i--) w->own[i] = w->own[i - 1];
        w->own[0] = s;
    }
    pthread_mutex_lock(&p->mu);
    p->slot_used[s] = recorded;
    p->fifo[p->fifo_count++] = s;
    p->slot_free[s] = 1;
    pthread_cond_signal(&p->slot_cv);
    pthread_mutex_unlock(&p->mu);
}

/* --- SIGBUS guard of the reads from the mapping (sigbus_guard.h) ------------------------------
 * The pool's workers copy inside the guard (installed by the first mo_pool_create): a chunk whose read
 * raised SIGBUS fails with ERR_FAULT and the faulting address. */

/* 1 while the process's SIGBUS handler is the pool's. A handler installed later by someone else
 * (e.g. Python's faulthandler.enable()) sees guarded faults first: faulthandler prints its dump and
 * re-raises, which this handler then still catches; one that does not re-raise disarms the guard. */
int mo_sigbus_guarded(void) { return guard_is_current(); }

/* The pool's handler (a library installed after it that passes faults on names it as its previous one:
 * mo_host's guard, mo_host_sigbus_prev). */
void *mo_sigbus_handler(void) { return guard_handler(); }

/* Copy a chunk's pieces from the mapping into the slot; 0, or ERR_FAULT with *fault set. */
static int guarded_copy(const chunk *c, const planned_piece *pieces, char *slot, int movsb, uint64_t *fault) {
    sigjmp_buf jb;
    volatile uint32_t i = 0;
    if (sigsetjmp(jb, 0)) {
        void *a = guard_fault_addr();
        *fault = a ? (uint64_t)(uintptr_t)a : pieces[c->first + i].src;
        return ERR_FAULT;
    }
    guard_arm(&jb);
    for (; i < c->count; i++) {
        const planned_piece *q = &pieces[c->first + i];
        if (movsb) mo_copy_movsb(slot + q->off, (const void *)(uintptr_t)q->src, q->n);
        else mo_copy_nt4(slot + q->off, (const void *)(uintptr_t)q->src, q->n, PREFETCH);
    }
    guard_disarm();
    return 0;
}

/* One chunk: slot <- CPU copy <- mapping; device <- cudaMemcpyAsync <- slot. Returns the CUDA
 * error of the first failed call (or ERR_FAULT, then *fault is the address), 0 on success. */
static int run_chunk(mo_pool *p, worker_arg *w, batch *b, uint32_t ci, uint64_t *fault) {
    const chunk *c = &b->chunks[ci];
    int s = acquire_slot(p, w);
    char *slot = p->ring + (size_t)s * p->slot_bytes;
    uint64_t t0 = now_ns(), bytes = 0;
    for (uint32_t i = 0; i < c->count; i++) bytes += b->pieces[c->first + i].n;
    if (guarded_copy(c, b->pieces, slot, p->copy_kind == COPY_MIXED && bytes >= MIXED_MOVSB_MIN, fault)) {
        release_slot(p, s, 0, w); /* nothing was issued from it */
        pthread_mutex_lock(&p->mu);
        p->st_chunks++;
        pthread_mutex_unlock(&p->mu);
        return ERR_FAULT;
    }
    uint64_t t1 = now_ns();
    int err = 0;
    for (uint32_t i = 0; i < c->count && !err; i++) {
        const planned_piece *q = &b->pieces[c->first + i];
        err = p->memcpy_async((void *)(uintptr_t)q->dst, slot + q->off, q->n, H2D, p->stream);
    }
    int rec = p->event_record(p->slot_event[s], p->stream);
    /* Without an event nothing guards the slot: a later fill may overwrite it before these copies
     * ran. Only this batch's destinations can get those bytes, and it fails with ``rec`` (a failed
     * record means a broken CUDA context; there is no stream sync to fall back on). */
    if (rec && !err) err = rec;
    release_slot(p, s, rec == 0, w);
    uint64_t t2 = now_ns();
    pthread_mutex_lock(&p->mu);
    p->st_fill_ns += t1 - t0;
    p->st_issue_ns += t2 - t1;
    p->st_bytes += err ? 0 : bytes;
    p->st_chunks++;
    pthread_mutex_unlock(&p->mu);
    return err;
}

/* Mark one chunk of b finished (under mu); the last one records the batch event. */
static void chunk_finished(mo_pool *p, batch *b, int err, uint64_t fault) {
    if (err && b->status[ST_ERROR] == 0) {
        b->status[ST_ERROR] = err;
        b->status[ST_FAULT] = (int64_t)fault;
    }
    b->status[ST_DONE]++;
    if ((uint64_t)b->status[ST_DONE] == b->nchunks) {
        if (b->event) {
            int rec = p->event_record(b->event, p->stream);
            if (rec && b->status[ST_ERROR] == 0) b->status[ST_ERROR] = rec;
        }
        __atomic_store_n(&b->status[ST_ISSUED], 1, __ATOMIC_RELEASE);
        free(b->pieces);
        free(b->chunks);
        free(b);
        pthread_cond_broadcast(&p->done_cv);
    }
}

static void *worker(void *arg) {
    worker_arg *w = (worker_arg *)arg;
    mo_pool *p = w->p;
    guard_thread_init(); /* touch the thread-local state here, not first in the signal handler */
    if (p->set_device) p->set_device(p->device);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->closing) pthread_cond_wait(&p->work_cv, &p->mu);
        batch *b = p->head;
        if (!b) break; /* closing and nothing queued */
        uint32_t ci = b->taken++;
        if (b->taken == b->nchunks) { /* every chunk handed out: dequeue */
            p->head = b->next;
            if (!p->head) p->tail = NULL;
        }
        int err;
        uint64_t fault = 0;
        if (p->closing) {
            err = ERR_CANCELLED;
        } else {
            pthread_mutex_unlock(&p->mu);
            err = run_chunk(p, w, b, ci, &fault);
            pthread_mutex_lock(&p->mu);
        }
        chunk_finished(p, b, err, fault);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* api: memcpy_async, event_create, event_record, event_sync, event_destroy, set_device (or 0),
 * event_query (0 without POOL_HOT_SLOTS in ``flags``). ``nthreads`` workers copy through the ring.
 * Returns NULL if an argument is off or an allocation, an event or a thread could not be made. */
mo_pool *mo_pool_create(void *const *api, int device, void *stream, void *ring, size_t slot_bytes,
                        int nslots, int nthreads, int copy_kind, int flags) {
    if (nslots < 1 || nthreads < 1 || !ring || !slot_bytes) return NULL;
    if (copy_kind != COPY_NT4 && copy_kind != COPY_MIXED) return NULL;
    if ((flags & POOL_HOT_SLOTS) && !api[6]) return NULL;
    guard_install();
    mo_pool *p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    p->memcpy_async = (fn_memcpy_async)api[0];
    p->event_create = (fn_event_create)api[1];
    p->event_record = (fn_event_record)api[2];
    p->event_sync = (fn_event_sync)api[3];
    p->event_destroy = (fn_event_destroy)api[4];
    p->set_device = (fn_set_device)api[5];
    p->event_query = (fn_event_query)api[6];
    p->launch_host_func = (fn_launch_host_func)api[7];
    p->flags = flags;
    p->device = device;
    p->stream = stream;
    p->ring = (char *)ring;
    p->slot_bytes = slot_bytes;
    p->nslots = nslots;
    p->copy_kind = copy_kind;
    p->slot_event = calloc((size_t)nslots, sizeof(void *));
    p->slot_used = calloc((size_t)nslots, sizeof(int));
    p->fifo = calloc((size_t)nslots, sizeof(int));
    p->slot_free = calloc((size_t)nslots, 1);
    p->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    p->args = calloc((size_t)nthreads, sizeof(worker_arg));
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    pthread_cond_init(&p->slot_cv, NULL);
    pthread_cond_init(&p->g_work_cv, NULL);
    pthread_cond_init(&p->g_rel_cv, NULL);
    p->g_first = nslots;
    if (!p->slot_event || !p->slot_used || !p->fifo || !p->slot_free || !p->threads || !p->args) goto fail;
    if (p->set_device) p->set_device(device);
    for (int i = 0; i < nslots; i++) {
        /* blocking sync: a worker waiting for a slot sleeps instead of spinning on a copier's core */
        if (p->event_create(&p->slot_event[i], EV_BLOCKING_SYNC | EV_DISABLE_TIMING)) goto fail;
        p->fifo[i] = i;
        p->slot_free[i] = 1;
    }
    p->fifo_count = nslots;
    for (int i = 0; i < nthreads; i++) {
        p->args[i].p = p;
        for (int k = 0; k < OWN_SLOTS; k++) p->args[i].own[k] = -1;
        if (pthread_create(&p->threads[i], NULL, worker, &p->args[i])) goto fail;
        p->nthreads++;
    }
    return p;
fail:
    mo_pool_shutdown(p);
    for (int i = 0; p->slot_event && i < nslots; i++)
        if (p->slot_event[i]) p->event_destroy(p->slot_event[i]);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_cond_destroy(&p->slot_cv);
    pthread_cond_destroy(&p->g_work_cv);
    pthread_cond_destroy(&p->g_rel_cv);
    free(p->slot_event); free(p->slot_used); free(p->fifo); free(p->slot_free); free(p->threads); free(p->args); free(p);
    return NULL;
}

/* Queue a batch. Pieces are cut into chunks of at most chunk_bytes (<= slot_bytes); small
 * pieces share a chunk, each starting 64-byte aligned in the slot. ``status`` (ST_LEN int64,
 * zeroed by the caller) and ``event`` stay valid until status[ST_ISSUED] is 1.
 * Returns the number of chunks, SUBMIT_CLOSED (the pool is shut down) or SUBMIT_INVALID (bad
 * arguments, too many pieces, no memory); then nothing was queued. */
int64_t mo_pool_submit(mo_pool *p, const mo_piece *in, size_t n, size_t chunk_bytes,
                       int64_t *status, void *event) {
    if (!p || !status || (n && !in) || chunk_bytes == 0 || chunk_bytes > p->slot_bytes)
        return SUBMIT_INVALID;
    /* a piece becomes at most n / chunk_bytes + 2 planned pieces (a partial first and last);
     * indices are uint32 and the sum must not wrap (a wrapped cap under-allocates) */
    uint64_t cap = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t q = in[i].n / chunk_bytes;
        if (q > UINT32_MAX || (cap += q + 2) > UINT32_MAX) return SUBMIT_INVALID;
    }
    batch *b = calloc(1, sizeof(*b));
    planned_piece *pieces = malloc((cap ? cap : 1) * sizeof(*pieces));
    chunk *chunks = malloc((cap ? cap : 1) * sizeof(*chunks));
    if (!b || !pieces || !chunks) { free(b); free(pieces); free(chunks); return SUBMIT_INVALID; }
    size_t np = 0, nc = 0, used = 0;
    int open = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t s = 0, len = in[i].n;
        while (s < len) {
            size_t off = (used + 63) & ~(size_t)63;
            if (open && off >= chunk_bytes) { open = 0; }
            if (open && off + (len - s) > chunk_bytes && len - s <= chunk_bytes) { open = 0; }
            if (!open) { chunks[nc].first = (uint32_t)np; chunks[nc].count = 0; nc++; open = 1; off = 0; }
            uint64_t take = len - s;
            if (take > chunk_bytes - off) take = chunk_bytes - off;
            pieces[np].src = in[i].src + s;
            pieces[np].dst = in[i].dst + s;
            pieces[np].n = take;
            pieces[np].off = off;
            np++;
            chunks[nc - 1].count++;
            used = off + take;
            s += take;
        }
    }
    b->pieces = pieces;
    b->chunks = chunks;
    b->nchunks = (uint32_t)nc;
    b->status = status;
    b->event = event;
    status[ST_CHUNKS] = (int64_t)nc;
    pthread_mutex_lock(&p->mu);
    if (p->closing) {
        pthread_mutex_unlock(&p->mu);
        free(pieces); free(chunks); free(b);
        return SUBMIT_CLOSED;
    }
    if (nc == 0) { /* nothing to copy: issued at once (the event marks "now" on the stream) */
        if (event) {
            int rec = p->event_record(event, p->stream);
            if (rec) status[ST_ERROR] = rec;
        }
        __atomic_store_n(&status[ST_ISSUED], 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&p->mu);
        free(pieces); free(chunks); free(b);
        return 0;
    }
    if (p->tail) p->tail->next = b; else p->head = b;
    p->tail = b;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    return (int64_t)nc;
}

/* Block until the batch of ``status`` is issued; returns status[ST_ERROR]. ``p`` must stay
 * valid until this returns (mo_pool_shutdown issues every batch, then the caller lets waiters
 * leave before mo_pool_destroy). Without a pool nothing will issue the batch: ERR_CANCELLED. */
int64_t mo_pool_wait(mo_pool *p, int64_t *status) {
    if (__atomic_load_n(&status[ST_ISSUED], __ATOMIC_ACQUIRE)) return status[ST_ERROR];
    if (!p) return ERR_CANCELLED;
    pthread_mutex_lock(&p->mu);
    while (!__atomic_load_n(&status[ST_ISSUED], __ATOMIC_ACQUIRE))
        pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    return status[ST_ERROR];
}

/* 1 once the batch of ``status`` is issued, with its ERROR word in *error; 0 before. The acquire
 * load orders what the caller reads next (ERROR, the batch event) after the pool's release store,
 * also on weakly ordered CPUs (Arm), where a plain read of the words would not. No pool needed. */
int mo_status_issued(const int64_t *status, int64_t *error) {
    if (!__atomic_load_n(&status[ST_ISSUED], __ATOMIC_ACQUIRE)) return 0;
    *error = status[ST_ERROR];
    return 1;
}

/* bytes, chunks, fill_ns, issue_ns, slot_wait_ns */
void mo_pool_stats(mo_pool *p, uint64_t *out) {
    pthread_mutex_lock(&p->mu);
    out[0] = p->st_bytes; out[1] = p->st_chunks; out[2] = p->st_fill_ns;
    out[3] = p->st_issue_ns; out[4] = p->st_slot_wait_ns;
    pthread_mutex_unlock(&p->mu);
}

/* Cancel chunks not started (their batches finish with ERR_CANCELLED), finish those running,
 * join the workers: afterwards every batch is issued and submit returns SUBMIT_CLOSED, but the
 * pool stays valid for mo_pool_wait / mo_pool_stats. Idempotent; one caller at a time. */
void mo_pool_shutdown(mo_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->closing = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_cond_broadcast(&p->g_work_cv);
    pthread_cond_broadcast(&p->g_rel_cv);
    int joined = p->joined;
    p->joined = 1;
    pthread_mutex_unlock(&p->mu);
    if (!joined) {
        for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
        for (int i = 0; i < p->g_nthreads; i++) pthread_join(p->g_threads[i], NULL);
    }
}

static int gates_drained(mo_pool *p, int seconds);

/* Shut down, wait for every slot's last device copy, free everything. No call on ``p`` may run
 * or follow (the caller's job: mo_pool_wait blocks inside p). The ring memory is the caller's. */
void mo_pool_destroy(mo_pool *p) {
    if (!p) return;
    mo_pool_shutdown(p);
    /* gates the stream has not run yet hold the pool: wait for them (their fills are finished or
     * cancelled, so each returns at once when its stream reaches it); a stream stuck for longer
     * than this (a hung device) leaks the pool instead of freeing memory a gate still reads */
    if (!gates_drained(p, 30)) return;
    if (p->g_last_event) {
        if (p->g_event_recorded) p->event_sync(p->g_last_event); /* the arena's last device copies */
        p->event_destroy(p->g_last_event);
    }
    free(p->g_owner);
    free(p->g_threads);
    pthread_cond_destroy(&p->g_work_cv);
    pthread_cond_destroy(&p->g_rel_cv);
    for (int i = 0; i < p->nslots; i++) {
        if (p->slot_used[i]) p->event_sync(p->slot_event[i]);
        p->event_destroy(p->slot_event[i]);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_cond_destroy(&p->slot_cv);
    free(p->slot_event); free(p->slot_used); free(p->fifo); free(p->slot_free); free(p->threads); free(p->args); free(p);
}

/* --- Stream-ordered batches ("gated") ------------------------------------------------------
 * mo_pool_submit's caller must wait until a batch is issued before it may order later work after
 * it (cudaStreamWaitEvent waits for the event's latest record, so the record must come first): at
 * decode that wait was half of the residency step's host time (BENCHMARKS.md, session 6). A gated
 * batch is instead ordered on the caller's stream (the one its consumer runs on) at once, without
 * any wait:
 *
 *   mo_gate_submit (the caller's thread, never blocks)
 *     places the batch in the arena (ring slots [g_first, nslots), one contiguous byte range),
 *     queues its fill for the gated threads (CPU copies mapping -> arena, no CUDA call),
 *     cudaLaunchHostFunc(stream, gate, batch), then cudaMemcpyAsync(dst, arena) on that stream
 *   gate (CUDA's host-function thread, when the stream reaches it)
 *     marks every earlier batch's copies complete (they precede it on the same stream), then
 *     returns once this batch's fill is finished: the stream's copies behind it read filled bytes
 *   a fill waits, before it writes arena bytes, until the batches that last used them are marked
 *     complete (g_released >= wait_seq)
 *
 * Placement: groups start on 64 KiB granules of the arena; each granule remembers the sequence
 * number of the last group placed on it, and a fill waits for the gates after those.
 *
 * Why this cannot deadlock: a gate waits only for CPU work (its fill); a fill waits only for the
 * gate of a batch at or before its own (the first gate after the batches whose bytes it reuses),
 * never for device progress nor for a later batch, and fills are taken in order by their own
 * threads, which never block on anything else. A gate that waited for device work (an event of
 * another stream, or the ring's normal copies on the copy stream) could deadlock when the blocked
 * stream shares a hardware queue with that work (session 5's stream words did); so gated batches
 * use their own threads and their own part of the ring, and all of them one stream (a second
 * stream is refused: its gates could block the first's copies in a shared queue).
 *
 * Errors: a fill that fails (SIGBUS reading the mapping) still finishes, so its gate returns and the
 * copies behind it move stale arena bytes; the batch's status says so (ST_ERROR, as for ordinary
 * batches, once ST_ISSUED is set at the fill's end): the caller must check it (mo_pool_wait) before
 * it uses the destinations' results, and drop them. A failed gate launch makes mo_gate_submit wait
 * for the fill before it issues the copies (correct, no longer asynchronous; counted in the stats). */
/* pieces start GATE_ALIGN apart; groups start on a granule, so no two groups share one (a
 * shared granule would make a fill wait for its own batch's gate: fill and stream in lock-step) */
enum { GATE_ALIGN = 256, GATE_GRANULE = 64 << 10 };

static void gbatch_free(gbatch *b) {
    free(b->pieces);
    free(b->chunks);
    free(b);
}

static void gbatch_unref(gbatch *b) { /* atomic: the submitting call drops its own without mu */
    if (!__atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL)) gbatch_free(b);
}

static void gate_fn(void *arg) {
    gbatch *b = (gbatch *)arg;
    mo_pool *p = b->p;
    pthread_mutex_lock(&p->mu);
    if (b->seq - 1 > p->g_released) {
        p->g_released = b->seq - 1;
        pthread_cond_broadcast(&p->g_rel_cv);
    }
    p->st_g_gates++;
    if (!b->filled) {
        uint64_t t0 = now_ns();
        while (!b->filled) pthread_cond_wait(&p->done_cv, &p->mu);
        p->st_g_gates_waited++;
        p->st_g_gate_wait_ns += now_ns() - t0;
    }
    gbatch_unref(b);
    if (--p->g_gates_pending == 0) pthread_cond_broadcast(&p->g_rel_cv);
    pthread_mutex_unlock(&p->mu);
}

/* under mu: one chunk of b finished; the group's last one marks it filled (its gate may open),
 * the batch's last group publishes the batch's status */
static void gchunk_finished(mo_pool *p, gbatch *b, int err, uint64_t fault) {
    gparent *par = b->parent;
    if (err && !par->err) {
        par->err = err;
        par->fault = fault;
    }
    par->done++;
    if (++b->done < b->nchunks) return;
    b->filled = 1;
    b->fill_err = par->err;
    b->fill_fault = par->fault;
    if (--par->left == 0) {
        par->status[ST_DONE] = par->done;
        par->status[ST_ERROR] = par->err;
        par->status[ST_FAULT] = (int64_t)par->fault;
        __atomic_store_n(&par->status[ST_ISSUED], 1, __ATOMIC_RELEASE); /* the caller may free it now */
        free(par);
    }
    b->parent = NULL;
    pthread_cond_broadcast(&p->done_cv);
    gbatch_unref(b);
}

static void *gworker(void *arg) {
    mo_pool *p = (mo_pool *)arg;
    guard_thread_init();
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->g_head_q && !p->closing) pthread_cond_wait(&p->g_work_cv, &p->mu);
        gbatch *b = p->g_head_q;
        if (!b) break;
        uint32_t ci = b->taken++;
        if (b->taken == b->nchunks) {
            p->g_head_q = b->next;
            if (!p->g_head_q) p->g_tail_q = NULL;
        }
        while (!p->closing && p->g_released < b->wait_seq) pthread_cond_wait(&p->g_rel_cv, &p->mu);
        int err = 0;
        uint64_t fault = 0;
        if (p->closing) {
            err = ERR_CANCELLED;
            if (b->flags) __atomic_store_n(&b->flags[ci], 2, __ATOMIC_RELEASE);
        } else {
            pthread_mutex_unlock(&p->mu);
            uint64_t t0 = now_ns(), bytes = 0;
            const chunk *c = &b->chunks[ci];
            for (uint32_t i = 0; i < c->count; i++) bytes += b->pieces[c->first + i].n;
            /* planned offsets are arena offsets: the "slot" is the arena's start */
            int movsb = b->movsb >= 0 ? b->movsb : (p->copy_kind == COPY_MIXED && bytes >= MIXED_MOVSB_MIN);
            err = guarded_copy(c, b->pieces, b->base ? b->base : p->g_base, movsb, &fault);
            uint64_t dt = now_ns() - t0;
            if (b->flags) /* a consumer polls it (the async step's copy kernel): the bytes come first */
                __atomic_store_n(&b->flags[ci], err ? 2 : 1, __ATOMIC_RELEASE);
            pthread_mutex_lock(&p->mu);
            p->st_g_fill_ns += dt;
            p->st_g_bytes += err ? 0 : bytes;
        }
        gchunk_finished(p, b, err, fault);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* Set aside ring slots [first_slot, nslots) as the arena of stream-ordered batches and start
 * ``nthreads`` threads to fill it. Call once, before the first mo_pool_submit. 0 on success;
 * GATE_UNSUPPORTED without cudaLaunchHostFunc (api[7]); SUBMIT_INVALID for bad arguments or when
 * no slot would be left for ordinary batches; SUBMIT_CLOSED. (Ordinary workers need only one slot
 * to progress: a gate waits for its own threads only, so a copy-stream wait on the gated stream
 * always ends.) */
int mo_gate_init(mo_pool *p, int first_slot, int nthreads) {
    if (!p) return SUBMIT_INVALID;
    if (!p->launch_host_func) return GATE_UNSUPPORTED;
    if (nthreads < 1 || first_slot < 1 || first_slot >= p->nslots) return SUBMIT_INVALID;
    pthread_mutex_lock(&p->mu);
    int bad = p->closing || p->g_base || p->fifo_count != p->nslots || p->st_chunks;
    if (!bad) {
        p->g_size = (size_t)(p->nslots - first_slot) * p->slot_bytes;
        p->g_granule = GATE_GRANULE;
        p->g_ngran = (int)((p->g_size + GATE_GRANULE - 1) / GATE_GRANULE);
        p->g_owner = calloc((size_t)p->g_ngran, sizeof(uint64_t));
        p->g_threads = calloc((size_t)nthreads, sizeof(pthread_t));
        bad = !p->g_owner || !p->g_threads ||
              p->event_create(&p->g_last_event, EV_BLOCKING_SYNC | EV_DISABLE_TIMING) != 0;
        if (bad) {
            free(p->g_owner); free(p->g_threads);
            p->g_owner = NULL; p->g_threads = NULL; p->g_last_event = NULL;
        }
    }
    if (!bad) {
        /* the arena's slots leave the free list; the fifo holds slots in index order here */
        int k = 0;
        for (int i = 0; i < p->fifo_count; i++)
            if (p->fifo[i] < first_slot) p->fifo[k++] = p->fifo[i];
            else p->slot_free[p->fifo[i]] = 0;
        p->fifo_count = k;
        p->g_first = first_slot;
        p->g_base = p->ring + (size_t)first_slot * p->slot_bytes;
    }
    pthread_mutex_unlock(&p->mu);
    if (bad) return p->closing ? SUBMIT_CLOSED : SUBMIT_INVALID;
    for (int i = 0; i < nthreads; i++) {
        if (pthread_create(&p->g_threads[i], NULL, gworker, p)) break;
        pthread_mutex_lock(&p->mu);
        p->g_nthreads++;
        pthread_mutex_unlock(&p->mu);
    }
    return p->g_nthreads ? 0 : SUBMIT_INVALID; /* with no thread, submits are refused */
}

/* Plan pieces in[0, n) as one gated group: laid end to end (GATE_ALIGN apart) from offset 0, cut
 * into fill chunks of at most chunk_bytes. NULL if out of memory; *span gets its extent. */
static gbatch *gplan(mo_pool *p, const mo_piece *in, size_t n, size_t chunk_bytes, uint64_t *span) {
    uint64_t cap = 0;
    for (size_t i = 0; i < n; i++) cap += in[i].n / chunk_bytes + 2; /* bounded by the caller */
    gbatch *b = calloc(1, sizeof(*b));
    planned_piece *pieces = malloc((cap ? cap : 1) * sizeof(*pieces));
    chunk *chunks = malloc((cap ? cap : 1) * sizeof(*chunks));
    if (!b || !pieces || !chunks) { free(b); free(pieces); free(chunks); return NULL; }
    b->movsb = -1; /* the pool's rule */
    uint32_t np = 0, nc = 0;
    uint64_t pos = 0, chunk_end = 0;
    for (size_t i = 0; i < n; i++) {
        pos = (pos + GATE_ALIGN - 1) & ~(uint64_t)(GATE_ALIGN - 1);
        uint64_t s = 0, len = in[i].n;
        while (s < len) {
            if (nc == 0 || pos >= chunk_end) {
                chunks[nc].first = np;
                chunks[nc].count = 0;
                nc++;
                chunk_end = pos + chunk_bytes;
            }
            uint64_t take = len - s;
            if (take > chunk_end - pos) take = chunk_end - pos;
            pieces[np] = (planned_piece){in[i].src + s, in[i].dst + s, take, pos};
            np++;
            chunks[nc - 1].count++;
            pos += take;
            s += take;
        }
    }
    b->p = p;
    b->pieces = pieces;
    b->chunks = chunks;
    b->npieces = np;
    b->nchunks = nc;
    *span = (pos + GATE_ALIGN - 1) & ~(uint64_t)(GATE_ALIGN - 1);
    return b;
}

static void gbatch_free_unqueued(gbatch **g, int ng) {
    for (int i = 0; i < ng; i++)
        if (g[i]) gbatch_free(g[i]);
    free(g);
}

/* Queue a batch ordered on ``stream`` (see above): ``status`` has ST_GATED_LEN words, zeroed by the
 * caller, and stays valid until status[ST_ISSUED] is 1 (every fill finished); ``event`` (may be
 * NULL) is recorded on ``stream`` after the batch's copies. ``group_bytes`` > 0 cuts the batch at
 * piece boundaries into groups of at least that many bytes, each behind its own gate, so the
 * stream copies a group while the threads fill the next (fill and copy overlap); 0: one gate.
 * Returns the number of fill chunks, or, with nothing queued, SUBMIT_CLOSED / SUBMIT_INVALID /
 * GATE_UNSUPPORTED / GATE_TOO_BIG / GATE_OTHER_STREAM. A CUDA error of the copies lands in
 * status[ST_CUDA] (they may then be partly issued: the caller must not use the destinations). */
int64_t mo_gate_submit(mo_pool *p, const mo_piece *in, size_t n, size_t chunk_bytes, size_t group_bytes,
                       void *stream, int64_t *status, void *event) {
    if (!p || !status || (n && !in) || chunk_bytes == 0) return SUBMIT_INVALID;
    if (!p->g_base || !p->g_nthreads) return GATE_UNSUPPORTED;
    uint64_t t_enter = now_ns();
    uint64_t span = 0, cap = 0;
    for (size_t i = 0; i < n; i++) {
        span = ((span + GATE_ALIGN - 1) & ~(uint64_t)(GATE_ALIGN - 1)) + in[i].n;
        uint64_t q = in[i].n / chunk_bytes;
        if (q > UINT32_MAX || (cap += q + 2) > UINT32_MAX) return SUBMIT_INVALID;
    }
    if (span > p->g_size) return GATE_TOO_BIG; /* again below, with the groups' padding */
    /* the groups: [first[k], first[k + 1]) of in */
    size_t *first = malloc((n + 2) * sizeof(size_t));
    int ng = 0;
    if (!first) return SUBMIT_INVALID;
    for (size_t i = 0, acc = 0; i < n; i++) {
        if (i == 0 || (group_bytes && acc >= group_bytes)) { first[ng++] = i; acc = 0; }
        acc += in[i].n;
    }
    first[ng] = n;
    gbatch **g = calloc((size_t)(ng ? ng : 1), sizeof(*g));
    uint64_t *gspan = calloc((size_t)(ng ? ng : 1), sizeof(uint64_t));
    gparent *par = calloc(1, sizeof(*par));
    uint64_t total = 0, nc = 0;
    int bad = !g || !gspan || !par;
    for (int k = 0; k < ng && !bad; k++) {
        g[k] = gplan(p, in + first[k], first[k + 1] - first[k], chunk_bytes, &gspan[k]);
        gspan[k] = (gspan[k] + GATE_GRANULE - 1) & ~(uint64_t)(GATE_GRANULE - 1);
        bad = !g[k];
        if (!bad) { total += gspan[k]; nc += g[k]->nchunks; }
    }
    free(first);
    if (bad || total > p->g_size) {
        if (g) gbatch_free_unqueued(g, ng);
        free(gspan);
        free(par);
        return bad ? SUBMIT_INVALID : GATE_TOO_BIG;
    }
    status[ST_CHUNKS] = (int64_t)nc;
    pthread_mutex_lock(&p->mu);
    int refused = p->closing ? SUBMIT_CLOSED : (p->g_seq && p->g_stream != stream) ? GATE_OTHER_STREAM : 0;
    if (refused || nc == 0) {
        pthread_mutex_unlock(&p->mu);
        gbatch_free_unqueued(g, ng);
        free(gspan);
        free(par);
        if (refused) return refused;
        __atomic_store_n(&status[ST_ISSUED], 1, __ATOMIC_RELEASE);
        return 0;
    }
    p->g_stream = stream;
    uint64_t start = p->g_head;
    if (start + total > p->g_size) start = 0; /* wrap: the batch's range stays contiguous */
    p->g_head = start + total;
    par->status = status;
    par->left = 0;
    uint64_t at = start;
    for (int k = 0; k < ng; k++) {
        gbatch *b = g[k];
        if (!b->nchunks) { at += gspan[k]; continue; } /* only empty pieces: nothing to gate */
        uint64_t seq = ++p->g_seq, wait_seq = 0;
        for (uint64_t q = at / p->g_granule; q * p->g_granule < at + gspan[k]; q++) {
            if (p->g_owner[q] > wait_seq) wait_seq = p->g_owner[q];
            p->g_owner[q] = seq;
        }
        for (uint32_t i = 0; i < b->npieces; i++) b->pieces[i].off += at;
        at += gspan[k];
        b->seq = seq;
        b->wait_seq = wait_seq;
        b->parent = par;
        par->left++;
        b->refs = 3; /* its fill's end, its gate, and this call until its copies are issued */
        p->g_gates_pending++;
        if (p->g_tail_q) p->g_tail_q->next = b; else p->g_head_q = b;
        p->g_tail_q = b;
    }
    p->st_g_batches++;
    pthread_cond_broadcast(&p->g_work_cv);
    pthread_mutex_unlock(&p->mu);
    free(gspan);

    char *base = p->g_base;
    int cuda = 0, launched = 0; /* groups [0, launched) were handled below */
    for (int k = 0; k < ng && !cuda; k++, launched = k) {
        gbatch *b = g[k];
        if (!b->nchunks) continue;
        if (p->launch_host_func(stream, gate_fn, b)) {
            /* no gate: wait for the fill here, then its copies below are ordered after it. No gate
             * marks the earlier groups complete either: wait for them here (same stream), else a
             * fill that reuses their bytes would wait for a gate that may never come */
            int rec = p->g_last_event ? p->event_record(p->g_last_event, stream) : 1;
            if (!rec) p->event_sync(p->g_last_event);
            pthread_mutex_lock(&p->mu);
            if (!rec && b->seq - 1 > p->g_released) {
                p->g_released = b->seq - 1;
                pthread_cond_broadcast(&p->g_rel_cv);
            }
            while (!b->filled) pthread_cond_wait(&p->done_cv, &p->mu);
            p->g_gates_pending--;
            p->st_g_ungated++;
            if (p->g_gates_pending == 0) pthread_cond_broadcast(&p->g_rel_cv);
            gbatch_unref(b); /* the gate's reference */
            pthread_mutex_unlock(&p->mu);
        }
        const planned_piece *pc = b->pieces;
        for (uint32_t i = 0; i < b->npieces && !cuda;) {
            uint64_t dst = pc[i].dst, off = pc[i].off, len = pc[i].n;
            uint32_t j = i + 1; /* coalesce the cuts of one piece: contiguous on both sides */
            while (j < b->npieces && pc[j].dst == dst + len && pc[j].off == off + len) len += pc[j++].n;
            cuda = p->memcpy_async((void *)(uintptr_t)dst, base + off, len, H2D, stream);
            i = j;
        }
    }
    /* the events are recorded after a failed copy too: they mark the point after the copies that
     * were issued, which still run and write their destinations (the caller keeps those alive
     * until the event completes) and read the arena (destroy waits for the last event) */
    int rec = event ? p->event_record(event, stream) : 0;
    if (p->g_last_event && !p->event_record(p->g_last_event, stream))
        __atomic_store_n(&p->g_event_recorded, 1, __ATOMIC_RELAXED);
    if (!cuda) cuda = rec;
    if (cuda) status[ST_CUDA] = cuda; /* the caller still owns status: it checks this on return */
    if (launched < ng) pthread_mutex_lock(&p->mu); /* the error path below waits under mu */
    for (int k = 0; k < ng; k++) {
        gbatch *b = g[k];
        if (!b->nchunks) { gbatch_free(b); continue; } /* never queued */
        if (k >= launched) {
            /* a copy error stopped the loop before this group's gate: nothing will open it. Its
             * fill must end before the call returns (a later batch may reuse its arena bytes as
             * soon as a later gate starts), then it is dropped like a gate that ran */
            while (!b->filled) pthread_cond_wait(&p->done_cv, &p->mu);
            p->g_gates_pending--;
            if (p->g_gates_pending == 0) pthread_cond_broadcast(&p->g_rel_cv);
            __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL); /* the gate's (this call still holds its own) */
        }
        gbatch_unref(b); /* this call's reference: the plan was read */
    }
    if (launched < ng) pthread_mutex_unlock(&p->mu);
    free(g);
    __atomic_add_fetch(&p->st_g_submit_ns, now_ns() - t_enter, __ATOMIC_RELAXED);
    return (int64_t)nc;
}

/* Fill pieces in[0, n) (src: an address in a mapping, dst: an offset in ``base``, n bytes: one fill
 * chunk each) with the stream-ordered batches' threads, from any thread, with no CUDA call and no
 * wait for device work (the async step's stream callback calls it: csrc/async_step.c). ``base`` is
 * the caller's own pinned buffer, not the arena, so no gated batch's bytes are touched and no gate
 * is waited for. ``flags`` (may be NULL): flags[i] is stored (release) once piece i is there: 1,
 * or 2 if its read failed or the pool closed. ``movsb``: 1 cached stores (the device reads the
 * bytes right after: they may still be in the last-level cache), 0 streaming stores, -1 the pool's
 * rule. Returns a handle for mo_fill_finish, or NULL (no ordered threads, out of memory, or the
 * pool is closing: then every flag is 2). */
void *mo_fill_queue(mo_pool *p, char *base, const mo_piece *in, size_t n, uint64_t *flags, int movsb) {
    if (!p || !base || !n || !in || !p->g_nthreads) goto refuse;
    gbatch *b = calloc(1, sizeof(*b));
    gparent *par = calloc(1, sizeof(*par) + ST_GATED_LEN * sizeof(int64_t));
    planned_piece *pieces = malloc(n * sizeof(*pieces));
    chunk *chunks = malloc(n * sizeof(*chunks));
    if (!b || !par || !pieces || !chunks) { free(b); free(par); free(pieces); free(chunks); goto refuse; }
    for (size_t i = 0; i < n; i++) {
        pieces[i] = (planned_piece){in[i].src, 0, in[i].n, in[i].dst};
        chunks[i] = (chunk){(uint32_t)i, 1};
    }
    b->p = p;
    b->pieces = pieces;
    b->chunks = chunks;
    b->npieces = b->nchunks = (uint32_t)n;
    b->base = base;
    b->flags = flags;
    b->movsb = movsb;
    b->parent = par;
    b->refs = 2; /* its fill's end and mo_fill_finish */
    par->status = (int64_t *)(par + 1); /* freed with par, after the fill; finish reads b's copy */
    par->left = 1;
    pthread_mutex_lock(&p->mu);
    if (p->closing) {
        pthread_mutex_unlock(&p->mu);
        gbatch_free(b);
        free(par);
        goto refuse;
    }
    if (p->g_tail_q) p->g_tail_q->next = b; else p->g_head_q = b;
    p->g_tail_q = b;
    p->st_g_fill_waits++;
    pthread_cond_broadcast(&p->g_work_cv);
    pthread_mutex_unlock(&p->mu);
    return b;
refuse:
    for (size_t i = 0; flags && i < n; i++) __atomic_store_n(&flags[i], 2, __ATOMIC_RELEASE);
    return NULL;
}

/* Wait for a queued fill's end (CPU work only) and free it: 0, ERR_FAULT (*fault: the address whose
 * read raised SIGBUS) or ERR_CANCELLED. */
int mo_fill_finish(mo_pool *p, void *handle, uint64_t *fault) {
    gbatch *b = (gbatch *)handle;
    if (fault) *fault = 0;
    if (!b) return ERR_CANCELLED;
    pthread_mutex_lock(&p->mu);
    while (!b->filled) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    int err = b->fill_err;
    if (fault) *fault = b->fill_fault;
    gbatch_unref(b);
    return err;
}

/* under no lock: wait up to ``seconds`` for every launched gate to have run; 1 if they all did */
static int gates_drained(mo_pool *p, int seconds) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += seconds;
    pthread_mutex_lock(&p->mu);
    int r = 0;
    while (p->g_gates_pending && r == 0) r = pthread_cond_timedwait(&p->g_rel_cv, &p->mu, &until);
    int ok = p->g_gates_pending == 0;
    pthread_mutex_unlock(&p->mu);
    return ok;
}

/* stream-ordered batches: batches, bytes filled, fill_ns, gates run, gates that waited for their
 * fill, ns they waited (the stream's stall), arena bytes, fill threads, batches without a gate,
 * ns spent in mo_gate_submit */
void mo_gate_stats(mo_pool *p, uint64_t *out) {
    pthread_mutex_lock(&p->mu);
    out[0] = p->st_g_batches; out[1] = p->st_g_bytes; out[2] = p->st_g_fill_ns;
    out[3] = p->st_g_gates; out[4] = p->st_g_gates_waited; out[5] = p->st_g_gate_wait_ns;
    out[6] = p->g_size; out[7] = (uint64_t)p->g_nthreads; out[8] = p->st_g_ungated;
    out[9] = __atomic_load_n(&p->st_g_submit_ns, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&p->mu);
}

/* --- a CPU stand-in for the CUDA stream and events, so the pool runs without a GPU -----------
 * One thread executes the stream's copies in order (after ``delay_us`` each: tests use it to make
 * early slot reuse visible). An event records how many copies were queued before it; it is
 * complete once the stream has executed that many. Events recorded on a stream hold a reference
 * to it: a ticket's event outlives its engine (query / synchronize after close), so the stream's
 * memory goes with its last reference, its thread at destroy. */
typedef struct fake_op {
    struct fake_op *next;
    void *dst;
    const void *src;
    size_t n;
    fn_host fn; /* a host function (cudaLaunchHostFunc): called instead of the copy */
    void *arg;
} fake_op;
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv, done_cv;
    fake_op *head, *tail;
    uint64_t queued, executed;
    unsigned delay_us;
    int closing;
    int refs;                         /* the creator's + one per event last recorded here */
    unsigned fail_copy, fail_record, fail_launch;  /* test hook: the n-th next call fails (0: none) */
    int fail_code;
    pthread_t thread;
} fake_stream;
typedef struct { fake_stream *s; uint64_t target; } fake_event;

static void fake_stream_unref(fake_stream *s) {
    if (!s || __atomic_sub_fetch(&s->refs, 1, __ATOMIC_ACQ_REL)) return;
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->done_cv);
    free(s);
}

/* under s->mu: 1 if this call is the one the test hook should fail */
static int fake_fail_now(unsigned *countdown) {
    return *countdown && --*countdown == 0;
}

static void *fake_stream_main(void *arg) {
    fake_stream *s = (fake_stream *)arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->closing) pthread_cond_wait(&s->cv, &s->mu);
        fake_op *op = s->head;
        if (!op) break;
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        if (op->fn) {
            op->fn(op->arg);
        } else {
            if (s->delay_us) usleep(s->delay_us);
            memcpy(op->dst, op->src, op->n);
        }
        free(op);
        pthread_mutex_lock(&s->mu);
        s->executed++;
        pthread_cond_broadcast(&s->done_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

void *mo_fake_stream_create(unsigned delay_us) {
    fake_stream *s = calloc(1, sizeof(*s));
    if (!s) return NULL;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->done_cv, NULL);
    s->delay_us = delay_us;
    s->refs = 1;
    if (pthread_create(&s->thread, NULL, fake_stream_main, s)) { fake_stream_unref(s); return NULL; }
    return s;
}

/* Test hook: the ``nth`` next memcpy_async (what 0), event_record (what 1) or launch_host_func
 * (what 2) returns ``code``. */
void mo_fake_stream_fail(void *stream, int what, unsigned nth, int code) {
    fake_stream *s = (fake_stream *)stream;
    pthread_mutex_lock(&s->mu);
    if (what == 0) s->fail_copy = nth; else if (what == 1) s->fail_record = nth; else s->fail_launch = nth;
    s->fail_code = code;
    pthread_mutex_unlock(&s->mu);
}

void mo_fake_stream_destroy(void *stream) {
    fake_stream *s = (fake_stream *)stream;
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->closing = 1; /* the thread drains what is queued first */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    fake_stream_unref(s);
}

static int fake_enqueue(fake_stream *s, fake_op *op, unsigned *countdown);

int mo_fake_memcpy_async(void *dst, const void *src, size_t n, int kind, void *stream) {
    (void)kind;
    fake_stream *s = (fake_stream *)stream;
    fake_op *op = malloc(sizeof(*op));
    if (!op) return 2; /* cudaErrorMemoryAllocation */
    op->next = NULL; op->dst = dst; op->src = src; op->n = n; op->fn = NULL; op->arg = NULL;
    return fake_enqueue(s, op, &s->fail_copy);
}

/* cudaLaunchHostFunc: ``fn(arg)`` runs on the stream's thread in stream order (test hook: what 2 of
 * mo_fake_stream_fail fails the n-th next launch) */
int mo_fake_launch_host_func(void *stream, fn_host fn, void *arg) {
    fake_stream *s = (fake_stream *)stream;
    fake_op *op = calloc(1, sizeof(*op));
    if (!op) return 2;
    op->fn = fn;
    op->arg = arg;
    return fake_enqueue(s, op, &s->fail_launch);
}

static int fake_enqueue(fake_stream *s, fake_op *op, unsigned *countdown) {
    pthread_mutex_lock(&s->mu);
    if (fake_fail_now(countdown)) {
        int code = s->fail_code;
        pthread_mutex_unlock(&s->mu);
        free(op);
        return code;
    }
    if (s->tail) s->tail->next = op; else s->head = op;
    s->tail = op;
    s->queued++;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int mo_fake_event_create(void **ev, unsigned flags) {
    (void)flags;
    *ev = calloc(1, sizeof(fake_event));
    return *ev ? 0 : 2;
}

int mo_fake_event_record(void *ev, void *stream) {
    fake_event *e = (fake_event *)ev;
    fake_stream *s = (fake_stream *)stream;
    pthread_mutex_lock(&s->mu);
    if (fake_fail_now(&s->fail_record)) {
        int code = s->fail_code;
        pthread_mutex_unlock(&s->mu);
        return code;
    }
    e->target = s->queued;
    fake_stream *old = e->s;
    if (old != s) __atomic_add_fetch(&s->refs, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&e->s, s, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&s->mu);
    if (old != s) fake_stream_unref(old); /* an event is not re-recorded while another thread waits on it */
    return 0;
}

int mo_fake_event_sync(void *ev) {
    fake_event *e = (fake_event *)ev;
    fake_stream *s = __atomic_load_n(&e->s, __ATOMIC_ACQUIRE);
    if (!s) return 0;
    pthread_mutex_lock(&s->mu);
    while (s->executed < e->target) pthread_cond_wait(&s->done_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int mo_fake_event_done(void *ev);

/* cudaEventQuery: 0 (cudaSuccess) if complete, 600 (cudaErrorNotReady) if not yet */
int mo_fake_event_query(void *ev) {
    return mo_fake_event_done(ev) ? 0 : 600;
}

/* 1 if complete (cudaSuccess semantics), 0 if not yet */
int mo_fake_event_done(void *ev) {
    fake_event *e = (fake_event *)ev;
    fake_stream *s = __atomic_load_n(&e->s, __ATOMIC_ACQUIRE);
    if (!s) return 1;
    pthread_mutex_lock(&s->mu);
    int done = s->executed >= e->target;
    pthread_mutex_unlock(&s->mu);
    return done;
}

int mo_fake_event_destroy(void *ev) {
    if (!ev) return 0;
    fake_stream_unref(((fake_event *)ev)->s);
    free(ev);
    return 0;
}
