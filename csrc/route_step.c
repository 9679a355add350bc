/* The expert cache's decode step for one MoE layer in one call (mmap_offload/expert_step.py wraps it;
 * built into mo_native with copy_pool.c, whose mo_gate_submit it calls).
 *
 * At decode the vLLM backend's residency step (vllm_backend/residency.py) did, per layer, in Python:
 * copy the routed ids to the host and wait for them, take their distinct experts, split them into
 * hits and misses against the layer's pool, choose the misses' slots (ExpertCache's eviction policy),
 * plan their copies and queue them as one stream-ordered batch, then write the expert -> slot map and
 * hand the kernel slot ids. On the H200's host that took ~1.1 ms per layer of which the C parts were
 * ~0.1 ms. mo_step_run does all of it for the common case and leaves every other case, untouched,
 * to the Python path, which stays the reference (tests/test_expert_step.py compares the two):
 *
 *   1. ids -> host: cudaMemcpyAsync into pinned staging + event record + sync (CPU: read in place)
 *   2. distinct experts (ascending) into out; more than the pool's slots: MO_STEP_SPARSE
 *   3. hits / misses; a miss whose first-use check has not run, or whose source address is not
 *      known yet, or a shared pool, hints in flight (the caller checks those): MO_STEP_PYTHON
 *   4. victims: free slots first (ascending), then the lowest eviction keys among slots not hit,
 *      ties by least recent use: ExpertCache._victims exactly (lfu-decay, lfu, lru)
 *   5. mo_gate_submit of the misses' pieces; a refusal (no arena, too big, another stream):
 *      MO_STEP_PYTHON with nothing changed
 *   6. commit: the clock, evictions, new owners, use marks, the policy's scores (ExpertCache._touch)
 *   7. slot ids = map[ids] into pinned staging + cudaMemcpyAsync to the device (CPU: in place)
 *
 * Every array is owned by the caller (numpy, shared with ExpertCache's Python path); the call keeps
 * nothing. The GIL is released by ctypes for its whole length. Floating point follows numpy's
 * logaddexp (x == y: x + ln 2; else max + log1p(exp(-|x - y|))) and is built without contraction
 * (-ffp-contract=off), so both paths rank experts identically. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "route_step.h"

int64_t mo_step_abi(void) { return (int64_t)sizeof(mo_step); }

static double logaddexp0(double x) { /* numpy's npy_logaddexp(x, 0.0) */
    if (x == 0.0) return x + M_LN2;
    double tmp = x - 0.0;
    if (tmp > 0) return x + log1p(exp(-tmp));
    if (tmp <= 0) return 0.0 + log1p(exp(tmp));
    return tmp;
}

double mo_step_decayed(const mo_step *st, int64_t e, int64_t nowv) { /* ExpertCache._decayed */
    double ls = st->logscore[e];
    return st->lam == 0.0 ? ls : ls - ((double)nowv - st->last[e]) * st->lam;
}

void mo_step_touch(mo_step *st, const int64_t *used, int64_t nu, int64_t nowv) { /* ExpertCache._touch */
    for (int64_t i = 0; i < nu; i++) {
        int64_t e = used[i];
        if (st->policy != POLICY_LRU) st->logscore[e] = logaddexp0(mo_step_decayed(st, e, nowv));
        st->last[e] = (double)nowv;
    }
}

/* The end of ExpertCache.ensure's commit: the slots in prot[] (hit or just filled) are the call's
 * (pinned, used, their use call; a hint they held counts as used), and the routed experts' scores
 * are touched. */
void mo_step_mark_used(mo_step *st, const uint8_t *prot, const int64_t *used, int64_t nu, int64_t nowv,
                       int64_t *out) {
    for (int64_t s = 0; s < st->S; s++) {
        st->pinned[s] = prot[s];
        if (!prot[s]) continue;
        if (st->hinted[s]) { out[OUT_HINT_USED]++; st->hinted[s] = 0; }
        st->used[s] = 1;
        st->use_call[s] = nowv;
    }
    mo_step_touch(st, used, nu, nowv);
}

/* ExpertCache._evict without a copy in flight (the callers check that there is none): empty slot s */
void mo_step_evict(mo_step *st, int64_t s, int64_t *out) {
    if (st->owner_li[s] >= 0) {
        if (st->hinted[s]) out[OUT_HINT_WASTED]++;
        st->lut[st->owner_e[s]] = -1;
        out[OUT_EVICTIONS]++;
    }
    st->owner_li[s] = st->owner_e[s] = -1;
    st->used[s] = st->hinted[s] = 0;
}

int64_t mo_step_read_id(const void *ids, int64_t i, int64_t size) {
    return size == 4 ? (int64_t)((const int32_t *)ids)[i] : ((const int64_t *)ids)[i];
}

/* The distinct experts of ids[0, nk) (int32 or int64), ascending, into used: their count, or -1
 * with *bad the first id outside [0, E). */
int64_t mo_step_distinct(const mo_step *st, const void *ids, int64_t nk, int64_t id_size, int64_t *used,
                         int64_t *bad) {
    uint8_t mark[MAX_EXPERTS];
    memset(mark, 0, (size_t)st->E);
    for (int64_t i = 0; i < nk; i++) {
        int64_t v = mo_step_read_id(ids, i, id_size);
        if (v < 0 || v >= st->E) { *bad = v; return -1; }
        mark[v] = 1;
    }
    int64_t nu = 0;
    for (int64_t e = 0; e < st->E; e++)
        if (mark[e]) used[nu++] = e;
    return nu;
}

/* used[0, nu) split into hits (resident, in hit) and misses (in miss), in order: 0, or -1 where a
 * miss cannot be fetched here (its first-use check has not run, or its source address is not known). */
int64_t mo_step_split(const mo_step *st, const int64_t *used, int64_t nu, int64_t *hit, int64_t *nh, int64_t *miss,
                      int64_t *nm) {
    *nh = *nm = 0;
    for (int64_t i = 0; i < nu; i++) {
        int64_t e = used[i];
        if (st->lut[e] >= 0) { hit[(*nh)++] = e; continue; }
        if ((st->verified && !st->verified[e]) || !st->src[e]) return -1;
        miss[(*nm)++] = e;
    }
    return 0;
}

/* Empty slot s if it still holds expert e: its bytes never arrived (a failed copy or fill). */
void mo_step_forget(mo_step *st, int64_t e, int64_t s) {
    if (st->owner_li[s] != st->li || st->owner_e[s] != e) return;
    st->lut[e] = -1;
    st->owner_li[s] = st->owner_e[s] = -1;
    st->used[s] = st->hinted[s] = 0;
}

/* ExpertCache._victims for ``n`` slots, the slots in prot[] (hit) spared: free ones first
 * (ascending), then the lowest keys (ties: least recently used first). Returns how many. */
int64_t mo_step_victims(const mo_step *st, int64_t nowv, int64_t n, const uint8_t *prot, int64_t *out) {
    int64_t S = st->S, k = 0;
    for (int64_t s = 0; s < S && k < n; s++)
        if (st->owner_li[s] < 0) out[k++] = s;
    if (k >= n) return k;
    int64_t occ[MAX_EXPERTS], m = 0;
    double key[MAX_EXPERTS], tie[MAX_EXPERTS], sorted[MAX_EXPERTS];
    for (int64_t s = 0; s < S; s++) {
        if (st->owner_li[s] < 0 || prot[s]) continue;
        int64_t e = st->owner_e[s];
        double last = st->last[e], kv;
        if (st->policy == POLICY_LRU) {
            kv = last;
        } else {
            kv = st->logscore[e] + last * st->lam;
            if ((double)nowv - last < (double)st->window) kv = kv + RECENT_BONUS;
        }
        occ[m] = s; key[m] = kv; tie[m] = last; m++;
    }
    int64_t need = n - k < m ? n - k : m;
    if (need == 0) return k;
    if (need == m) {
        for (int64_t i = 0; i < m; i++) out[k++] = occ[i];
        return k;
    }
    memcpy(sorted, key, (size_t)m * sizeof(double));
    for (int64_t i = 1; i < m; i++) { /* insertion sort: m is a pool's slots (tens to hundreds) */
        double v = sorted[i];
        int64_t j = i - 1;
        while (j >= 0 && sorted[j] > v) { sorted[j + 1] = sorted[j]; j--; }
        sorted[j + 1] = v;
    }
    double kth = sorted[need - 1];
    int64_t below = 0;
    for (int64_t i = 0; i < m; i++)
        if (key[i] < kth) { out[k++] = occ[i]; below++; }
    int64_t at[MAX_EXPERTS], na = 0;
    for (int64_t i = 0; i < m; i++)
        if (key[i] == kth) at[na++] = i;
    for (int64_t i = 1; i < na; i++) { /* stable by tie (np.argsort kind="stable") */
        int64_t v = at[i], j = i - 1;
        while (j >= 0 && tie[at[j]] > tie[v]) { at[j + 1] = at[j]; j--; }
        at[j + 1] = v;
    }
    for (int64_t i = 0; i < na && i < need - below; i++) out[k++] = occ[at[i]];
    return k;
}

/* mo_gate_submit of st->pieces[0, np) with the engine's chunking; 0, or the MO_STEP_* refusal
 * (nothing queued) */
static int64_t submit(const mo_step *st, int64_t np, void *pool, void *stream, int64_t *status, void *ticket_event,
                      int64_t *out) {
    uint64_t total = 0;
    for (int64_t i = 0; i < np; i++) total += st->pieces[3 * i + 2];
    uint64_t div = (uint64_t)st->chunk_div, al = (uint64_t)st->align;
    uint64_t per = (total + div - 1) / div;
    per = (per + al - 1) / al * al;
    uint64_t chunk = per > (uint64_t)st->min_chunk ? per : (uint64_t)st->min_chunk;
    if (chunk > (uint64_t)st->slot_bytes) chunk = (uint64_t)st->slot_bytes;
    uint64_t group = 0;
    if (st->gates > 1) {
        group = (total + (uint64_t)st->gates - 1) / (uint64_t)st->gates;
        if (group < (uint64_t)st->min_group) group = (uint64_t)st->min_group;
    }
    int64_t rc = mo_gate_submit(pool, st->pieces, (size_t)np, chunk, group, stream, status, ticket_event);
    if (rc == -3 || rc == -4 || rc == -5) return MO_STEP_PYTHON; /* GATE_*: nothing queued */
    if (rc == -1) return MO_STEP_CLOSED;
    if (rc < 0) return MO_STEP_INVALID;
    out[OUT_PIECES] = np;
    return 0;
}

int64_t mo_step_run(mo_step *st, const void *ids, int64_t nk, int64_t id_size, void *pool, void *stream,
                    int64_t *status, void *ticket_event, int64_t *out) {
    int64_t E = st->E, S = st->S, T = st->T;
    if (nk < 0 || nk > st->cap || (id_size != 4 && id_size != 8) || E > MAX_EXPERTS || S > E)
        return MO_STEP_INVALID;
    memset(out, 0, OUT_HEAD * sizeof(int64_t));
    int cuda = !st->host_ids;
    const void *h = ids;
    if (cuda && nk) { /* 1. the ids on the host: the layer's one wait for the device */
        int err = st->memcpy_async(st->ids_host, ids, (size_t)(nk * id_size), D2H, stream);
        if (!err) err = st->event_record(st->event, stream);
        if (!err) err = st->event_sync(st->event);
        if (err) { out[OUT_DETAIL] = err; return MO_STEP_CUDA; }
        h = st->ids_host;
    }
    /* 2. distinct experts, ascending */
    int64_t *used = out + OUT_HEAD, *pairs = out + OUT_HEAD + E;
    int64_t nu = mo_step_distinct(st, h, nk, id_size, used, &out[OUT_DETAIL]);
    if (nu < 0) return MO_STEP_RANGE;
    out[OUT_USED] = nu;
    if (nu > S) return MO_STEP_SPARSE;
    /* 3. hits and misses */
    int64_t hit[MAX_EXPERTS], miss[MAX_EXPERTS], nm, nh;
    if (mo_step_split(st, used, nu, hit, &nh, miss, &nm) < 0) return MO_STEP_PYTHON;
    uint8_t prot[MAX_EXPERTS];
    memset(prot, 0, (size_t)S);
    for (int64_t i = 0; i < nh; i++) prot[st->lut[hit[i]]] = 1;
    int64_t nowv = *st->now + 1;
    /* 4. their slots */
    int64_t vic[MAX_EXPERTS];
    if (nm && mo_step_victims(st, nowv, nm, prot, vic) < nm) return MO_STEP_PYTHON; /* cannot happen: nu <= S */
    /* 5. one stream-ordered batch */
    if (nm) {
        if (nm * T * 3 > st->pieces_cap) return MO_STEP_INVALID;
        for (int64_t i = 0; i < nm; i++)
            for (int64_t t = 0; t < T; t++) {
                uint64_t *pc = st->pieces + 3 * (i * T + t);
                pc[0] = st->src[miss[i]] + st->offs[t];
                pc[1] = st->dst[vic[i] * T + t];
                pc[2] = st->sizes[t];
            }
        int64_t rc = submit(st, nm * T, pool, stream, status, ticket_event, out);
        if (rc) return rc;
    }
    /* 6. commit (ExpertCache.ensure after its _refill) */
    *st->now = nowv;
    for (int64_t i = 0; i < nm; i++) mo_step_evict(st, vic[i], out);
    out[OUT_MISSES] = nm;
    out[OUT_HITS] = nh;
    if (nm && status[ST_CUDA_WORD]) return MO_STEP_COPY; /* emptied, not filled: the Python path's rule */
    for (int64_t i = 0; i < nm; i++) {
        int64_t s = vic[i];
        st->owner_li[s] = st->li;
        st->owner_e[s] = miss[i];
        st->lut[miss[i]] = s;
        pairs[2 * i] = miss[i];
        pairs[2 * i + 1] = s;
        prot[s] = 1;
    }
    mo_step_mark_used(st, prot, used, nu, nowv, out);
    /* 7. slot ids, in the ids' dtype */
    void *sl = st->slot_host;
    for (int64_t i = 0; i < nk; i++) {
        int64_t s = st->lut[mo_step_read_id(h, i, id_size)];
        if (id_size == 4) ((int32_t *)sl)[i] = (int32_t)s; else ((int64_t *)sl)[i] = s;
    }
    if (cuda && nk) {
        int err = st->memcpy_async(st->slot_dev, sl, (size_t)(nk * id_size), H2D_KIND, stream);
        if (err) { out[OUT_DETAIL] = err; return MO_STEP_CUDA; }
    }
    return nm;
}

/* The sparse step (vllm_backend/residency.py ``_sparse_mode``, after mo_step_run said
 * MO_STEP_SPARSE for the same ids): more distinct experts than the pool's slots, so the layer's
 * buffer (rows[t] + e * stride[t]: tensor t of expert e) gets exactly the routed ones: the misses
 * by one stream-ordered batch from the cache, the hits by device copies from their pool slots;
 * then ExpertCache.admit: the routed experts' use is counted and up to ``max_admit`` of the misses
 * whose decayed use beats the slot they would take are copied from their rows into the pool.
 * out[OUT_HEAD ..] must still hold the distinct experts of that mo_step_run. Returns the misses
 * queued (out: hits, misses, admitted, the admitted (expert, slot) pairs), or MO_STEP_PYTHON /
 * _CLOSED / _INVALID with nothing changed, or MO_STEP_COPY / _CUDA (the step must fail; admitted
 * nothing). On the CPU stream every copy is ordered there too: the caller waits for the stream. */
int64_t mo_step_sparse(mo_step *st, const uint64_t *rows, const uint64_t *stride, int64_t max_admit, void *pool,
                       void *stream, int64_t *status, void *ticket_event, int64_t *out) {
    int64_t E = st->E, S = st->S, T = st->T, nu = out[OUT_USED];
    if (nu < 0 || nu > E || E > MAX_EXPERTS || S > E) return MO_STEP_INVALID;
    int64_t *used = out + OUT_HEAD, *pairs = out + OUT_HEAD + E;
    int64_t miss[MAX_EXPERTS], hit[MAX_EXPERTS], nm, nh;
    if (mo_step_split(st, used, nu, hit, &nh, miss, &nm) < 0) return MO_STEP_PYTHON;
    if (nm * T * 3 > st->pieces_cap) return MO_STEP_INVALID;
    for (int64_t k = OUT_MISSES; k < OUT_HEAD; k++) out[k] = 0;
    /* the misses into their rows */
    if (nm) {
        for (int64_t i = 0; i < nm; i++)
            for (int64_t t = 0; t < T; t++) {
                uint64_t *pc = st->pieces + 3 * (i * T + t);
                pc[0] = st->src[miss[i]] + st->offs[t];
                pc[1] = rows[t] + (uint64_t)miss[i] * stride[t];
                pc[2] = st->sizes[t];
            }
        int64_t rc = submit(st, nm * T, pool, stream, status, ticket_event, out);
        if (rc) return rc;
    }
    out[OUT_MISSES] = nm;
    out[OUT_HITS] = nh;
    if (nm && status[ST_CUDA_WORD]) return MO_STEP_COPY;
    /* the hits from their slots (runs of neighbouring experts in neighbouring slots: one copy) */
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < nh;) {
            int64_t e = hit[i], s = st->lut[e], j = i + 1;
            while (j < nh && hit[j] == hit[j - 1] + 1 && st->lut[hit[j]] == st->lut[hit[j - 1]] + 1 &&
                   stride[t] == st->sizes[t] && st->dst[(s + 1) * T + t] == st->dst[s * T + t] + st->sizes[t])
                j++;
            int err = st->memcpy_async((void *)(uintptr_t)(rows[t] + (uint64_t)e * stride[t]),
                                       (const void *)(uintptr_t)st->dst[s * T + t],
                                       (size_t)(st->sizes[t] * (uint64_t)(j - i)), D2D, stream);
            if (err) { out[OUT_DETAIL] = err; return MO_STEP_CUDA; }
            i = j;
        }
    }
    if (!nm) return 0; /* nothing fetched: the Python path calls no admit either */
    /* ExpertCache.admit, committed first; then each admitted slot's copy from its row */
    int64_t adm[2 * MAX_EXPERTS], na = 0;
    int64_t n_adm = mo_step_admit(st, used, nu, hit, nh, miss, nm, max_admit, adm, out);
    for (int64_t i = 0; i < n_adm; i++) {
        int64_t e = miss[adm[2 * i]], s = adm[2 * i + 1];
        for (int64_t t = 0; t < T; t++) {
            int err = st->memcpy_async((void *)(uintptr_t)st->dst[s * T + t],
                                       (const void *)(uintptr_t)(rows[t] + (uint64_t)e * stride[t]),
                                       (size_t)st->sizes[t], D2D, stream);
            if (err) { /* this slot's bytes are unknown, the later ones never came: they stay empty */
                for (int64_t k = i; k < n_adm; k++) mo_step_forget(st, miss[adm[2 * k]], adm[2 * k + 1]);
                out[OUT_DETAIL] = err;
                out[OUT_ADMITTED] = na;
                return MO_STEP_CUDA;
            }
        }
        pairs[2 * na] = e;
        pairs[2 * na + 1] = s;
        na++;
    }
    out[OUT_ADMITTED] = na;
    return nm;
}

/* ExpertCache.admit for a sparse call whose misses are being fetched (mo_step_sparse's and the
 * async sparse step's decisions), committed: the clock advances, the routed experts' scores are
 * touched, the hits' slots marked used; then up to ``max_admit`` misses, the hottest first
 * (np.argsort(-decayed, kind="stable")), each take a victim (free slots first, hits spared) whose
 * holder's decayed use is lower (``_displaces``). adm: (index in miss, slot) per admitted miss, in
 * admission order; the victims' old experts are evicted (out: evictions, wasted hints). Returns how
 * many were admitted. The caller copies their bytes. */
int64_t mo_step_admit(mo_step *st, const int64_t *used, int64_t nu, const int64_t *hit, int64_t nh,
                      const int64_t *miss, int64_t nm, int64_t max_admit, int64_t *adm, int64_t *out) {
    int64_t S = st->S, nowv = *st->now + 1;
    *st->now = nowv;
    mo_step_touch(st, used, nu, nowv);
    uint8_t prot[MAX_EXPERTS];
    memset(prot, 0, (size_t)S);
    for (int64_t i = 0; i < nh; i++) {
        int64_t s = st->lut[hit[i]];
        prot[s] = 1;
        st->used[s] = 1;
        st->use_call[s] = nowv;
    }
    int64_t want = nm < max_admit ? nm : (max_admit > 0 ? max_admit : 0);
    if (!want) return 0;
    int64_t vic[MAX_EXPERTS];
    int64_t nv = mo_step_victims(st, nowv, want, prot, vic);
    if (!nv) return 0;
    int64_t order[MAX_EXPERTS];
    double dw[MAX_EXPERTS];
    for (int64_t i = 0; i < nm; i++) { order[i] = i; dw[i] = mo_step_decayed(st, miss[i], nowv); }
    for (int64_t i = 1; i < nm; i++) {
        int64_t v = order[i], j = i - 1;
        while (j >= 0 && -dw[order[j]] > -dw[v]) { order[j + 1] = order[j]; j--; }
        order[j + 1] = v;
    }
    int64_t na = 0;
    for (int64_t i = 0; i < nv; i++) {
        int64_t m = order[i], e = miss[m], s = vic[i];
        if (st->owner_li[s] >= 0 && !(dw[m] > mo_step_decayed(st, st->owner_e[s], nowv))) continue;
        mo_step_evict(st, s, out);
        st->owner_li[s] = st->li;
        st->owner_e[s] = e;
        st->lut[e] = s;
        st->hinted[s] = 0;
        st->used[s] = 1;
        st->use_call[s] = nowv;
        adm[2 * na] = m;
        adm[2 * na + 1] = s;
        na++;
    }
    return na;
}
