/* The expert cache's decode step (route_step.c) and its stream-callback form (async_step.c):
 * the per-layer struct both read and the policy helpers both use. */
#ifndef MO_ROUTE_STEP_H
#define MO_ROUTE_STEP_H
#include <stddef.h>
#include <stdint.h>

typedef int (*fn_memcpy_async)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*fn_event_record)(void *ev, void *stream);
typedef int (*fn_event_sync)(void *ev);

/* copy_pool.c */
int64_t mo_gate_submit(void *p, const void *in, size_t n, size_t chunk_bytes, size_t group_bytes,
                       void *stream, int64_t *status, void *event);
enum { ST_CUDA_WORD = 5 };

enum { D2H = 2, H2D_KIND = 1, D2D = 3 };
enum { POLICY_LFU_DECAY = 0, POLICY_LFU = 1, POLICY_LRU = 2 };
enum { MAX_EXPERTS = 1024 }; /* stack arrays; more experts: the Python path */
#define RECENT_BONUS 1e12 /* expert_cache._RECENT_BONUS */

/* results below 0 (>= 0: done, the number of misses queued) */
enum {
    MO_STEP_SPARSE = -10,  /* more distinct experts than slots: out holds them */
    MO_STEP_PYTHON = -11,  /* the Python path must serve this call: out holds the distinct experts */
    MO_STEP_RANGE = -12,   /* an id outside [0, E): out[OUT_DETAIL] is it */
    MO_STEP_CUDA = -13,    /* a CUDA call failed (ids copy, sync, slot ids copy): out[OUT_DETAIL] */
    MO_STEP_COPY = -14,    /* the batch's copies failed (status[ST_CUDA]): its slots were emptied */
    MO_STEP_CLOSED = -15,  /* the pool is closing: nothing changed */
    MO_STEP_INVALID = -16, /* bad sizes, or the pool refused the batch as invalid: nothing changed */
};
/* out: counters, then the distinct experts [E], then the (expert, slot) pairs of the misses [2 S] */
enum { OUT_USED = 0, OUT_MISSES, OUT_HITS, OUT_EVICTIONS, OUT_HINT_USED, OUT_HINT_WASTED, OUT_PIECES,
       OUT_DETAIL, OUT_ADMITTED, OUT_HEAD };

typedef struct {
    /* CUDA runtime, or on the CPU the copy pool's CPU stand-in stream (mo_fake_*) */
    int64_t host_ids;             /* 1 on the CPU: ids and slot ids are host memory, read and written in place */
    fn_memcpy_async memcpy_async;
    fn_event_record event_record;
    fn_event_sync event_sync;
    void *event;                  /* this step's own event: after the ids' copy to the host */
    int64_t E, S, T;              /* experts of the layer, slots of its pool, tensors per expert */
    int64_t policy;               /* POLICY_* */
    int64_t window;               /* the policy's recent window in calls (the layers of one step) */
    double lam;                   /* decay per call (0: lfu) */
    int64_t li;                   /* the layer's position in the cache (owner_li of its slots) */
    int64_t *now;                 /* the cache's call clock */
    int64_t *lut;                 /* [E] expert -> slot, -1 */
    double *last, *logscore;      /* [E] the policy's state of the layer's experts */
    int64_t *owner_li, *owner_e, *use_call; /* [S] the pool's slots */
    uint8_t *used, *hinted, *pinned;        /* [S] */
    const uint8_t *verified;      /* [E] first-use check done; NULL: no check asked for */
    const uint64_t *src;          /* [E] address of the expert's record in the engine's mapping, 0: unknown */
    const uint64_t *dst;          /* [S * T] device address of slot s's tensor t */
    const uint64_t *offs, *sizes; /* [T] the tensors in a record */
    uint64_t *pieces;             /* [pieces_cap] scratch: (src, dst, n) per piece */
    int64_t pieces_cap;
    /* MmapEngine._chunk_bytes and _ordered_group_bytes */
    int64_t slot_bytes, min_chunk, chunk_div, align, gates, min_group;
    void *ids_host;               /* CUDA: pinned [cap] ids staging */
    void *slot_host;              /* CUDA: pinned [cap] slot ids staging; CPU: the output itself */
    void *slot_dev;               /* CUDA: device [cap] slot ids (the kernel's) */
    int64_t cap;
} mo_step;


double mo_step_decayed(const mo_step *st, int64_t e, int64_t nowv);
void mo_step_touch(mo_step *st, const int64_t *used, int64_t nu, int64_t nowv);
void mo_step_evict(mo_step *st, int64_t s, int64_t *out);
void mo_step_mark_used(mo_step *st, const uint8_t *prot, const int64_t *used, int64_t nu, int64_t nowv,
                       int64_t *out);
int64_t mo_step_read_id(const void *ids, int64_t i, int64_t size);
int64_t mo_step_distinct(const mo_step *st, const void *ids, int64_t nk, int64_t id_size, int64_t *used,
                         int64_t *bad);
int64_t mo_step_split(const mo_step *st, const int64_t *used, int64_t nu, int64_t *hit, int64_t *nh, int64_t *miss,
                      int64_t *nm);
void mo_step_forget(mo_step *st, int64_t e, int64_t s);
int64_t mo_step_victims(const mo_step *st, int64_t nowv, int64_t n, const uint8_t *prot, int64_t *out);
int64_t mo_step_admit(mo_step *st, const int64_t *used, int64_t nu, const int64_t *hit, int64_t nh,
                      const int64_t *miss, int64_t nm, int64_t max_admit, int64_t *adm, int64_t *out);
#endif
