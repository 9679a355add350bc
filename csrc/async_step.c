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
 * Sparse calls (mo_async_run_sparse: more routed ids than the pool has slots, decode at batch 8):
 * the layer's buffer gets exactly the routed experts, as route_step.c's mo_step_sparse does, and ids
 * pass unchanged. How many misses there will be is known only in the callback, and the staging
 * holds P experts, so the call is enqueued as K = ceil(ids / P) parts, each a callback and a kernel.
 * Part 0's callback decides everything (hits, misses, the admissions into the pool: mo_step_sparse's
 * rule, bit for bit) and writes every part's items; its kernel copies the hits from their slots
 * (device to device, items flagged at once) and the first P misses from staging into their rows
 * (and into their pool slot when admitted). Part k's callback runs after part k-1's kernel, so the
 * staging is free again: it queues the next P misses' reads. A part with nothing to do costs a
 * callback and an empty kernel.
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
void *mo_fill_queue(void *p, char *base, const fill_piece *in, size_t n, uint64_t *flags, int movsb);
int mo_fill_finish(void *p, void *handle, uint64_t *fault);

enum { AJ_JOBS = 128, AJ_MAX_T = 16 };
enum { HIT_CHUNK = 1 << 20 }; /* a sparse call's hit copies (device to device), per item */
#define ITEM_DEVICE (1ull << 63) /* item word 0: a device address to copy from, not a staging offset */
/* a job's words (pinned; the copy kernel reads them, and writes D_KERR):
 *   D_HEAD words: items, ids, id size, slot ids' device address (0: none), max items, cap, kernel error
 *   4 * max items: (staging offset | ITEM_DEVICE + address, device address, bytes, a second device
 *                  address or 0) per item (a fill chunk, or a piece of a hit's slot)
 *   cap: the slot ids (int64)
 *   max items: a flag per item, stored by the fill threads once its bytes are in staging
 *   then the routed ids (cap of them, 8 bytes each at most), copied there by the stream */
enum { D_NPIECES = 0, D_NK, D_IDSIZE, D_SLOTDEV, D_MAXPIECES, D_CAP, D_KERR, D_HEAD = 8 };
enum { A_ERR_NONE = 0, A_ERR_FILL = 1, A_ERR_PROMISE = 2, A_ERR_LAUNCH = 3, A_ERR_KERNEL = 4, A_ERR_HOST = 5 };
/* mo_async_stats words */
enum { AS_CALLS, AS_HITS, AS_MISSES, AS_EVICTIONS, AS_HINT_USED, AS_HINT_WASTED, AS_MISS_BYTES, AS_FILL_NS,
       AS_CB_NS, AS_WAIT_NS, AS_WAITS, AS_ENQ, AS_USED, AS_FILLS, AS_SPARSE, AS_SPARSE_HITS, AS_SPARSE_MISSES,
       AS_ADMITTED, AS_PARTS, AS_HYBRID, AS_HOST_EXPERTS, AS_HOST_ROWS, AS_HOST_NS, AS_HOST_WAIT_NS, AS_HOST_READY,
       AS_HOST_CALLS, AS_ENQ_NS, AS_LEN }; /* AS_ENQ_NS: the caller's (vLLM's launching thread's) time in
                                             * mo_async_run / run_sparse / mo_async_collect */

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
    fill_piece *fp; /* its fill's pieces (staging offsets), queued by its callback */
    int64_t nfp, first_fill; /* how many; the item of the first one */
    int64_t nnew, *new_pairs; /* the (expert, slot) it made resident: forgotten if the fill fails */
    /* sparse calls (rows[0] != 0): its call's parts, the layer buffer's tensors, the admission cap */
    int64_t parts, max_admit;
    uint64_t rows[AJ_MAX_T], stride[AJ_MAX_T];
    /* hybrid sparse calls (hy: part 0 of one): the host's sources [E][4] (w13, s13, w2, s2 addresses),
     * the call's token rows */
    int64_t hy, hy_rows;
    const uint64_t *hsrc;
} mo_ajob;

/* Hybrid: a sparse call's misses that are not admitted into the pool are split between the copy
 * path and host compute (host_kernel.c, called through function pointers: mo_host is another
 * library). One pinned area serves every call: the stream orders each call's copies into it (x,
 * router weights) after the previous call's collect, and its collect after its host job's start. */
typedef int (*fn_host_start)(void *h, int isa, const void *x, int xdt, int64_t x_rows, int64_t H, int64_t I,
                             const void *jobs, int njobs, void *out, int mode);
typedef int (*fn_host_wait)(void *h, int64_t *ns, int *ready);
typedef struct { /* host_kernel.c's mo_job_t (MO_HOST_ABI 2, checked by async_step.py): 10 words */
    const int64_t *rows;
    const float *weights;
    int64_t m;
    const void *w13, *s13, *w2, *s2;
    int32_t gs13, gs2, grouped13, grouped2, sdtype, pad;
} host_job;
typedef struct {
    fn_host_start start;
    fn_host_wait wait;
    void *pool;                      /* the mo_host pool (HostKernel's) */
    int isa, xdt, adapt;
    int64_t H, I, max_rows, xsz;
    int32_t gs13, gs2, grouped13, grouped2, sdtype;
    char *area;                      /* pinned: x [max_rows, H], out [max_rows, H], w [cap] f32, blk */
    uint64_t area_dev;               /* its device address (mapped), 0: not mapped (the copies by cudaMemcpy) */
    uint64_t x_off, out_off, w_off, blk_off; /* blk: masked weights [cap] f32, then the kernel's ids [cap] */
    int64_t *rows;                   /* [cap] the host jobs' rows */
    float *wts;                      /* [cap] their route weights */
    host_job *jobs;                  /* [cap] */
    double share;                    /* of a call's misses computed on the host (adapted by collects) */
    int64_t parts;                   /* a call's parts: 0 the fewest that hold its admissions (misses the
                                      * staging cannot take go to the host), -1 a plain call's, n > 0 n */
    int started;                     /* a host job runs that no collect waited for yet */
    int idle;                        /* the last call had misses for the host and gave it none */
    int64_t cenq, cdone;             /* collects enqueued / run */
} mo_hybrid;

struct mo_async {
    fn_memcpy_async memcpy_async;
    fn_launch_host_func launch_host_func;
    fn_cu_launch cu_launch; /* NULL: the CPU stand-in, the copies run in a host function */
    void *kernel;           /* CUfunction */
    void *gather, *add;     /* CUfunctions (mo_async_set_kernels; NULL: cudaMemcpy and the caller's add) */
    void *pool;
    char *staging;          /* pinned, host address */
    uint64_t staging_dev;   /* its device address */
    uint64_t staging_bytes;
    uint64_t chunk_bytes;
    int64_t max_pieces, cap;
    unsigned grid, block;
    int fill_movsb;         /* the fills' stores: 1 cached, 0 streaming, -1 by call (async_step.py) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t enq, done;
    int64_t err, err_li, fault; /* the first failure since the last mo_async_wait */
    mo_ajob *inflight;      /* the last job whose fill was queued and not finished yet */
    int64_t last_first, last_parts; /* the last call's first job (enq count) and its jobs */
    uint64_t stats[AS_LEN];
    mo_hybrid hy;                /* hy.start == NULL: no host compute (mo_async_set_host) */
    mo_ajob jobs[AJ_JOBS];
};

static uint64_t ns_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

int64_t mo_async_job_bytes(int64_t max_pieces, int64_t cap) { /* pinned bytes of one job */
    return (int64_t)(8 * (D_HEAD + 4 * max_pieces + cap + max_pieces) + 8 * cap);
}

/* jobmem: pinned, AJ_JOBS * mo_async_job_bytes; jobmem_dev: its device address (UVA: the same) */
mo_async *mo_async_create(void *memcpy_async, void *launch_host_func, void *cu_launch, void *kernel, void *pool,
                          char *staging, uint64_t staging_dev, uint64_t staging_bytes, uint64_t chunk_bytes,
                          int64_t max_pieces, int64_t cap, char *jobmem, uint64_t jobmem_dev, int64_t grid,
                          int64_t block, int64_t fill_movsb) {
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
    a->fill_movsb = fill_movsb < 0 ? -1 : fill_movsb ? 1 : 0;
    int64_t jb = mo_async_job_bytes(max_pieces, cap);
    for (int i = 0; i < AJ_JOBS; i++) {
        mo_ajob *j = &a->jobs[i];
        j->a = a;
        j->desc = (uint64_t *)(jobmem + (size_t)i * (size_t)jb);
        j->desc_dev = jobmem_dev + (uint64_t)i * (uint64_t)jb;
        j->flags = j->desc + D_HEAD + 4 * max_pieces + cap;
        j->ids = (char *)(j->flags + max_pieces);
        memset(j->desc, 0, (size_t)jb);
        j->desc[D_MAXPIECES] = (uint64_t)max_pieces;
        j->desc[D_CAP] = (uint64_t)cap;
        j->new_pairs = malloc((size_t)(2 * max_pieces) * sizeof(int64_t));
        j->fp = malloc((size_t)max_pieces * sizeof(fill_piece));
        if (!j->new_pairs || !j->fp) {
            for (int k = 0; k <= i; k++) { free(a->jobs[k].new_pairs); free(a->jobs[k].fp); }
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
    for (int i = 0; i < AJ_JOBS; i++) { free(a->jobs[i].new_pairs); free(a->jobs[i].fp); }
    free(a->hy.rows);
    free(a->hy.wts);
    free(a->hy.jobs);
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
    for (int64_t i = 0; i < j->nnew; i++) mo_step_forget(st, j->new_pairs[2 * i], j->new_pairs[2 * i + 1]);
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

/* Queue job j's fill (its pieces were written by a callback): the threads flag its items from
 * j->first_fill on. 0, or A_ERR_FILL where the pool refused it (closing: every flag is 2, the kernel
 * copies nothing; the slots the job made resident are forgotten). */
static int64_t queue_fill(mo_async *a, mo_ajob *j) {
    if (!j->nfp) return A_ERR_NONE;
    for (int64_t i = 0; i < j->nfp; i++) j->flags[j->first_fill + i] = 0; /* before the queue */
    int movsb = a->fill_movsb >= 0 ? a->fill_movsb : j->rows[0] != 0; /* auto: sparse calls' fills cached */
    j->fill = mo_fill_queue(a->pool, a->staging, j->fp, (size_t)j->nfp, j->flags + j->first_fill, movsb);
    if (j->fill) {
        a->inflight = j;
        return A_ERR_NONE;
    }
    forget_new(j->st, j);
    return A_ERR_FILL;
}

/* Every callback's start: the previous job's kernel ran, so its fill is over (harvest it). Returns
 * the time that took. */
static uint64_t cb_begin(mo_async *a, uint64_t t0) {
    harvest(a, a->inflight);
    a->inflight = NULL;
    return ns_now() - t0;
}

/* Every callback's end: its error, its timings, one more callback done. */
static void cb_end(mo_async *a, const mo_step *st, int64_t err, uint64_t t0, uint64_t fill_ns, int fills) {
    pthread_mutex_lock(&a->mu);
    if (err) fail(a, err, st->li, 0);
    a->stats[AS_FILLS] += (uint64_t)(fills && !err);
    a->stats[AS_FILL_NS] += fill_ns;
    a->stats[AS_CB_NS] += ns_now() - t0;
    a->done++;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

/* Misses' items from staging offset 0: each tensor of expert miss[i] cut into chunk_bytes pieces,
 * into pool slot slot_of[i]'s tensors, or (slot_of NULL: a sparse call) into the layer buffer's
 * rows (row[t] + e * stride[t]); the second destination is left 0 (sparse_cb patches in an admitted
 * miss's slot). Items go from item ``at`` on, pieces into j->fp. Returns the items written, or -1
 * where the job or the staging is too small (nothing is queued then). */
static int64_t miss_items(mo_async *a, mo_ajob *j, const mo_step *st, const int64_t *miss, int64_t nm,
                          const int64_t *slot_of, int64_t at) {
    uint64_t *pc = j->desc + D_HEAD, off = 0, ch = a->chunk_bytes;
    int64_t T = st->T, np = 0;
    for (int64_t i = 0; i < nm; i++)
        for (int64_t t = 0; t < T; t++) {
            uint64_t n = st->sizes[t];
            off = (off + 255) & ~(uint64_t)255;
            if (off + n > a->staging_bytes) return -1;
            uint64_t dst = slot_of ? st->dst[slot_of[i] * T + t] : j->rows[t] + (uint64_t)miss[i] * j->stride[t];
            for (uint64_t c = 0; c < n; c += ch) {
                uint64_t take = n - c < ch ? n - c : ch;
                if (at + np >= a->max_pieces) return -1;
                j->fp[np] = (fill_piece){st->src[miss[i]] + st->offs[t] + c, off + c, take};
                uint64_t *it = pc + 4 * (at + np);
                it[0] = off + c;
                it[1] = dst + c;
                it[2] = take;
                it[3] = 0;
                np++;
            }
            off += n;
        }
    j->nfp = np;
    j->first_fill = at;
    return np;
}

static void job_head(mo_ajob *j, int64_t items, int64_t nk, const mo_step *st) {
    uint64_t *desc = j->desc;
    desc[D_NPIECES] = (uint64_t)items;
    desc[D_NK] = (uint64_t)nk;
    desc[D_IDSIZE] = (uint64_t)j->id_size;
    desc[D_SLOTDEV] = nk ? (uint64_t)(uintptr_t)st->slot_dev : 0;
    desc[D_KERR] = 0;
}

/* The callback: mo_step_run's steps 2-4, 6-7 on the ids the stream copied; the misses' fill is
 * queued, not waited for: the kernel copies each item once its flag says it is in staging. */
static void async_cb(void *arg) {
    mo_ajob *j = (mo_ajob *)arg;
    mo_async *a = j->a;
    mo_step *st = j->st;
    uint64_t t0 = ns_now(), fill_ns = cb_begin(a, t0);
    int64_t S = st->S, nk = j->nk, isz = j->id_size;
    int64_t out[OUT_HEAD];
    memset(out, 0, sizeof(out));
    uint64_t *slot_ids = j->desc + D_HEAD + 4 * a->max_pieces;
    int64_t err = A_ERR_NONE;
    uint8_t prot[MAX_EXPERTS];
    int64_t used[MAX_EXPERTS], hit[MAX_EXPERTS], miss[MAX_EXPERTS], vic[MAX_EXPERTS], nm = 0, nh = 0, np = 0, bad;
    uint64_t bytes = 0;
    memset(prot, 0, (size_t)S);
    j->nnew = j->nfp = 0;
    int64_t nu = mo_step_distinct(st, j->ids, nk, isz, used, &bad);
    if (nu < 0 || nu > S || mo_step_split(st, used, nu, hit, &nh, miss, &nm) < 0) err = A_ERR_PROMISE;
    for (int64_t i = 0; i < nh && !err; i++) prot[st->lut[hit[i]]] = 1;
    int64_t nowv = *st->now + 1;
    if (!err && nm && mo_step_victims(st, nowv, nm, prot, vic) < nm) err = A_ERR_PROMISE;
    if (!err && nm) { /* the misses' items: fill chunks of staging, each copied to its slot by the kernel */
        np = miss_items(a, j, st, miss, nm, vic, 0);
        if (np < 0) err = A_ERR_PROMISE;
        for (int64_t t = 0; t < st->T; t++) bytes += st->sizes[t] * (uint64_t)nm;
    }
    if (err == A_ERR_PROMISE) { /* nothing decided: the state is as before, the step fails */
        np = j->nfp = 0;
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
    job_head(j, np, nk, st);
    if (!err) err = queue_fill(a, j);
    pthread_mutex_lock(&a->mu);
    if (err != A_ERR_PROMISE) {
        a->stats[AS_CALLS]++;
        a->stats[AS_HITS] += (uint64_t)nh;
        a->stats[AS_USED] += (uint64_t)nu;
        a->stats[AS_MISSES] += (uint64_t)(err ? 0 : nm);
        a->stats[AS_EVICTIONS] += (uint64_t)out[OUT_EVICTIONS];
        a->stats[AS_HINT_USED] += (uint64_t)out[OUT_HINT_USED];
        a->stats[AS_HINT_WASTED] += (uint64_t)out[OUT_HINT_WASTED];
        a->stats[AS_MISS_BYTES] += err ? 0 : bytes;
    }
    pthread_mutex_unlock(&a->mu);
    cb_end(a, st, err, t0, fill_ns, nm > 0);
}

/* Staging bytes of one expert (each tensor 256-aligned, as miss_items lays them out). */
static uint64_t staged_expert_bytes(const mo_step *st) {
    uint64_t b = 0;
    for (int64_t t = 0; t < st->T; t++) b = ((b + 255) & ~(uint64_t)255) + st->sizes[t];
    return (b + 255) & ~(uint64_t)255;
}

/* Misses one staging load holds: a sparse call's per part (0: not one expert). */
static int64_t staged_per_load(const mo_async *a, const mo_step *st) {
    uint64_t eb = staged_expert_bytes(st);
    return eb ? (int64_t)(a->staging_bytes / eb) : 0;
}

/* An admitted miss e, the c-th copied miss of its sparse call, also goes into pool slot s: its ppe
 * items (in part c / per) get the slot as second destination, and that part remembers the pair
 * (forgotten if its fill fails). */
static void admit_into(mo_async *a, mo_ajob **part, int64_t per, int64_t ppe, const mo_step *st, int64_t c, int64_t e,
                       int64_t s) {
    mo_ajob *pj = part[c / per];
    pj->new_pairs[2 * pj->nnew] = e;
    pj->new_pairs[2 * pj->nnew + 1] = s;
    pj->nnew++;
    uint64_t *ip = pj->desc + D_HEAD + 4 * (pj->first_fill + (c % per) * ppe);
    for (int64_t t = 0, q = 0; t < st->T; t++)
        for (uint64_t o = 0; o < st->sizes[t]; o += a->chunk_bytes, q++) ip[4 * q + 3] = st->dst[s * st->T + t] + o;
}

/* ---------------------------------------------------------------- hybrid (host compute of misses) */

static void host_wait_started(mo_async *a, int adapt) { /* the started host job's end; its counters */
    mo_hybrid *h = &a->hy;
    if (!h->started) return;
    uint64_t t0 = ns_now();
    int64_t ns = 0;
    int ready = 0;
    int rc = h->wait(h->pool, &ns, &ready);
    h->started = 0;
    pthread_mutex_lock(&a->mu);
    a->stats[AS_HOST_NS] += (uint64_t)(ns > 0 ? ns : 0);
    a->stats[AS_HOST_WAIT_NS] += ns_now() - t0;
    a->stats[AS_HOST_READY] += (uint64_t)(ready != 0);
    if (rc) fail(a, A_ERR_HOST, -1, (uint64_t)(rc < 0 ? -rc : rc));
    if (adapt && h->adapt) { /* the host was done first: it can take more; the stream waited for it: less */
        h->share += ready ? 1.0 / 32 : -1.0 / 32;
        h->share = h->share < 0 ? 0 : h->share > 1 ? 1 : h->share;
    }
    pthread_mutex_unlock(&a->mu);
}

/* The kernel's inputs of a hybrid call: its router weights with the host's (token, expert) pairs set
 * to 0, and its ids with those pairs' experts replaced by ``dummy`` (an expert whose row this call
 * fills: the kernel reads valid bytes and adds nothing). host_e[e]: expert e is computed on the host
 * (all 0: the call's weights and ids as they are). */
static void hybrid_blk(mo_async *a, const mo_ajob *j, const uint8_t *host_e, int64_t dummy) {
    mo_hybrid *h = &a->hy;
    int64_t nk = j->nk, isz = j->id_size;
    const float *w = (const float *)(h->area + h->w_off);
    float *wm = (float *)(h->area + h->blk_off);
    char *ids = h->area + h->blk_off + (uint64_t)((a->cap * 4 + 7) & ~7);
    for (int64_t i = 0; i < nk; i++) {
        int64_t e = mo_step_read_id(j->ids, i, isz);
        int host = e >= 0 && e < j->st->E && host_e[e];
        wm[i] = host ? 0.0f : w[i];
        if (isz == 4) ((int32_t *)ids)[i] = (int32_t)(host ? dummy : e); else ((int64_t *)ids)[i] = host ? dummy : e;
    }
}

/* A hybrid call's misses (sparse_cb, part 0): the admissions first (mo_step_admit over every miss,
 * as a plain sparse call takes them: admitted misses are always copied), then the share of the
 * others with the fewest tokens goes to the host, the rest is copied as a plain call copies its
 * misses (miss_items, parts of ``per``). At least one expert is copied or hit (the host's pairs read
 * its row). Starts the host job (x and out in the pinned area, out zeroed first). host_e: the
 * host's experts (by id); *na, *nhost: admitted, computed on the host. A refusal forgets the
 * admissions (A_ERR_PROMISE); a host job that cannot start fails the step (A_ERR_HOST). */
static int64_t hybrid_misses(mo_async *a, mo_ajob *j, mo_ajob **part, int64_t K, int64_t per, int64_t ppe,
                             int64_t nhit, const int64_t *used, int64_t nu, const int64_t *hit, int64_t nh,
                             const int64_t *miss, int64_t nm, uint8_t *host_e, int64_t *dummy, int64_t *na_out,
                             int64_t *nhost_out, int64_t *out) {
    mo_hybrid *h = &a->hy;
    mo_step *st = j->st;
    int64_t nk = j->nk, isz = j->id_size, n = j->hy_rows, k = nk / n;
    for (int64_t m = 0; m < nm; m++)
        for (int64_t q = 0; q < 4; q++)
            if (!j->hsrc[4 * miss[m] + q]) return A_ERR_PROMISE; /* nothing committed yet */
    int64_t adm[2 * MAX_EXPERTS], slot_of[MAX_EXPERTS], midx[MAX_EXPERTS], tok[MAX_EXPERTS];
    int64_t na = mo_step_admit(st, used, nu, hit, nh, miss, nm, j->max_admit, adm, out);
    for (int64_t m = 0; m < nm; m++) { slot_of[m] = -1; tok[m] = 0; }
    for (int64_t i = 0; i < na; i++) slot_of[adm[2 * i]] = adm[2 * i + 1];
    for (int64_t e = 0; e < st->E; e++) midx[e] = -1;
    for (int64_t m = 0; m < nm; m++) midx[miss[m]] = m;
    for (int64_t i = 0; i < nk; i++) {
        int64_t m = midx[mo_step_read_id(j->ids, i, isz)];
        if (m >= 0) tok[m]++;
    }
    /* the host's candidates: misses not admitted, fewest tokens first (then the lower index) */
    int64_t cand[MAX_EXPERTS], nc = 0;
    for (int64_t m = 0; m < nm; m++) {
        if (slot_of[m] >= 0) continue;
        int64_t q = nc++;
        while (q > 0 && tok[cand[q - 1]] > tok[m]) { cand[q] = cand[q - 1]; q--; }
        cand[q] = m;
    }
    pthread_mutex_lock(&a->mu);
    double share = h->share;
    pthread_mutex_unlock(&a->mu);
    int64_t nhost = (int64_t)(share * (double)nm + 0.5);
    if (nhost < nm - per * K) nhost = nm - per * K; /* what the call's parts cannot copy */
    if (nhost > nc) nhost = nc;
    if (nh == 0 && nhost >= nm) nhost = nm - 1;
    if (nhost < 0) nhost = 0;
    uint8_t is_host[MAX_EXPERTS];
    memset(is_host, 0, (size_t)nm);
    for (int64_t i = 0; i < nhost; i++) is_host[cand[i]] = 1;
    int64_t cm[MAX_EXPERTS], cpos[MAX_EXPERTS], ncm = 0;
    for (int64_t m = 0; m < nm; m++) {
        cpos[m] = is_host[m] ? -1 : ncm;
        if (!is_host[m]) cm[ncm++] = miss[m];
    }
    int64_t err = ncm > per * K ? A_ERR_PROMISE : A_ERR_NONE; /* more admissions than the parts hold */
    for (int64_t q = 0; q < K && !err; q++) {
        int64_t lo = q * per, hi = lo + per < ncm ? lo + per : ncm;
        if (lo >= hi) break;
        if (miss_items(a, part[q], st, cm + lo, hi - lo, NULL, q ? 0 : nhit) < 0) err = A_ERR_PROMISE;
    }
    if (err) {
        for (int64_t i = 0; i < na; i++) mo_step_forget(st, miss[adm[2 * i]], adm[2 * i + 1]);
        return err;
    }
    for (int64_t i = 0; i < na; i++) admit_into(a, part, per, ppe, st, cpos[adm[2 * i]], miss[adm[2 * i]], adm[2 * i + 1]);
    *na_out = na;
    *nhost_out = nhost;
    h->idle = nhost == 0 && nc > 0;
    *dummy = nh ? hit[0] : cm[0];
    if (!nhost) return A_ERR_NONE;
    /* the host's jobs: each host expert's tokens (a token routes to an expert once) and weights */
    const float *w = (const float *)(h->area + h->w_off);
    int64_t r = 0, nj = 0;
    for (int64_t m = 0; m < nm; m++) {
        if (!is_host[m]) continue;
        int64_t e = miss[m];
        host_e[e] = 1;
        host_job *J = &h->jobs[nj++];
        J->rows = h->rows + r;
        J->weights = h->wts + r;
        J->m = 0;
        for (int64_t t = 0; t < n; t++)
            for (int64_t c = 0; c < k; c++)
                if (mo_step_read_id(j->ids, t * k + c, isz) == e) {
                    h->rows[r] = t;
                    h->wts[r] = w[t * k + c];
                    r++;
                    J->m++;
                    break;
                }
        J->w13 = (const void *)(uintptr_t)j->hsrc[4 * e];
        J->s13 = (const void *)(uintptr_t)j->hsrc[4 * e + 1];
        J->w2 = (const void *)(uintptr_t)j->hsrc[4 * e + 2];
        J->s2 = (const void *)(uintptr_t)j->hsrc[4 * e + 3];
        J->gs13 = h->gs13;
        J->gs2 = h->gs2;
        J->grouped13 = h->grouped13;
        J->grouped2 = h->grouped2;
        J->sdtype = h->sdtype;
        J->pad = 0;
    }
    int rc = h->start(h->pool, h->isa, h->area + h->x_off, h->xdt, n, h->H, h->I, h->jobs, (int)nj,
                      h->area + h->out_off, 1);
    if (rc) { /* the host's pairs are in no one's sum: the step must fail */
        pthread_mutex_lock(&a->mu);
        fail(a, A_ERR_HOST, st->li, (uint64_t)(rc < 0 ? -rc : rc));
        pthread_mutex_unlock(&a->mu);
        return A_ERR_NONE; /* the copies stand (their slots hold what they say) */
    }
    h->started = 1;
    pthread_mutex_lock(&a->mu);
    a->stats[AS_HOST_CALLS]++;
    a->stats[AS_HOST_EXPERTS] += (uint64_t)nj;
    a->stats[AS_HOST_ROWS] += (uint64_t)r;
    pthread_mutex_unlock(&a->mu);
    return A_ERR_NONE;
}

/* A sparse call's part 0 (file comment): mo_step_sparse's decisions on the ids the stream copied,
 * every part's items, part 0's fill queued. */
static void sparse_cb(void *arg) {
    mo_ajob *j = (mo_ajob *)arg;
    mo_async *a = j->a;
    mo_step *st = j->st;
    uint64_t t0 = ns_now(), fill_ns = cb_begin(a, t0);
    int64_t T = st->T, nk = j->nk, isz = j->id_size, K = j->parts;
    int64_t per = staged_per_load(a, st), ppe = 0; /* misses per part, items per miss */
    for (int64_t t = 0; t < T; t++) ppe += (int64_t)((st->sizes[t] + a->chunk_bytes - 1) / a->chunk_bytes);
    mo_ajob *part[AJ_JOBS];
    for (int64_t k = 0; k < K; k++) {
        part[k] = &a->jobs[(j - a->jobs + k) % AJ_JOBS];
        part[k]->nnew = part[k]->nfp = 0;
        job_head(part[k], 0, 0, st);
    }
    int64_t out[OUT_HEAD];
    memset(out, 0, sizeof(out));
    int64_t err = A_ERR_NONE;
    int64_t used[MAX_EXPERTS], miss[MAX_EXPERTS], hit[MAX_EXPERTS], nm = 0, nh = 0, na = 0, bad;
    uint8_t host_e[MAX_EXPERTS];
    int64_t nhost = 0, dummy = 0;
    if (j->hy) {
        host_wait_started(a, 0); /* a call whose collect never came (its step failed): its job ends first */
        a->hy.idle = 0;
        memset(host_e, 0, (size_t)st->E);
        memset(a->hy.area + a->hy.out_off, 0, (size_t)(j->hy_rows * a->hy.H * a->hy.xsz));
    }
    int64_t nu = mo_step_distinct(st, j->ids, nk, isz, used, &bad);
    if (nu < 0 || mo_step_split(st, used, nu, hit, &nh, miss, &nm) < 0) err = A_ERR_PROMISE;
    if (!err && (per < 1 || (nm > per * K && !j->hy))) err = A_ERR_PROMISE; /* hybrid: the host takes the rest */
    /* the hits' items (device to device from their slots), in part 0, before its misses */
    uint64_t *pc = j->desc + D_HEAD;
    int64_t nhit = 0;
    for (int64_t i = 0; i < nh && !err; i++) {
        int64_t e = hit[i], s = st->lut[e];
        for (int64_t t = 0; t < T && !err; t++) {
            uint64_t n = st->sizes[t], src = st->dst[s * T + t], dst = j->rows[t] + (uint64_t)e * j->stride[t];
            for (uint64_t c = 0; c < n && !err; c += HIT_CHUNK) {
                if (nhit >= a->max_pieces) { err = A_ERR_PROMISE; break; }
                uint64_t *it = pc + 4 * nhit;
                it[0] = ITEM_DEVICE | (src + c);
                it[1] = dst + c;
                it[2] = n - c < HIT_CHUNK ? n - c : HIT_CHUNK;
                it[3] = 0;
                j->flags[nhit] = 1;
                nhit++;
            }
        }
    }
    if (!err && nm && j->hy) /* admissions, then the host's share of the rest */
        err = hybrid_misses(a, j, part, K, per, ppe, nhit, used, nu, hit, nh, miss, nm, host_e, &dummy, &na, &nhost,
                            out);
    /* ExpertCache.admit's decisions (mo_step_admit, as mo_step_sparse takes them) */
    else if (!err && nm) {
        /* the items first (nothing committed yet: a refusal changes nothing); then the admissions'
         * second destinations are patched in */
        for (int64_t k = 0; k < K && !err; k++) {
            int64_t lo = k * per, hi = lo + per < nm ? lo + per : nm;
            if (lo >= hi) break;
            if (miss_items(a, part[k], st, miss + lo, hi - lo, NULL, k ? 0 : nhit) < 0) err = A_ERR_PROMISE;
        }
        if (!err) {
            int64_t adm[2 * MAX_EXPERTS];
            na = mo_step_admit(st, used, nu, hit, nh, miss, nm, j->max_admit, adm, out);
            for (int64_t i = 0; i < na; i++) admit_into(a, part, per, ppe, st, adm[2 * i], miss[adm[2 * i]], adm[2 * i + 1]);
        }
    }
    if (j->hy) {
        if (err) memset(host_e, 0, (size_t)st->E);
        hybrid_blk(a, j, host_e, dummy);
    }
    if (err) { /* nothing decided (the checks precede every commit): no part copies anything */
        for (int64_t k = 0; k < K; k++) { part[k]->nfp = 0; job_head(part[k], 0, 0, st); }
    } else {
        job_head(j, nhit + j->nfp, 0, st);
        for (int64_t k = 1; k < K; k++) job_head(part[k], part[k]->nfp, 0, st);
        err = queue_fill(a, j);
    }
    pthread_mutex_lock(&a->mu);
    if (err != A_ERR_PROMISE) {
        a->stats[AS_SPARSE]++;
        a->stats[AS_PARTS] += (uint64_t)K;
        a->stats[AS_SPARSE_HITS] += (uint64_t)nh;
        a->stats[AS_SPARSE_MISSES] += (uint64_t)nm;
        a->stats[AS_ADMITTED] += (uint64_t)na;
        a->stats[AS_HYBRID] += (uint64_t)(j->hy != 0);
        a->stats[AS_EVICTIONS] += (uint64_t)out[OUT_EVICTIONS];
        a->stats[AS_HINT_WASTED] += (uint64_t)out[OUT_HINT_WASTED];
    }
    pthread_mutex_unlock(&a->mu);
    cb_end(a, st, err, t0, fill_ns, 0); /* the layer buffer's, not the pool's fills */
}

/* A sparse call's part k >= 1: part k-1's kernel ran (the staging is free): queue this part's reads. */
static void part_cb(void *arg) {
    mo_ajob *j = (mo_ajob *)arg;
    mo_async *a = j->a;
    uint64_t t0 = ns_now(), fill_ns = cb_begin(a, t0);
    int64_t err = queue_fill(a, j);
    cb_end(a, j->st, err, t0, fill_ns, 0);
}

/* The CPU stand-in of the copy kernel (a host function on the CPU stream, after the callback). */
static void cpu_kernel(void *arg) {
    mo_ajob *j = (mo_ajob *)arg;
    const uint64_t *desc = j->desc, *pc = desc + D_HEAD, *ids = desc + D_HEAD + 4 * desc[D_MAXPIECES];
    for (uint64_t i = 0; i < desc[D_NPIECES]; i++) {
        uint64_t f;
        while (!(f = __atomic_load_n(&j->flags[i], __ATOMIC_ACQUIRE))) sched_yield();
        if (f != 1) continue;
        const uint64_t *it = pc + 4 * i;
        const char *src = it[0] & ITEM_DEVICE ? (const char *)(uintptr_t)(it[0] & ~ITEM_DEVICE) : j->a->staging + it[0];
        memcpy((void *)(uintptr_t)it[1], src, (size_t)it[2]);
        if (it[3]) memcpy((void *)(uintptr_t)it[3], src, (size_t)it[2]);
    }
    void *out = (void *)(uintptr_t)desc[D_SLOTDEV];
    for (uint64_t i = 0; out && i < desc[D_NK]; i++)
        if (desc[D_IDSIZE] == 4) ((int32_t *)out)[i] = (int32_t)ids[i]; else ((int64_t *)out)[i] = (int64_t)ids[i];
}

/* Reserve n consecutive jobs (waiting while their host fields are still earlier callbacks'): the first. */
static mo_ajob *reserve(mo_async *a, int64_t n) {
    pthread_mutex_lock(&a->mu);
    if (a->enq - a->done + n > AJ_JOBS) {
        uint64_t t0 = ns_now();
        while (a->enq - a->done + n > AJ_JOBS) pthread_cond_wait(&a->cv, &a->mu);
        a->stats[AS_WAIT_NS] += ns_now() - t0;
        a->stats[AS_WAITS]++;
    }
    mo_ajob *j = &a->jobs[a->enq % AJ_JOBS];
    a->last_first = a->enq;
    a->last_parts = n;
    pthread_mutex_unlock(&a->mu);
    return j;
}

/* Enqueue job j's callback and kernel: 0 or a CUDA error (a failed kernel launch is recorded: the
 * callback decides and commits, but nothing copies: the step must fail). */
static int enqueue(mo_async *a, mo_ajob *j, fn_host cb, void *stream, uint64_t blk_src, uint64_t blk_dst,
                   uint64_t blk_n) {
    int err = a->launch_host_func(stream, cb, j);
    if (err) return err;
    pthread_mutex_lock(&a->mu);
    a->enq++;
    a->stats[AS_ENQ]++;
    pthread_mutex_unlock(&a->mu);
    if (a->cu_launch) {
        uint64_t desc_dev = j->desc_dev, staging_dev = a->staging_dev;
        void *params[] = {&desc_dev, &staging_dev, &blk_src, &blk_dst, &blk_n};
        err = a->cu_launch(a->kernel, a->grid, 1, 1, a->block, 1, 1, 0, stream, params, NULL);
    } else {
        err = a->launch_host_func(stream, cpu_kernel, j);
    }
    if (err) {
        pthread_mutex_lock(&a->mu);
        fail(a, A_ERR_LAUNCH, j->st->li, (uint64_t)err);
        pthread_mutex_unlock(&a->mu);
    }
    return err;
}

/* The caller's time in an enqueue since t0, into AS_ENQ_NS. */
static void enq_time(mo_async *a, uint64_t t0) {
    uint64_t dt = ns_now() - t0;
    pthread_mutex_lock(&a->mu);
    a->stats[AS_ENQ_NS] += dt;
    pthread_mutex_unlock(&a->mu);
}

/* Enqueue layer ``st``'s step for the ``nk`` routed ids at ``ids`` (device, int32/int64) on
 * ``stream``. Returns 0, or a CUDA error code (> 0: then the stream may hold part of the job;
 * the step must fail, see mo_async_wait), or -1 for bad arguments (nothing enqueued). The caller
 * promises: nk <= the pool's slots and <= cap, every expert checked and with a source address,
 * no other step on this layer's arrays until mo_async_wait. */
int64_t mo_async_run(mo_async *a, mo_step *st, const void *ids, int64_t nk, int64_t id_size, void *stream) {
    if (!a || !st || nk < 0 || nk > a->cap || nk > st->S || (id_size != 4 && id_size != 8) || st->E > MAX_EXPERTS)
        return -1;
    uint64_t t0 = ns_now();
    mo_ajob *j = reserve(a, 1);
    j->st = st;
    j->nk = nk;
    j->id_size = id_size;
    j->rows[0] = 0;
    j->parts = 1;
    int err = nk ? a->memcpy_async(j->ids, ids, (size_t)(nk * id_size), D2H, stream) : 0;
    if (!err) err = enqueue(a, j, async_cb, stream, 0, 0, 0); /* (an error before it: nothing of this job is on the stream) */
    enq_time(a, t0);
    return err;
}

/* The parts a sparse call of nk ids on layer ``st`` is enqueued as (file comment); 0: none fit. */
static int64_t sparse_parts(mo_async *a, const mo_step *st, int64_t nk) {
    int64_t per = staged_per_load(a, st);
    if (per < 1 || nk < 1) return 0;
    int64_t most = nk < st->E ? nk : st->E; /* misses: distinct experts, at most E */
    int64_t k = (most + per - 1) / per;
    return k <= AJ_JOBS / 4 ? k : 0;
}

/* A hybrid call's parts, of a plain call's K: the staging's loads it may copy. Fewer parts than K
 * cost fewer callbacks and kernels on the stream (a part with nothing to copy still costs both: at
 * batch 8 most of a plain call's parts are empty once the host takes its share); the misses beyond
 * them go to the host (hybrid_misses). Never fewer than the admissions need: an admitted miss is copied. */
static int64_t hybrid_parts(const mo_async *a, const mo_step *st, int64_t K, int64_t max_admit) {
    int64_t per = staged_per_load(a, st), want = a->hy.parts; /* >= 1: K > 0 */
    int64_t need = max_admit > 0 ? (max_admit + per - 1) / per : 0;
    if (want < 0) return K;
    if (want == 0) want = 1;
    if (want < need) want = need;
    return want < K ? want : K;
}

/* A sparse call's parts (mo_async_run_sparse, mo_async_run_hybrid); hy: the hybrid fields, or NULL. */
static int64_t run_sparse_(mo_async *a, mo_step *st, const uint64_t *rows, const uint64_t *stride, int64_t max_admit,
                           const void *ids, int64_t nk, int64_t id_size, void *stream, const mo_ajob *hy,
                           const void *weights, const void *x, void *blk_dev) {
    if (!a || !st || !rows || !stride || nk < 1 || nk > a->cap || (id_size != 4 && id_size != 8) ||
        st->E > MAX_EXPERTS || st->T > AJ_MAX_T || !rows[0])
        return -1;
    int64_t K = sparse_parts(a, st, nk);
    if (!K) return -1;
    if (hy) K = hybrid_parts(a, st, K, max_admit);
    mo_ajob *j = reserve(a, K);
    for (int64_t k = 0; k < K; k++) { /* host fields only: the stream has run every earlier user's callback */
        mo_ajob *p = &a->jobs[(j - a->jobs + k) % AJ_JOBS];
        p->st = st;
        p->nk = nk;
        p->id_size = id_size;
        p->parts = K;
        p->max_admit = max_admit;
        p->nfp = p->nnew = 0;
        p->hy = k == 0 && hy;
        p->hy_rows = hy ? hy->hy_rows : 0;
        p->hsrc = hy ? hy->hsrc : NULL;
        for (int64_t t = 0; t < st->T; t++) { p->rows[t] = rows[t]; p->stride[t] = stride[t]; }
    }
    mo_hybrid *h = &a->hy;
    /* a hybrid call's kernel weights and ids (written by part 0's callback) reach the device through the
     * last part's copy kernel where the area is mapped, else by a copy after it (below) */
    int blk_by_kernel = hy && a->cu_launch && h->area_dev;
    uint64_t blk_n = (uint64_t)(((a->cap * 4 + 7) & ~7) + a->cap * 8);
    int err;
    if (hy && a->gather && h->area_dev) { /* ids, router weights and token rows in one launch */
        uint64_t p[9] = {j->desc_dev + (uint64_t)((char *)j->ids - (char *)j->desc), (uint64_t)(uintptr_t)ids,
                         (uint64_t)(nk * id_size), h->area_dev + h->w_off, (uint64_t)(uintptr_t)weights,
                         (uint64_t)(nk * 4), h->area_dev + h->x_off, (uint64_t)(uintptr_t)x,
                         (uint64_t)(hy->hy_rows * h->H * h->xsz)};
        void *params[] = {&p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6], &p[7], &p[8]};
        err = a->cu_launch(a->gather, 8, 3, 1, 256, 1, 1, 0, stream, params, NULL);
    } else {
        err = a->memcpy_async(j->ids, ids, (size_t)(nk * id_size), D2H, stream);
        if (!err && hy) { /* the call's router weights and token rows, for the callback and the host job */
            err = a->memcpy_async(h->area + h->w_off, weights, (size_t)(nk * 4), D2H, stream);
            if (!err)
                err = a->memcpy_async(h->area + h->x_off, x, (size_t)(hy->hy_rows * h->H * h->xsz), D2H, stream);
        }
    }
    if (err) return err;
    for (int64_t k = 0; k < K; k++) {
        mo_ajob *p = &a->jobs[(j - a->jobs + k) % AJ_JOBS];
        int last = blk_by_kernel && k == K - 1;
        err = enqueue(a, p, k ? part_cb : sparse_cb, stream, last ? h->area_dev + h->blk_off : 0,
                      last ? (uint64_t)(uintptr_t)blk_dev : 0, last ? blk_n : 0);
        if (err) { /* parts decided and never run: their admitted slots must go (wait() empties the pool) */
            pthread_mutex_lock(&a->mu);
            fail(a, A_ERR_LAUNCH, st->li, (uint64_t)err);
            pthread_mutex_unlock(&a->mu);
            return err;
        }
    }
    if (hy && !blk_by_kernel) { /* the kernel's weights and ids, written by part 0's callback */
        err = a->memcpy_async(blk_dev, h->area + h->blk_off, (size_t)blk_n, H2D_KIND, stream);
        if (err) {
            pthread_mutex_lock(&a->mu);
            fail(a, A_ERR_LAUNCH, st->li, (uint64_t)err);
            pthread_mutex_unlock(&a->mu);
            return err;
        }
    }
    return 0;
}

static int64_t run_sparse(mo_async *a, mo_step *st, const uint64_t *rows, const uint64_t *stride, int64_t max_admit,
                          const void *ids, int64_t nk, int64_t id_size, void *stream, const mo_ajob *hy,
                          const void *weights, const void *x, void *blk_dev) {
    uint64_t t0 = ns_now();
    int64_t rc = run_sparse_(a, st, rows, stride, max_admit, ids, nk, id_size, stream, hy, weights, x, blk_dev);
    if (a) enq_time(a, t0);
    return rc;
}

/* Enqueue a sparse call (file comment) of layer ``st``: the layer buffer's tensor t of expert e at
 * rows[t] + e * stride[t], at most ``max_admit`` misses admitted into the pool. Returns as
 * mo_async_run; the same promise, except that nk may exceed the pool's slots (<= cap). */
int64_t mo_async_run_sparse(mo_async *a, mo_step *st, const uint64_t *rows, const uint64_t *stride, int64_t max_admit,
                            const void *ids, int64_t nk, int64_t id_size, void *stream) {
    return run_sparse(a, st, rows, stride, max_admit, ids, nk, id_size, stream, NULL, NULL, NULL, NULL);
}

/* Pinned layout of the hybrid area for ``cap`` ids, ``max_rows`` token rows of H values of xsz bytes:
 * out[0..4] = offsets of x, out, the router weights, blk (masked weights [cap] f32, 8-aligned, then
 * the kernel's ids [cap], 8 bytes each at most), and the whole area's bytes; out[5]: blk's bytes. */
void mo_async_host_layout(int64_t cap, int64_t max_rows, int64_t H, int64_t xsz, int64_t *out) {
    int64_t xb = (max_rows * H * xsz + 255) & ~(int64_t)255, blk = ((cap * 4 + 7) & ~7) + cap * 8;
    out[0] = 0;
    out[1] = xb;
    out[2] = 2 * xb;
    out[3] = 2 * xb + ((cap * 4 + 255) & ~(int64_t)255);
    out[4] = out[3] + blk;
    out[5] = blk;
}

/* Host compute for hybrid calls: mo_host's mo_host_mlp_start / mo_host_mlp_wait and its pool, the
 * experts' geometry (host_kernel.c's mo_job_t fields), x's dtype (DT_*) and size, the pinned
 * area (mo_async_host_layout) and its device address (mapped; 0: not mapped), the initial share of misses computed on the host, and whether
 * collects adapt it. Only with no call in flight (after mo_async_wait). 0, or -1 for bad arguments. */
int64_t mo_async_set_host(mo_async *a, void *start, void *wait, void *pool, int64_t isa, int64_t xdt, int64_t xsz,
                          int64_t H, int64_t I, int64_t gs13, int64_t gs2, int64_t grouped13, int64_t grouped2,
                          int64_t sdtype, int64_t max_rows, char *area, uint64_t area_dev, double share,
                          int64_t adapt) {
    if (!a || !start || !wait || !pool || !area || H <= 0 || I <= 0 || max_rows < 1 || xsz < 1 || share < 0 ||
        share > 1)
        return -1;
    mo_hybrid *h = &a->hy;
    int64_t lay[6];
    mo_async_host_layout(a->cap, max_rows, H, xsz, lay);
    int64_t *rows = malloc((size_t)a->cap * sizeof(int64_t));
    float *wts = malloc((size_t)a->cap * sizeof(float));
    host_job *jobs = malloc((size_t)a->cap * sizeof(host_job));
    if (!rows || !wts || !jobs) { free(rows); free(wts); free(jobs); return -1; }
    free(h->rows);
    free(h->wts);
    free(h->jobs);
    h->rows = rows;
    h->wts = wts;
    h->jobs = jobs;
    h->start = (fn_host_start)start;
    h->wait = (fn_host_wait)wait;
    h->pool = pool;
    h->isa = (int)isa;
    h->xdt = (int)xdt;
    h->xsz = xsz;
    h->H = H;
    h->I = I;
    h->gs13 = (int32_t)gs13;
    h->gs2 = (int32_t)gs2;
    h->grouped13 = (int32_t)grouped13;
    h->grouped2 = (int32_t)grouped2;
    h->sdtype = (int32_t)sdtype;
    h->max_rows = max_rows;
    h->area = area;
    h->area_dev = area_dev;
    h->x_off = (uint64_t)lay[0];
    h->out_off = (uint64_t)lay[1];
    h->w_off = (uint64_t)lay[2];
    h->blk_off = (uint64_t)lay[3];
    h->share = share;
    h->adapt = adapt != 0;
    h->started = 0;
    return 0;
}

/* A hybrid call's parts from the next call on (mo_hybrid.parts: 0 the fewest, -1 a plain call's,
 * n > 0 n); returns the setting. Any value < -1 reads it. */
int64_t mo_async_hybrid_parts(mo_async *a, int64_t parts) {
    pthread_mutex_lock(&a->mu);
    if (parts >= -1) a->hy.parts = parts;
    int64_t p = a->hy.parts;
    pthread_mutex_unlock(&a->mu);
    return p;
}

/* The share of a hybrid call's misses computed on the host now (set: share >= 0 sets it). */
double mo_async_host_share(mo_async *a, double share) {
    pthread_mutex_lock(&a->mu);
    if (share >= 0 && share <= 1) a->hy.share = share;
    double s = a->hy.share;
    pthread_mutex_unlock(&a->mu);
    return s;
}

/* Enqueue a hybrid sparse call: mo_async_run_sparse's call, of ``n_rows`` tokens (nk / n_rows ids
 * each), where part 0's callback also sends the host a share of the misses not admitted into the
 * pool (the fewest tokens first), computed on the host from the rows ``x`` (device, [n_rows, H],
 * the area's dtype) with the router ``weights`` (device, f32 [nk]), from the experts' bytes at
 * hsrc[4 e .. 4 e + 3] (w13, s13, w2, s2; host addresses, kept valid by the caller). blk_dev
 * (device, mo_async_host_layout's blk bytes) receives the kernel's weights (the host's pairs 0) and
 * ids (those pairs' experts replaced by a routed expert whose row is filled). The host's rows are
 * added by the caller after mo_async_collect. Returns as mo_async_run_sparse. */
int64_t mo_async_run_hybrid(mo_async *a, mo_step *st, const uint64_t *rows, const uint64_t *stride, int64_t max_admit,
                            const void *ids, int64_t nk, int64_t id_size, const void *weights, const void *x,
                            int64_t n_rows, const uint64_t *hsrc, void *blk_dev, void *stream) {
    if (!a || !a->hy.start || n_rows < 1 || n_rows > a->hy.max_rows || nk % n_rows || !hsrc || !blk_dev || !weights ||
        !x)
        return -1;
    mo_ajob hy;
    hy.hy_rows = n_rows;
    hy.hsrc = hsrc;
    return run_sparse(a, st, rows, stride, max_admit, ids, nk, id_size, stream, &hy, weights, x, blk_dev);
}

/* mo_async_run_hybrid with the call's fixed arguments packed (async_step.py's HybridCall, made once per
 * layer and shapes): p = {st, rows, stride, max_admit, nk, id_size, n_rows, hsrc, blk_dev}; the per-call
 * ones are the router's ids and weights, the token rows and the stream. Returns as mo_async_run_hybrid. */
int64_t mo_async_run_hybrid_packed(mo_async *a, const uint64_t *p, const void *ids, const void *weights, const void *x,
                                   void *stream) {
    if (!p) return -1;
    return mo_async_run_hybrid(a, (mo_step *)(uintptr_t)p[0], (const uint64_t *)(uintptr_t)p[1],
                               (const uint64_t *)(uintptr_t)p[2], (int64_t)p[3], ids, (int64_t)p[4], (int64_t)p[5],
                               weights, x, (int64_t)p[6], (const uint64_t *)(uintptr_t)p[7], (void *)(uintptr_t)p[8],
                               stream);
}

/* The host's half of the last hybrid call: when the stream reaches it, wait for its host job (the
 * share adapts: a job done first takes more next time, a job waited for less, a call that had misses
 * for the host and gave it none more); then the host's
 * rows (nbytes from the area's out) are copied to out_dev. The caller adds them to the MoE output
 * after this. 0, a CUDA error, or -1 (no host set, nbytes too large). */
static void collect_cb(void *arg) {
    mo_async *a = (mo_async *)arg;
    mo_hybrid *h = &a->hy;
    if (h->started) {
        host_wait_started(a, 1);
    } else if (h->idle && h->adapt) { /* the share gave the host nothing it could have taken: more */
        pthread_mutex_lock(&a->mu);
        h->share = h->share + 1.0 / 32 > 1 ? 1 : h->share + 1.0 / 32;
        pthread_mutex_unlock(&a->mu);
    }
    h->idle = 0;
    pthread_mutex_lock(&a->mu);
    a->hy.cdone++;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

/* Enqueue collect_cb (counted: mo_async_wait waits for it): 0 or a CUDA error. */
static int enqueue_collect(mo_async *a, void *stream) {
    int err = a->launch_host_func(stream, collect_cb, a);
    if (err) return err;
    pthread_mutex_lock(&a->mu);
    a->hy.cenq++;
    pthread_mutex_unlock(&a->mu);
    return 0;
}

int64_t mo_async_collect(mo_async *a, void *out_dev, int64_t nbytes, void *stream) {
    if (!a || !a->hy.start || nbytes < 0 || nbytes > a->hy.max_rows * a->hy.H * a->hy.xsz || (nbytes && !out_dev))
        return -1;
    uint64_t t0 = ns_now();
    int err = enqueue_collect(a, stream);
    if (!err && nbytes)
        err = a->memcpy_async(out_dev, a->hy.area + a->hy.out_off, (size_t)nbytes, H2D_KIND, stream);
    enq_time(a, t0);
    return err;
}

/* The CUDA kernels beside the copy kernel (copy_kernel.py): ``gather`` (a hybrid call's ids, router
 * weights and token rows into the mapped job and host areas in one launch, instead of three copies)
 * and ``add`` (mo_async_collect_add). NULL: not used. Only with no call in flight. */
void mo_async_set_kernels(mo_async *a, void *gather, void *add) {
    a->gather = gather;
    a->add = add;
}

/* mo_async_collect, with the add in the same enqueue: when the stream reaches it, wait for the host
 * job (collect_cb), then one launch adds the host's n_rows rows, read in place from the mapped area,
 * to out_dev ([n_rows, H] of the area's dtype, rows row_stride elements apart), in float and rounded
 * to nearest even as torch's add_ does. 0, a CUDA error, or -1 where it cannot (no add kernel, no
 * mapped area, bad arguments: nothing enqueued, the caller takes mo_async_collect). */
int64_t mo_async_collect_add(mo_async *a, void *out_dev, int64_t n_rows, int64_t row_stride, void *stream) {
    mo_hybrid *h = &a->hy;
    if (!a || !h->start || !a->add || !a->cu_launch || !h->area_dev || !out_dev || n_rows < 1 ||
        n_rows > h->max_rows || row_stride < h->H || (h->xdt != 0 && h->xdt != 1))
        return -1;
    uint64_t t0 = ns_now();
    int err = enqueue_collect(a, stream);
    if (!err) {
        uint64_t p[6] = {(uint64_t)(uintptr_t)out_dev, h->area_dev + h->out_off, (uint64_t)n_rows, (uint64_t)h->H,
                         (uint64_t)row_stride, (uint64_t)h->xdt};
        void *params[] = {&p[0], &p[1], &p[2], &p[3], &p[4], &p[5]};
        unsigned per_row = (unsigned)((h->H + 8 * 256 - 1) / (8 * 256));
        err = a->cu_launch(a->add, per_row, (unsigned)n_rows, 1, 256, 1, 1, 0, stream, params, NULL);
    }
    enq_time(a, t0);
    return err;
}

/* Wait until every enqueued callback ran (no CUDA call: the device must reach them). Returns the
 * first error since the last call (0: none) and clears it; info[0..1]: its layer position and its
 * detail (the faulting address of a failed fill, the CUDA error of a failed launch). */
int64_t mo_async_wait(mo_async *a, int64_t *info) {
    pthread_mutex_lock(&a->mu);
    while (a->done < a->enq || a->hy.cdone < a->hy.cenq) pthread_cond_wait(&a->cv, &a->mu);
    mo_ajob *last = a->inflight; /* no callback runs now: this thread would have to enqueue it */
    a->inflight = NULL;
    pthread_mutex_unlock(&a->mu);
    if (a->hy.start) host_wait_started(a, 0); /* a hybrid call whose collect never came */
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
    int64_t n = a->enq - a->done + a->hy.cenq - a->hy.cdone;
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

/* The (expert, slot) pairs the last enqueued call (all its parts) made resident, into out (2 per pair): their count.
 * Only once that job's callback ran (the CPU stand-in: after draining its stream). */
int64_t mo_async_last_pairs(mo_async *a, int64_t *out) {
    pthread_mutex_lock(&a->mu);
    int64_t n = 0;
    if (a->enq && a->done >= a->enq && a->last_first + a->last_parts <= a->enq)
        for (int64_t k = 0; k < a->last_parts; k++) {
            const mo_ajob *j = &a->jobs[(a->last_first + k) % AJ_JOBS];
            memcpy(out + 2 * n, j->new_pairs, (size_t)(2 * j->nnew) * sizeof(int64_t));
            n += j->nnew;
        }
    pthread_mutex_unlock(&a->mu);
    return n;
}
