/* The decode step decided in a stream callback: the launching thread never waits for the router
 * (mmap_offload/async_step.py wraps it; built into mo_native with route_step.c and copy_pool.c).
 *
 * route_step.c's mo_step_run copies a layer's routed ids to the host and waits for them, so vLLM's
 * launching thread stops at every MoE layer until the device has caught up with it: with eager
 * vLLM's ~1.5 ms of host work per layer, the device then idles while the thread launches, and the
 * thread idles while the device runs (BENCHMARKS.md, session 9). Here the thread only enqueues,
 * on the layer's stream, three things that know nothing yet:
 *
 *   1. cudaMemcpyAsync(job.ids <- the router's ids)        device -> pinned job area
 *   2. cudaLaunchHostFunc(async_cb, job)                   runs when the stream reaches it
 *   3. the copy kernel (job.desc, staging)                 pinned -> the pool's slots, slot ids
 *
 * and goes on launching. When the stream reaches the callback, the ids are in host memory; the
 * callback makes mo_step_run's decisions on them (distinct experts, hits, misses, the misses' slots
 * by the pool's policy, bit for bit: the same helpers) and commits them, writes the kernel's items
 * (staging offset, slot address, bytes per 256 KiB piece) and slot ids, and queues the misses' reads
 * into a pinned staging buffer of its own with the copy pool's fill threads (mo_fill_queue: no CUDA
 * call, no wait). It returns at once. The threads flag each piece when its bytes are in staging;
 * the kernel copies each flagged piece into its slot (the device reads pinned memory in place, as
 * UVA does), so the copy of one piece overlaps the reading of the next, and writes the slot ids
 * where the MoE kernel reads them.
 *
 * Why the staging buffer and the job areas may be reused without tracking: everything runs on one
 * stream, so a callback starts only after the previous job's kernel finished, and that kernel
 * waited for every piece of its fill. Host-side job fields are reused once their callback ran
 * (mo_async_run waits for that; 32 jobs are 4 steps of an 8-layer model, and every step ends with a
 * wait of its own). Nothing on the device waits for device work, nothing on a CPU thread waits for
 * the device: no cycle can form.
 *
 * Errors never serve wrong bytes silently: a piece whose read fails (SIGBUS reading the mapping, the
 * pool closing) is flagged failed and not copied; the next callback, or mo_async_wait for the last
 * job, finishes the fill (harvest), forgets the slots that job made resident and records the error:
 * the step must fail before sampling (mo_async_wait returns it). A kernel that waits 60 s for a
 * flag gives up the same way. A call that breaks the launch-time promise (more distinct experts
 * than slots, an expert not checked or without a source) changes nothing and fails the step: the
 * caller keeps the promise, this only refuses.
 *
 * On the CPU the stream is the copy pool's stand-in (mo_fake_*) and the "kernel" a host function
 * doing the same copies, so the decisions and bytes are tested without a GPU. */
#define _GNU_SOURCE
#include "route_step.h"
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*fn_host)(void *arg);
typedef int (*fn_launch_host_func)(void *stream, fn_host fn, void *arg);
typedef int (*fn_cu_launch)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned smem, void *stream, void **params, void **extra);

/* copy_pool.c */
typedef struct { uint64_t src, dst, n; } fill_piece;
void *mo_fill_queue(void *p, char *base, const fill_piece *in, size_t n, uint64_t *flags);
int mo_fill_finish(void *p, void *handle, uint64_t *fault);

enum { AJ_JOBS = 32 };
/* a job's words (pinned; the copy kernel reads them, and writes D_KERR):
 *   D_HEAD words: items, ids, id size, slot ids' device address, max items, cap, kernel error
 *   3 * max items: (staging offset, device address, bytes) per item (a fill chunk)
 *   cap: the slot ids (int64)
 *   max items: a flag per item, stored by the fill threads once its bytes are in staging
 *   then the routed ids (cap of them, 8 bytes each at most), copied there by the stream */
enum { D_NPIECES = 0, D_NK, D_IDSIZE, D_SLOTDEV, D_MAXPIECES, D_CAP, D_KERR, D_HEAD = 8 };
enum { A_ERR_NONE = 0, A_ERR_FILL = 1, A_ERR_PROMISE = 2, A_ERR_LAUNCH = 3, A_ERR_KERNEL = 4 };
/* mo_async_stats words */
enum { AS_CALLS, AS_HITS, AS_MISSES, AS_EVICTIONS, AS_HINT_USED, AS_HINT_WASTED, AS_MISS_BYTES, AS_FILL_NS,
       AS_CB_NS, AS_WAIT_NS, AS_WAITS, AS_ENQ, AS_USED, AS_FILLS, AS_LEN };

typedef struct mo_async mo_async;
typedef struct {
    mo_async *a;
    mo_step *st;
    int64_t nk, id_size;
    uint64_t *desc; /* pinned */
    uint64_t desc_dev;
    uint64_t *flags; /* pinned, in desc's area */
    void *ids;      /* pinned */
    void *fill;     /* its fill in flight (mo_fill_queue), finished by the next callback or a wait */
    int64_t nnew, *new_pairs; /* the (expert, slot) it made resident: forgotten if the fill fails */
} mo_ajob;

struct mo_async {
    fn_memcpy_async memcpy_async;
    fn_launch_host_func launch_host_func;
    fn_cu_launch cu_launch; /* NULL: the CPU stand-in, the copies run in a host function */
    void *kernel;           /* CUfunction */
    void *pool;
    char *staging;          /* pinned, host address */
    uint64_t staging_dev;   /* its device address */
    uint64_t staging_bytes;
    uint64_t chunk_bytes;
    int64_t max_pieces, cap;
    unsigned grid, block;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t enq, done;
    int64_t err, err_li, fault; /* the first failure since the last mo_async_wait */
    mo_ajob *inflight;      /* the last job whose fill was queued and not finished yet */
    uint64_t stats[AS_LEN];
    mo_ajob jobs[AJ_JOBS];
};

static uint64_t ns_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

int64_t mo_async_job_bytes(int64_t max_pieces, int64_t cap) { /* pinned bytes of one job */
    return (int64_t)(8 * (D_HEAD + 3 * max_pieces + cap + max_pieces) + 8 * cap);
}

/* jobmem: pinned, AJ_JOBS * mo_async_job_bytes; jobmem_dev: its device address (UVA: the same) */
mo_async *mo_async_create(void *memcpy_async, void *launch_host_func, void *cu_launch, void *kernel, void *pool,
                          char *staging, uint64_t staging_dev, uint64_t staging_bytes, uint64_t chunk_bytes,
                          int64_t max_pieces, int64_t cap, char *jobmem, uint64_t jobmem_dev, int64_t grid,
                          int64_t block) {
    if (!memcpy_async || !launch_host_func || !pool || !staging || !jobmem || max_pieces < 1 || cap < 1 ||
        !chunk_bytes || (cu_launch && !kernel))
        return NULL;
    mo_async *a = calloc(1, sizeof(*a));
    if (!a) return NULL;
    a->memcpy_async = (fn_memcpy_async)memcpy_async;
    a->launch_host_func = (fn_launch_host_func)launch_host_func;
    a->cu_launch = (fn_cu_launch)cu_launch;
    a->kernel = kernel;
    a->pool = pool;
    a->staging = staging;
    a->staging_dev = staging_dev;
    a->staging_bytes = staging_bytes;
    a->chunk_bytes = chunk_bytes;
    a->max_pieces = max_pieces;
    a->cap = cap;
    a->grid = (unsigned)(grid > 0 ? grid : 64);
    a->block = (unsigned)(block > 0 ? block : 512);
    int64_t jb = mo_async_job_bytes(max_pieces, cap);
    for (int i = 0; i < AJ_JOBS; i++) {
        mo_ajob *j = &a->jobs[i];
        j->a = a;
        j->desc = (uint64_t *)(jobmem + (size_t)i * (size_t)jb);
        j->desc_dev = jobmem_dev + (uint64_t)i * (uint64_t)jb;
        j->flags = j->desc + D_HEAD + 3 * max_pieces + cap;
        j->ids = (char *)(j->flags + max_pieces);
        memset(j->desc, 0, (size_t)jb);
        j->desc[D_MAXPIECES] = (uint64_t)max_pieces;
        j->desc[D_CAP] = (uint64_t)cap;
        j->new_pairs = malloc((size_t)(2 * max_pieces) * sizeof(int64_t));
        if (!j->new_pairs) {
            for (int k = 0; k < i; k++) free(a->jobs[k].new_pairs);
            free(a);
            return NULL;
        }
    }
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    return a;
}

/* Only once every enqueued callback ran (mo_async_wait) and the stream is done with the jobs. */
void mo_async_destroy(mo_async *a) {
    if (!a) return;
    for (int i = 0; i < AJ_JOBS; i++) free(a->jobs[i].new_pairs);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    free(a);
}

static void fail(mo_async *a, int64_t err, int64_t li, uint64_t fault) { /* under mu */
    if (a->err) return;
    a->err = err;
    a->err_li = li;
    a->fault = (int64_t)fault;
}

/* Forget the (expert, slot) pairs job j made resident where the slot still holds them: their bytes
 * never arrived (a failed or refused fill, a kernel that gave up). */
static void forget_new(mo_step *st, const mo_ajob *j) {
    for (int64_t i = 0; i < j->nnew; i++) {
        int64_t e = j->new_pairs[2 * i], s = j->new_pairs[2 * i + 1];
        if (st->owner_li[s] == st->li && st->owner_e[s] == e) {
            st->lut[e] = -1;
            st->owner_li[s] = st->owner_e[s] = -1;
            st->used[s] = st->hinted[s] = 0;
        }
    }
}

/* The end of job j's fill (CPU work only; its kernel, if it ran, has waited for every item). A
 * failed read, or a kernel that gave up waiting, forgets the slots the job made resident (their
 * bytes are not the experts') and records the error: the step must fail. No lock: only the stream's
 * callbacks and mo_async_wait (once every callback ran) call it. */
static void harvest(mo_async *a, mo_ajob *j) {
    if (!j || !j->fill) return;
    uint64_t fault = 0;
    int rc = mo_fill_finish(a->pool, j->fill, &fault);
    j->fill = NULL;
    int64_t kerr = (int64_t)__atomic_load_n(&j->desc[D_KERR], __ATOMIC_ACQUIRE);
    if (!rc && !kerr) return;
    forget_new(j->st, j);
    pthread_mutex_lock(&a->mu);
    fail(a, rc ? A_ERR_FILL : A_ERR_KERNEL, j->st->li, rc ? fault : (uint64_t)kerr);
    pthread_mutex_unlock(&a->mu);
}

/* The callback: mo_step_run's steps 2-4, 6-7 on the ids the stream copied; the misses' fill is
 * queued, not waited for: the kernel copies each item once its flag says it is in staging. */
static void async_cb(void *arg) {
    mo_ajob *j = (mo_ajob *)arg;
    mo_async *a = j->a;
    mo_step *st = j->st;
    uint64_t t0 = ns_now();
    harvest(a, a->inflight); /* the previous job's kernel ran: its fill is over */
    a->inflight = NULL;
    uint64_t fill_ns = ns_now() - t0;
    int64_t E = st->E, S = st->S, T = st->T, nk = j->nk, isz = j->id_size;
    int64_t out[OUT_HEAD];
    memset(out, 0, sizeof(out));
    uint64_t *desc = j->desc, *pc = desc + D_HEAD, *slot_ids = desc + D_HEAD + 3 * a->max_pieces;
    int64_t err = A_ERR_NONE;
    uint8_t mark[MAX_EXPERTS], prot[MAX_EXPERTS];
    int64_t used[MAX_EXPERTS], miss[MAX_EXPERTS], vic[MAX_EXPERTS], nu = 0, nm = 0, nh = 0, np = 0;
    uint64_t bytes = 0;
    memset(mark, 0, (size_t)E);
    memset(prot, 0, (size_t)S);
    desc[D_KERR] = 0;
    j->nnew = 0;
    for (int64_t i = 0; i < nk && !err; i++) {
        int64_t v = mo_step_read_id(j->ids, i, isz);
        if (v < 0 || v >= E) err = A_ERR_PROMISE; else mark[v] = 1;
    }
    for (int64_t e = 0; e < E && !err; e++)
        if (mark[e]) used[nu++] = e;
    if (nu > S) err = A_ERR_PROMISE;
    for (int64_t i = 0; i < nu && !err; i++) {
        int64_t e = used[i], s = st->lut[e];
        if (s >= 0) { prot[s] = 1; nh++; continue; }
        if ((st->verified && !st->verified[e]) || !st->src[e]) err = A_ERR_PROMISE;
        miss[nm++] = e;
    }
    int64_t nowv = *st->now + 1;
    if (!err && nm && mo_step_victims(st, nowv, nm, prot, vic) < nm) err = A_ERR_PROMISE;
    fill_piece *fp = (fill_piece *)st->pieces;
    if (!err && nm) { /* the misses' items: fill chunks of staging, each copied to its slot by the kernel */
        uint64_t off = 0, ch = a->chunk_bytes;
        for (int64_t i = 0; i < nm && !err; i++)
            for (int64_t t = 0; t < T && !err; t++) {
                uint64_t n = st->sizes[t];
                off = (off + 255) & ~(uint64_t)255;
                if (off + n > a->staging_bytes) { err = A_ERR_PROMISE; break; }
                for (uint64_t c = 0; c < n; c += ch) {
                    uint64_t take = n - c < ch ? n - c : ch;
                    if (np >= a->max_pieces || np >= st->pieces_cap / 3) { err = A_ERR_PROMISE; break; }
                    fp[np] = (fill_piece){st->src[miss[i]] + st->offs[t] + c, off + c, take};
                    pc[3 * np] = off + c;
                    pc[3 * np + 1] = st->dst[vic[i] * T + t] + c;
                    pc[3 * np + 2] = take;
                    np++;
                }
                off += n;
                bytes += n;
            }
    }
    if (err == A_ERR_PROMISE) { /* nothing decided: the state is as before, the step fails */
        np = 0;
        for (int64_t i = 0; i < nk; i++) slot_ids[i] = 0;
    } else { /* commit (mo_step_run's step 6), before the fill: a failure forgets the new slots */
        *st->now = nowv;
        for (int64_t i = 0; i < nm; i++) mo_step_evict(st, vic[i], out);
        for (int64_t i = 0; i < nm; i++) {
            int64_t s = vic[i];
            st->owner_li[s] = st->li;
            st->owner_e[s] = miss[i];
            st->lut[miss[i]] = s;
            prot[s] = 1;
            j->new_pairs[2 * i] = miss[i];
            j->new_pairs[2 * i + 1] = s;
        }
        j->nnew = nm;
        mo_step_mark_used(st, prot, used, nu, nowv, out);
        for (int64_t i = 0; i < nk; i++)
            slot_ids[i] = (uint64_t)st->lut[mo_step_read_id(j->ids, i, isz)];
    }
    desc[D_NPIECES] = (uint64_t)np;
    desc[D_NK] = (uint64_t)nk;
    desc[D_IDSIZE] = (uint64_t)isz;
    desc[D_SLOTDEV] = (uint64_t)(uintptr_t)st->slot_dev;
    if (np) { /* flags before the queue: the threads store them as they finish */
        for (int64_t i = 0; i < np; i++) j->flags[i] = 0;
        j->fill = mo_fill_queue(a->pool, a->staging, fp, (size_t)np, j->flags);
        if (j->fill) a->inflight = j;
        else err = A_ERR_FILL; /* every flag is 2: the kernel copies nothing */
    }
    if (err == A_ERR_FILL) forget_new(st, j); /* queue refused (the pool is closing) */
    pthread_mutex_lock(&a->mu);
    if (err) fail(a, err, st->li, 0);
    if (err != A_ERR_PROMISE) {
        a->stats[AS_CALLS]++;
        a->stats[AS_HITS] += (uint64_t)nh;
        a->stats[AS_USED] += (uint64_t)nu;
        a->stats[AS_FILLS] += (uint64_t)(nm && !err);
        a->stats[AS_MISSES] += (uint64_t)(err ? 0 : nm);
        a->stats[AS_EVICTIONS] += (uint64_t)out[OUT_EVICTIONS];
        a->stats[AS_HINT_USED] += (uint64_t)out[OUT_HINT_USED];
        a->stats[AS_HINT_WASTED] += (uint64_t)out[OUT_HINT_WASTED];
        a->stats[AS_MISS_BYTES] += err ? 0 : bytes;
    }
    a->stats[AS_FILL_NS] += fill_ns;
    a->stats[AS_CB_NS] += ns_now() - t0;
    a->done++;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

/* The CPU stand-in of the copy kernel (a host function on the CPU stream, after the callback). */
static void cpu_kernel(void *arg) {
    mo_ajob *j = (mo_ajob *)arg;
    const uint64_t *desc = j->desc, *pc = desc + D_HEAD, *ids = desc + D_HEAD + 3 * desc[D_MAXPIECES];
    for (uint64_t i = 0; i < desc[D_NPIECES]; i++) {
        uint64_t f;
        while (!(f = __atomic_load_n(&j->flags[i], __ATOMIC_ACQUIRE))) sched_yield();
        if (f == 1) memcpy((void *)(uintptr_t)pc[3 * i + 1], j->a->staging + pc[3 * i], (size_t)pc[3 * i + 2]);
    }
    void *out = (void *)(uintptr_t)desc[D_SLOTDEV];
    for (uint64_t i = 0; i < desc[D_NK]; i++)
        if (desc[D_IDSIZE] == 4) ((int32_t *)out)[i] = (int32_t)ids[i]; else ((int64_t *)out)[i] = (int64_t)ids[i];
}

/* Enqueue layer ``st``'s step for the ``nk`` routed ids at ``ids`` (device, int32/int64) on
 * ``stream``. Returns 0, or a CUDA error code (> 0: then the stream may hold part of the job;
 * the step must fail, see mo_async_wait), or -1 for bad arguments (nothing enqueued). The caller
 * promises: nk <= the pool's slots and <= cap, every expert checked and with a source address,
 * no other step on this layer's arrays until mo_async_wait. */
int64_t mo_async_run(mo_async *a, mo_step *st, const void *ids, int64_t nk, int64_t id_size, void *stream) {
    if (!a || !st || nk < 0 || nk > a->cap || nk > st->S || (id_size != 4 && id_size != 8) || st->E > MAX_EXPERTS)
        return -1;
    pthread_mutex_lock(&a->mu);
    if (a->enq - a->done >= AJ_JOBS) { /* the job's host fields are still the callback's */
        uint64_t t0 = ns_now();
        while (a->enq - a->done >= AJ_JOBS) pthread_cond_wait(&a->cv, &a->mu);
        a->stats[AS_WAIT_NS] += ns_now() - t0;
        a->stats[AS_WAITS]++;
    }
    mo_ajob *j = &a->jobs[a->enq % AJ_JOBS];
    pthread_mutex_unlock(&a->mu);
    j->st = st;
    j->nk = nk;
    j->id_size = id_size;
    int err = nk ? a->memcpy_async(j->ids, ids, (size_t)(nk * id_size), D2H, stream) : 0;
    if (err) return err; /* nothing of this job is on the stream yet */
    err = a->launch_host_func(stream, async_cb, j);
    if (err) return err; /* the ids copy alone: harmless */
    pthread_mutex_lock(&a->mu);
    a->enq++;
    a->stats[AS_ENQ]++;
    pthread_mutex_unlock(&a->mu);
    if (a->cu_launch) {
        uint64_t desc_dev = j->desc_dev, staging_dev = a->staging_dev;
        void *params[] = {&desc_dev, &staging_dev};
        err = a->cu_launch(a->kernel, a->grid, 1, 1, a->block, 1, 1, 0, stream, params, NULL);
    } else {
        err = a->launch_host_func(stream, cpu_kernel, j);
    }
    if (err) { /* the callback will decide and commit, but no kernel copies: the step must fail */
        pthread_mutex_lock(&a->mu);
        fail(a, A_ERR_LAUNCH, st->li, (uint64_t)err);
        pthread_mutex_unlock(&a->mu);
    }
    return err;
}

/* Wait until every enqueued callback ran (no CUDA call: the device must reach them). Returns the
 * first error since the last call (0: none) and clears it; info[0..1]: its layer position and its
 * detail (the faulting address of a failed fill, the CUDA error of a failed launch). */
int64_t mo_async_wait(mo_async *a, int64_t *info) {
    pthread_mutex_lock(&a->mu);
    while (a->done < a->enq) pthread_cond_wait(&a->cv, &a->mu);
    mo_ajob *last = a->inflight; /* no callback runs now: this thread would have to enqueue it */
    a->inflight = NULL;
    pthread_mutex_unlock(&a->mu);
    uint64_t t0 = ns_now();
    harvest(a, last); /* its fill is CPU work: it ends without the device */
    pthread_mutex_lock(&a->mu);
    a->stats[AS_FILL_NS] += ns_now() - t0;
    int64_t err = a->err;
    if (info) { info[0] = a->err_li; info[1] = a->fault; }
    a->err = a->err_li = a->fault = 0;
    pthread_mutex_unlock(&a->mu);
    return err;
}

int64_t mo_async_pending(mo_async *a) {
    pthread_mutex_lock(&a->mu);
    int64_t n = a->enq - a->done;
    pthread_mutex_unlock(&a->mu);
    return n;
}

void mo_async_stats(mo_async *a, uint64_t *out) {
    pthread_mutex_lock(&a->mu);
    memcpy(out, a->stats, sizeof(a->stats));
    pthread_mutex_unlock(&a->mu);
}

int64_t mo_async_stats_len(void) { return AS_LEN; }
int64_t mo_async_jobs(void) { return AJ_JOBS; }

/* The (expert, slot) pairs the last enqueued job made resident, into out (2 per pair): their count.
 * Only once that job's callback ran (the CPU stand-in: after draining its stream). */
int64_t mo_async_last_pairs(mo_async *a, int64_t *out) {
    pthread_mutex_lock(&a->mu);
    mo_ajob *j = a->enq ? &a->jobs[(a->enq - 1) % AJ_JOBS] : NULL;
    int64_t n = j && a->done >= a->enq ? j->nnew : 0;
    if (n) memcpy(out, j->new_pairs, (size_t)(2 * n) * sizeof(int64_t));
    pthread_mutex_unlock(&a->mu);
    return n;
}
