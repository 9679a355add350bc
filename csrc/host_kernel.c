/* Host compute of W4A16 MoE experts straight from Marlin words (mmap_offload/host/kernel.py).

One expert's MLP, out = down(silu(gate(x)) * up(x)), for a few token rows, reading the Marlin-repacked
words and Marlin-permuted scales exactly as vLLM's MoE kernel (and the cache) holds them: no second
layout, no per-call repacking. Built without global -m flags: the SIMD paths carry target attributes and
are chosen at run time (mo_host_isa_available).

Marlin word layout (docs/LAYOUTS.md): matrix W[K, N] (K input, N output) is int32 [K/16, 2N]; tile
(kt, nt) of 16 x 64 values is 128 consecutive words at (kt*N/64 + nt)*128; word w = 16b + 4a + j of a
tile (lane i = 4b + a) holds in nibble t = 4l + 2g + h the value u = q + 8 of
W[kt*16 + 8h + 2a + l, nt*64 + 16j + 8g + b]. So one 64-byte line of a tile (fixed b, 16 words) covers
the columns n = 16j + 8g + b (8 of them) and all 16 k of the tile; its lanes (a, j) accumulate per
nibble into two vectors (g = 0, 1), and the four lanes a of one column are summed once per tile column
at the end. The uint4b8 offset folds into a per-block sum of x: sum_k x_k (u_k - 8) s = s (sum_k x_k
u_k - 8 sum_k x_k).

Work: w13 is one Marlin matrix with N = 2I (gate tiles 0..I/64-1, up tiles after them). Units are
(job, k chunk, column range): phase 1 of w13 (ranges of gate/up tile pairs), phase 2 of w2 (ranges of
output tiles); threads take them one at a time from one counter (the MLP task, below, says why K is split).
A unit computes its range as segments of adjacent tiles: k blocks outer, the segment's tiles inner, so
each k-tile row is read as one contiguous run (the next tile is prefetched in software) and x is expanded
once per block for the whole segment. The last chunk of a (job, range) sums the chunks' partials: phase
1 then writes silu(gate) * up into the job's fp32 intermediate, phase 2 weights every job's rows into an
fp32 accumulator per out row, rounded once into out. The pool's threads are this library's (vLLM workers run
with OMP_NUM_THREADS=1); the calling thread is worker 0.
*/

#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sigbus_guard.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define MO_X86 1
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define MO_X86 0
#define CPU_RELAX() ((void)0)
#endif

#define MO_HOST_ABI 2

/* 2 was the fp32 AVX-512 path, removed in session 15 (avx512bw ahead of it at every M measured); 3 the
   AVX-512 BF16 path, removed in session 16 (avx512vnni ahead of it everywhere on the H200's host) */
enum { ISA_PLAIN = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 4, ISA_AVX512VNNI_NOVBMI = 5, ISA_AVX512BW = 6, ISA_AVXVNNI = 7 };
enum { DT_BF16 = 0, DT_FP16 = 1, DT_FP32 = 2 };

typedef struct {
    const int64_t *rows;     /* [m] rows of x and of out */
    const float *weights;    /* [m] routing weights (NULL: 1) */
    int64_t m;
    const uint32_t *w13;     /* Marlin [H/16, 4I] */
    const void *s13;         /* [G13, 2I], permuted */
    const uint32_t *w2;      /* Marlin [I/16, 2H] */
    const void *s2;          /* [G2, H], permuted */
    int32_t gs13, gs2;       /* k per scale group (K when one group) */
    int32_t grouped13, grouped2; /* scale permutation: 1 = 64-chunks, 0 = 32-chunks (channelwise) */
    int32_t sdtype;          /* DT_* of the scales */
    int32_t pad;
} mo_job_t;

int mo_host_abi(void) { return MO_HOST_ABI; }

#if MO_X86
/* What every AVX-512 path needs (its x loads and scale handling use AVX2, FMA and F16C too). */
static int cpu_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

int mo_host_isa_available(int isa) {
#if MO_X86
    __builtin_cpu_init();
    if (isa == ISA_AVX512VNNI) return mo_host_isa_available(ISA_AVX512VNNI_NOVBMI) && __builtin_cpu_supports("avx512vbmi");
    if (isa == ISA_AVX512VNNI_NOVBMI) return mo_host_isa_available(ISA_AVX512BW) && __builtin_cpu_supports("avx512vnni");
    if (isa == ISA_AVX512BW) return cpu_avx512();
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                __builtin_cpu_supports("f16c");
#ifndef MO_NO_AVXVNNI /* (native.py's second build try, where the assembler lacks AVX-VNNI's {vex} form) */
    if (isa == ISA_AVXVNNI) { /* CPUID.(7, 1):EAX bit 4 (asked directly: older compilers lack the builtin's name) */
        unsigned a = 0, b = 0, c = 0, d = 0;
        return mo_host_isa_available(ISA_AVX2) && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
    }
#endif
#endif
    return isa == ISA_PLAIN;
}

/* ------------------------------------------------------------------ scalar conversions */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        u = sign | 0x7f800000 | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline uint16_t f32_to_fp16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds to >= 65520: inf */
    if (a < 0x38800000) { /* subnormal half (or zero): round a / 2^-24 to an integer, ties to even */
        float v;
        memcpy(&v, &a, 4);
        v = v * 16777216.0f;                 /* exact: a power of two */
        uint32_t r = (uint32_t)nearbyintf(v); /* default rounding mode: to nearest even */
        return (uint16_t)(sign | r);
    }
    uint32_t r = a + 0xfff + ((a >> 13) & 1) - (112u << 23);
    return (uint16_t)(sign | (r >> 13));
}

static inline float load_scalar(const void *p, int64_t i, int dt) {
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == DT_FP16) return fp16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline void store_scalar(void *p, int64_t i, int dt, float v) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else if (dt == DT_FP16) ((uint16_t *)p)[i] = f32_to_fp16(v);
    else ((float *)p)[i] = v;
}

/* Position of tile-local column n (0..63) in the permuted scales of its 64 columns. */
static inline int scale_pos(int n, int grouped) {
    if (grouped) return 8 * (n & 7) + (n >> 3);                   /* out[8i + j] = in[i + 8j] */
    int c = n >> 5, q = n & 31;                                    /* out[8i + m] = in[2i + P[m]] */
    return 32 * c + 8 * ((q & 7) >> 1) + 2 * (q >> 3) + (q & 1);
}

/* ------------------------------------------------------------------ one matrix, one tile column */

typedef struct {
    const uint32_t *w;
    const void *s;
    int64_t K, N;
    int gs, grouped, sdt;
} mat_t;

typedef struct {
    const void *const *xrow; /* M row pointers, each K elements of dtype xdt */
    int xdt;
    int M;
} act_t;

/* k per block: one scale group at most, 128 at most (the expanded x of a block stays in L1). */
static inline int block_k(const mat_t *A) {
    if (A->gs >= A->K || A->gs % 128 == 0) return 128;
    return A->gs % 64 == 0 ? 64 : (A->gs % 32 == 0 ? 32 : 16);
}

/* scv[(b*2 + g)*4 + j] = scale of column 16j + 8g + b of tile nt, group grp. */
static inline void tile_scales(const mat_t *A, int64_t nt, int64_t grp, float *scv) {
    const int64_t base = grp * A->N + nt * 64;
    for (int b = 0; b < 8; b++)
        for (int g = 0; g < 2; g++)
            for (int j = 0; j < 4; j++)
                scv[(b * 2 + g) * 4 + j] = load_scalar(A->s, base + scale_pos(16 * j + 8 * g + b, A->grouped), A->sdt);
}

/* Plain C: ytile[m*64 + n] for the tile's 64 columns n. scratch: >= 64*M + 64 floats. */
static void tile_plain(const mat_t *A, int64_t nt, const act_t *X, float *ytile, float *scratch) {
    const int M = X->M;
    const int64_t NT = A->N / 64;
    float *gacc = scratch;            /* [M][64] per block */
    float *scv = scratch + 64 * M;    /* 64 */
    float xk[16];
    int64_t cur = -1;
    const int BK = block_k(A);
    for (int m = 0; m < M; m++) memset(ytile + 64 * m, 0, 64 * sizeof(float));
    for (int64_t k0 = 0; k0 < A->K; k0 += BK) {
        int64_t k1 = k0 + BK < A->K ? k0 + BK : A->K;
        int64_t grp = k0 / A->gs;
        if (grp != cur) { tile_scales(A, nt, grp, scv); cur = grp; }
        memset(gacc, 0, sizeof(float) * 64 * M);
        for (int m = 0; m < M; m++) {
            float xsum = 0.f;
            for (int64_t kt = k0 / 16; kt < k1 / 16; kt++) {
                for (int k = 0; k < 16; k++) { xk[k] = load_scalar(X->xrow[m], kt * 16 + k, X->xdt); xsum += xk[k]; }
                const uint32_t *tw = A->w + (kt * NT + nt) * 128;
                for (int b = 0; b < 8; b++)
                    for (int a = 0; a < 4; a++)
                        for (int j = 0; j < 4; j++) {
                            uint32_t word = tw[16 * b + 4 * a + j];
                            for (int t = 0; t < 8; t++) {
                                int l = t >> 2, g = (t >> 1) & 1, h = t & 1;
                                gacc[m * 64 + 16 * j + 8 * g + b] += xk[8 * h + 2 * a + l] * (float)((word >> (4 * t)) & 15);
                            }
                        }
            }
            for (int b = 0; b < 8; b++)
                for (int g = 0; g < 2; g++)
                    for (int j = 0; j < 4; j++) {
                        int n = 16 * j + 8 * g + b;
                        ytile[m * 64 + n] += scv[(b * 2 + g) * 4 + j] * (gacc[m * 64 + n] - 8.f * xsum);
                    }
        }
    }
}

/* Segments: C adjacent tiles of one matrix, k blocks outer and tiles inner, so that a thread reads each k-tile
   row as one contiguous run of C * 512 bytes (the hardware's stream prefetchers follow runs within a page;
   a lone 512-byte tile per row is a new page each time) and expands x once per block for all C tiles.
   The accumulators of the C tiles (16 M vectors each) live in scratch; seg_tiles keeps them near L1. */
#ifndef SEG_TM
#define SEG_TM 128 /* tiles x rows of one segment (measured: 16 and 32 are slower at M >= 8) */
#endif
#ifndef SEG_MAX
#define SEG_MAX 16 /* tiles of one segment at most: 8 KiB runs of each k-tile row */
#endif
static inline int seg_tiles(int M) { return M >= SEG_TM ? 1 : (SEG_TM / M < SEG_MAX ? SEG_TM / M : SEG_MAX); }

#if MO_X86
/* ------------------------------------------------------------------ AVX-512 */
/* Build-time knobs (-D): prefetch the tile PF_DIST ahead into PF_HINT. Session 13, the H200's Intel host
   (16 cores, scripts/host_kernel_sweep.sh): into L2 (T1) beat L1 (T0) at M = 1 for both shapes and 8 and
   16 threads, by 6-17% (16 threads: user 57.0 vs 53.3 GB/s, mixtral 71.2 vs 66.0), and at M = 3 in 3 of 4;
   2 or 4 tiles ahead were 9-40% slower. The 2-core AMD build box: T1 within its noise (-5% to +16%). */
#ifndef PF_DIST
#define PF_DIST 1
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
/* The first 8 k-tile rows of a segment's lines (the block loops prefetch one tile ahead from there on). */
static inline void prefetch_head(const mat_t *A, int64_t nt0) {
    const int64_t rows = A->K / 16 < 8 ? A->K / 16 : 8, stride = A->N / 64 * 128;
    for (int64_t kt = 0; kt < rows; kt++)
        for (int b = 0; b < 8; b++)
            _mm_prefetch((const char *)(A->w + kt * stride + nt0 * 128 + 16 * b), _MM_HINT_T0);
}

/* The tile read after tile i of C in a block that ends before element k1 (row0: its first row of tile 0):
   the next one of the block, else one of the next block; NULL after the last. */
static inline const uint32_t *next_tile(const mat_t *A, const uint32_t *row0, int i, int C, int64_t k1, int nkt) {
    const int64_t stride = A->N / 64 * 128;
    if (PF_DIST <= 0) return NULL; /* -DPF_DIST=0: no software prefetch (the hardware's alone) */
    if (i + PF_DIST < C) return row0 + 128 * (i + PF_DIST);
    return k1 < A->K ? row0 + nkt * stride + 128 * (i + PF_DIST - C) : NULL;
}

#define T512 __attribute__((target("avx512f,avx2,fma,f16c")))

T512 static inline __m512 load16_512(const void *p, int64_t i, int dt) {
    if (dt == DT_FP32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (dt == DT_FP16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* scv[i] (4 vectors, entry (b*2 + g)*4 + j) from the tile's 64 permuted scales sraw (4 vectors): each output
   vector draws from at most two source vectors (both permutations: checked by make_sperm), one permute. */
typedef struct { int src0[4], src1[4]; int idx[4][16]; } sperm_t;

static inline void make_sperm(int grouped, sperm_t *S) {
    for (int i = 0; i < 4; i++) {
        int lo = 99, hi = -1;
        for (int e = 0; e < 16; e++) {
            int b = 2 * i + (e >> 3), g = (e >> 2) & 1, j = e & 3, v = scale_pos(16 * j + 8 * g + b, grouped) >> 4;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        S->src0[i] = lo;
        S->src1[i] = hi;
        for (int e = 0; e < 16; e++) {
            int b = 2 * i + (e >> 3), g = (e >> 2) & 1, j = e & 3, pos = scale_pos(16 * j + 8 * g + b, grouped);
            S->idx[i][e] = ((pos >> 4) == lo ? 0 : 16) + (pos & 15); /* hi - lo <= 1 source apart: see tests */
        }
    }
}

T512 static inline void seg_scales512(const mat_t *A, int64_t nt, int64_t grp, const sperm_t *S, float *scv) {
    const int64_t base = grp * A->N + nt * 64;
    __m512 raw[4];
    for (int i = 0; i < 4; i++) raw[i] = load16_512(A->s, base + 16 * i, A->sdt);
    for (int i = 0; i < 4; i++)
        _mm512_store_ps(scv + 16 * i, _mm512_permutex2var_ps(raw[S->src0[i]],
                                                             _mm512_loadu_si512((const void *)S->idx[i]),
                                                             raw[S->src1[i]]));
}

/* The two scale permutations (channelwise, grouped), made once (mo_host_create). */
static sperm_t SPERM[2];
static pthread_once_t sperm_once = PTHREAD_ONCE_INIT;
static void make_sperms(void) {
    make_sperm(0, &SPERM[0]);
    make_sperm(1, &SPERM[1]);
}

/* A segment's start (the AVX-512 paths share it): the accumulators of its C tiles zeroed,
   its first rows prefetched; returns the matrix's scale permutation. */
T512 static inline const sperm_t *seg_start512(const mat_t *A, int64_t nt0, int C, int M, __m512 *T) {
    for (int i = 0; i < C; i++)
        for (int k = 0; k < 16 * M; k++) T[i * 16 * M + k] = _mm512_setzero_ps();
    prefetch_head(A, nt0);
    return &SPERM[A->grouped ? 1 : 0];
}

/* The k block at k0 (<= BK k, one scale group at most): *k1 its end; the segment's scales reloaded when it
   starts a new group (*cur: the group loaded). Returns its k tiles. */
T512 static inline int block_start512(const mat_t *A, int64_t nt0, int C, int64_t k0, int BK, int64_t *k1,
                                      int64_t *cur, const sperm_t *S, float *scv) {
    *k1 = k0 + BK < A->K ? k0 + BK : A->K;
    const int64_t grp = k0 / A->gs;
    if (grp != *cur) {
        for (int i = 0; i < C; i++) seg_scales512(A, nt0 + i, grp, S, scv + 64 * i);
        *cur = grp;
    }
    return (int)((*k1 - k0) / 16);
}

/* The tile's accumulators to ytile (once per tile, after its last k block; the AVX-512 paths share it):
   lanes 4a + j of T[b][g][m] -> column 16j + 8g + b, summed over a. */
T512 static inline void store_tile512(const __m512 *T, int M, float *ytile) {
    for (int b = 0; b < 8; b++)
        for (int g = 0; g < 2; g++)
            for (int m = 0; m < M; m++) {
                __m512 v = T[(b * 2 + g) * M + m];
                __m128 r = _mm_add_ps(_mm_add_ps(_mm512_extractf32x4_ps(v, 0), _mm512_extractf32x4_ps(v, 1)),
                                      _mm_add_ps(_mm512_extractf32x4_ps(v, 2), _mm512_extractf32x4_ps(v, 3)));
                float o[4];
                _mm_storeu_ps(o, r);
                for (int j = 0; j < 4; j++) ytile[m * 64 + 16 * j + 8 * g + b] = o[j];
            }
}

/* ------------------------------------------------------------------ AVX-512 VNNI (integer dot products), with or without VBMI */
/* The same tiles with vpdpbusd (4 u8 x s8 products per 32-bit lane). The four nibbles of one column in a
   word (g fixed: t = 2g + h + 4l, k = 8h + 2a + l) are one lane's four bytes after one vpmultishiftqb
   (bytes at bit offsets 0, 4, 16, 20 of each dword for g = 0; 8, 12, 24, 28 for g = 1) and one AND with
   0x0F: two shuffles, two ANDs and two dot products per 64-byte line and x part, where the bf16 path (vdpbf16ps,
   removed in session 16: slower on the H200's Intel host at every shape, thread count and M measured) needed
   eight shift / ternary ops and four dot products. x is not bf16 here but 16-bit fixed point, per
   row and k block (<= 128, within one scale group): q = round(x * 32639 / max|x|), stored as two signed
   bytes hi = (q + 128) >> 8 and lo = q - 256 hi, each with its own accumulator; the block's integer sum
   256 acc_hi + acc_lo - 8 sum q is exact in int32, converted to fp32 once per block and scaled by
   s_w max|x| / 32639. Error per x element <= max|x| / 65278 (x in bf16 rounds at 2^-9 of itself); the
   fp32 intermediate of phase 2 the same way. Without VBMI (Cascade / Cooper Lake: path avx512vnni-novbmi)
   a shift, a ternary-logic select and an AND per g take the shuffle's place (and two shifts for g = 1).
   Without VNNI either (Skylake-SP: path avx512bw) vpmaddubsw + a 16-bit add take vpdpbusd's place, summed
   in 16 bits over the block's <= 8 k tiles (<= 30720) and widened once per block (as the avx2 path). One
   body serves the three, compiled for AVX-512BW alone: the VBMI shuffle and the VNNI dot product are
   inline asm, run only where the CPU has them. */
#define T512VN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define VN_QMAX 32639.f /* q = 256 hi + lo with hi, lo in [-128, 127] */

/* The fixed-point scale of a block whose largest |x| is amax (NaN if it holds a NaN): q = x * *pre * inv
   with inv returned, *sx = amax / VN_QMAX. Below 2^-60, *pre = 2^64 (exact) keeps VN_QMAX / amax finite
   (it overflows below ~1e-34; such blocks occur in the SiLU * up intermediate of tiny rows). A zero block:
   inv and *sx 0. A NaN, or amax > 3e38 (inf): *sx NaN or inf and q = 0, so the outputs are not finite
   either (never finite garbage). */
static inline float q16_scale(float amax, float *sx, float *pre) {
    const int ok = amax > 0.f && amax <= 3.0e38f;
    *pre = amax < 0x1p-60f ? 0x1p64f : 1.f;
    *sx = ok ? amax / VN_QMAX : (amax == 0.f ? 0.f : amax * 2.f);
    return ok ? VN_QMAX / (amax * *pre) : 0.f;
}

/* acc += u8 a . s8 b as one instruction on the accumulator's register: GCC 12's intrinsic copies the
   accumulator to a fresh register and back around each dot product and spills the copies (measured:
   user shape in L3, one thread, the build box's Zen 4: 26.9 -> 28.1 GB/s at M = 1, 7.2 -> 12.0 at M = 3). */
T512VN static inline __m512i dot_u8s8(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}

/* acc += u8 a . s8 b in 16-bit lanes, a pair of products each (no VNNI) */
T512VN static inline __m512i dot_u8s8_16(__m512i acc, __m512i a, __m512i b) {
    return _mm512_add_epi16(acc, _mm512_maddubs_epi16(a, b));
}

/* Column g's four nibbles of each dword of w in its four bytes (k = 2a, 2a + 8, 2a + 1, 2a + 9). VB: with
   VBMI's vpmultishiftqb (bytes at bit offsets 0, 4, 16, 20, or 8, 12, 24, 28), else (w & 0x000F000F) |
   (w << 4 & 0x0F000F00) for g = 0 and the same of w >> 8 for g = 1, as one select and one AND. */
T512VN static inline __attribute__((always_inline)) __m512i nibbles_vn(__m512i w, const int g, const int VB) {
    const __m512i m15 = _mm512_set1_epi8(15);
    if (VB) {
        const __m512i ctl = g ? _mm512_set1_epi64(0x3C382C281C180C08LL) : _mm512_set1_epi64(0x3430242014100400LL);
        __m512i r;
        __asm__("vpmultishiftqb %2, %1, %0" : "=v"(r) : "v"(ctl), "vm"(w));
        return _mm512_and_si512(r, m15);
    }
    const __m512i lo = g ? _mm512_srli_epi32(w, 8) : w, hi = g ? _mm512_srli_epi32(w, 4) : _mm512_slli_epi32(w, 4);
    /* 0xE4 = c ? a : b: lo's bits where 0x000F000F, hi's elsewhere; the AND keeps the low nibbles */
    return _mm512_and_si512(_mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi32(0x000F000F), 0xE4), m15);
}

/* Lines per pass for MB <= 3 rows: 4 * LB * MB accumulators (hi, lo; g = 0, 1) <= 24. */
static inline int vn_lines(int mb, int width) {
    int lb = mb == 1 ? 4 : 2;
    while (lb > width) lb >>= 1;
    return lb;
}

/* LB consecutive lines x MB rows over the block's nkt k-tiles (k-tile rows in order, LB * 64 contiguous bytes
   each; pf (or NULL): the same lines of the tile read next, prefetched one row per row read); xe: [kt][hi,
   lo][M] byte vectors; xq: [M] per-lane sums of q; sx: [M] x scales. T += s_w sx (256 hi + lo - 8 xq). */
T512VN static inline __attribute__((always_inline)) void
blk512vn(const uint32_t *wb, const uint32_t *pf, int64_t stride, int nkt, const __m512i *xe, int M,
         const __m512i *xq, const float *sx, __m512 *T, const float *scv, const int LB, const int MB, const int VB,
         const int VNNI) {
    __m512i acc[24]; /* [LB][g][MB][hi, lo]: LB * MB <= 6 */
#pragma GCC unroll 24
    for (int i = 0; i < 4 * LB * MB; i++) acc[i] = _mm512_setzero_si512();
    for (int kt = 0; kt < nkt; kt++) {
        const uint32_t *wk = wb + kt * stride;
        const __m512i *xk = xe + kt * 2 * M;
        if (pf) {
#pragma GCC unroll 4
            for (int lb = 0; lb < LB; lb++) _mm_prefetch((const char *)(pf + kt * stride + 16 * lb), PF_HINT);
        }
#ifdef DIAG_LOADS_ONLY
        /* diagnostic build only (scripts/host_kernel_sweep.sh): the same loads, prefetches and schedule,
           one XOR per word instead of the arithmetic; the results are wrong. It tells whether the loop's
           rate is bound by its reads or by its arithmetic. */
#pragma GCC unroll 4
        for (int lb = 0; lb < LB; lb++)
            acc[lb] = _mm512_xor_si512(acc[lb], _mm512_loadu_si512((const void *)(wk + 16 * lb)));
        (void)xk;
        continue;
#endif
#pragma GCC unroll 4
        for (int lb = 0; lb < LB; lb++) {
            __m512i wv = _mm512_loadu_si512((const void *)(wk + 16 * lb));
            __m512i w0 = nibbles_vn(wv, 0, VB), w1 = nibbles_vn(wv, 1, VB);
#pragma GCC unroll 4
            for (int m = 0; m < MB; m++)
#pragma GCC unroll 2
                for (int p = 0; p < 2; p++) {
                    __m512i xv = _mm512_load_si512((const void *)(xk + p * M + m));
                    __m512i *a0 = acc + ((lb * 2 + 0) * MB + m) * 2 + p, *a1 = acc + ((lb * 2 + 1) * MB + m) * 2 + p;
                    *a0 = VNNI ? dot_u8s8(*a0, w0, xv) : dot_u8s8_16(*a0, w0, xv);
                    *a1 = VNNI ? dot_u8s8(*a1, w1, xv) : dot_u8s8_16(*a1, w1, xv);
                }
        }
    }
#pragma GCC unroll 4
    for (int lb = 0; lb < LB; lb++)
#pragma GCC unroll 2
        for (int g = 0; g < 2; g++) {
            __m512 sv = _mm512_broadcast_f32x4(_mm_loadu_ps(scv + (lb * 2 + g) * 4));
#pragma GCC unroll 4
            for (int m = 0; m < MB; m++) {
                const __m512i *a = acc + ((lb * 2 + g) * MB + m) * 2, ones = _mm512_set1_epi16(1);
                const __m512i ahi = VNNI ? a[0] : _mm512_madd_epi16(a[0], ones), alo = VNNI ? a[1] : _mm512_madd_epi16(a[1], ones);
                __m512i r = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(ahi, 8), alo), _mm512_slli_epi32(xq[m], 3));
                /* sx r first: sx alone may be denormal (tiny blocks), sv sx more so */
                T[(lb * 2 + g) * M + m] = _mm512_fmadd_ps(sv, _mm512_mul_ps(_mm512_cvtepi32_ps(r), _mm512_set1_ps(sx[m])),
                                                          T[(lb * 2 + g) * M + m]);
            }
        }
}

#define MO_VN_CASES(F) F(1, 4) F(1, 2) F(1, 1) F(2, 2) F(2, 1) F(3, 2) F(3, 1)

/* One register pass of mb rows x lb lines: kind, the CPU's, 2 = VBMI + VNNI, 1 = VNNI, 0 = neither; xe and xq
   (the expanded x and the rows' sums of q) and sx (x scales) start at the pass's first row; T: the pass's
   accumulators. */
T512VN static void run512vn(int kind, int mb, int lb, const uint32_t *wb, const uint32_t *pf, int64_t stride, int nkt,
                            const __m512i *xe, int M, const __m512i *xq, const float *sx, __m512 *T, const float *scv) {
#define F(MBV, LBV)                                                                                            \
    if (mb == MBV && lb == LBV) {                                                                              \
        if (kind == 2) blk512vn(wb, pf, stride, nkt, xe, M, xq, sx, T, scv, LBV, MBV, 1, 1);                   \
        else if (kind == 1) blk512vn(wb, pf, stride, nkt, xe, M, xq, sx, T, scv, LBV, MBV, 0, 1);              \
        else blk512vn(wb, pf, stride, nkt, xe, M, xq, sx, T, scv, LBV, MBV, 0, 0);                             \
        return;                                                                                                \
    }
    MO_VN_CASES(F)
#undef F
}

/* The passes of one k block [k0, k1) (nkt k tiles) over a segment's C tiles (the three integer AVX-512
   paths; kind as run512vn): per tile, rows in passes of MB, lines in passes of vn_lines(mb, lines left);
   the first row pass prefetches the tile read next (next_tile). xe and xq start at row 0, as T. */
static void tiles512(const mat_t *A, int64_t nt0, int C, int64_t k0, int64_t k1, int nkt, int M, int MB, int kind,
                     const __m512i *xe, const __m512i *xq, const float *sx, __m512 *T, const float *scv) {
    const int64_t stride = A->N / 64 * 128;
    const uint32_t *row0 = A->w + (k0 / 16) * stride + nt0 * 128;
    for (int i = 0; i < C; i++) {
        const uint32_t *w0 = row0 + 128 * i, *pf = next_tile(A, row0, i, C, k1, nkt);
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mb = M - m0 < MB ? M - m0 : MB;
            for (int b = 0, lb; b < 8; b += lb) {
                lb = vn_lines(mb, 8 - b);
                run512vn(kind, mb, lb, w0 + 16 * b, m0 == 0 && pf ? pf + 16 * b : NULL, stride, nkt, xe + m0, M,
                         xq + m0, sx + m0, T + (size_t)i * 16 * M + (size_t)b * 2 * M + m0, scv + 64 * i + b * 8);
            }
        }
    }
}

/* y[(i*M + m)*64 + n] for tiles nt0 + i (i < C <= seg_tiles(M)), its 64 columns n; kind: as
   run512vn. */
T512VN static void seg512vn_(const mat_t *A, int64_t nt0, int C, const act_t *X, float *y,
                             float *scratch, int kind) {
    const int M = X->M;
    __m512i *xe = (__m512i *)scratch;       /* [8 kt][hi, lo][M] */
    float *sx = (float *)(xe + 16 * M);     /* [M] (within xe's 32 M vectors) */
    __m512i *xq = xe + 32 * M;              /* [M] */
    __m512 *T = (__m512 *)(xq + M);         /* [C][8 b][2 g][M] */
    float *scv = (float *)(T + 16 * M * C); /* [C][64] */
    const int BK = block_k(A);
    const int nb = (M + 2) / 3, MB = (M + nb - 1) / nb; /* rows per pass <= 3 (measured: 4 is slower) */
    __m512i idx; /* byte 4j + e of 128-bit lane a (lane p = 4a + j): x of k = 2a + (0, 8, 1, 9)[e]; vpshufb */
    {
        uint8_t v[64];
        static const int ke[4] = {0, 8, 1, 9};
        for (int p = 0; p < 16; p++)
            for (int e = 0; e < 4; e++) v[4 * p + e] = (uint8_t)(2 * (p >> 2) + ke[e]);
        idx = _mm512_loadu_si512((const void *)v);
    }
    const __m512i ones = _mm512_set1_epi8(1), ones16 = _mm512_set1_epi16(1), c128 = _mm512_set1_epi32(128);
    const sperm_t *S = seg_start512(A, nt0, C, M, T);
    int64_t cur = -1;
    for (int64_t k0 = 0, k1; k0 < A->K; k0 += BK) {
        const int nkt = block_start512(A, nt0, C, k0, BK, &k1, &cur, S, scv);
        for (int m = 0; m < M; m++) {
            __m512 mx = _mm512_setzero_ps();
            __mmask16 nan = 0; /* vmaxps drops a NaN operand: counted apart */
            for (int kt = 0; kt < nkt; kt++) {
                __m512 ax = _mm512_abs_ps(load16_512(X->xrow[m], k0 + 16 * kt, X->xdt));
                nan |= _mm512_cmp_ps_mask(ax, ax, _CMP_UNORD_Q);
                mx = _mm512_max_ps(mx, ax);
            }
            const float amax = nan ? NAN : _mm512_reduce_max_ps(mx);
            float pre;
            const __m512 vinv = _mm512_set1_ps(q16_scale(amax, &sx[m], &pre)), vpre = _mm512_set1_ps(pre);
            __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
            for (int kt = 0; kt < nkt; kt++) {
                __m512i q = _mm512_cvtps_epi32(
                    _mm512_mul_ps(_mm512_mul_ps(load16_512(X->xrow[m], k0 + 16 * kt, X->xdt), vpre), vinv));
                __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, c128), 8);
                __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8));
                /* the block's 16 bytes in every 128-bit lane, then each lane picks its a's */
                __m512i eh = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(hi)), idx);
                __m512i el = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(lo)), idx);
                _mm512_store_si512((void *)(xe + (kt * 2 + 0) * M + m), eh);
                _mm512_store_si512((void *)(xe + (kt * 2 + 1) * M + m), el);
                sh = _mm512_add_epi32(sh, _mm512_madd_epi16(_mm512_maddubs_epi16(ones, eh), ones16));
                sl = _mm512_add_epi32(sl, _mm512_madd_epi16(_mm512_maddubs_epi16(ones, el), ones16));
            }
            xq[m] = _mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl);
        }
        tiles512(A, nt0, C, k0, k1, nkt, M, MB, kind, xe, xq, sx, T, scv);
    }
    for (int i = 0; i < C; i++) store_tile512(T + i * 16 * M, M, y + (size_t)i * 64 * M);
}

/* The three integer AVX-512 paths as seg_fn: avx512vnni, avx512vnni-novbmi, avx512bw. */
T512VN static void seg512vn(const mat_t *A, int64_t nt0, int C, const act_t *X, float *y, float *scr) {
    seg512vn_(A, nt0, C, X, y, scr, 2);
}
T512VN static void seg512vn_novbmi(const mat_t *A, int64_t nt0, int C, const act_t *X, float *y,
                                   float *scr) {
    seg512vn_(A, nt0, C, X, y, scr, 1);
}
T512VN static void seg512bw(const mat_t *A, int64_t nt0, int C, const act_t *X, float *y, float *scr) {
    seg512vn_(A, nt0, C, X, y, scr, 0);
}

/* ------------------------------------------------------------------ AVX2 (+FMA, F16C): integer dot products */
#define T256 __attribute__((target("avx2,fma,f16c")))

T256 static inline __m256 load8_256(const void *p, int64_t i, int dt) {
    if (dt == DT_FP32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == DT_FP16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The avx512vnni scheme on AVX2 (no VBMI, no VNNI): a 32-byte half c of a line (words 16b + 8c + p, lane
   p: a = 2c + p/4, j = p%4) puts one column's four nibbles (k = 2a, 2a + 8, 2a + 1, 2a + 9) in one dword's
   bytes with two shifts, two ANDs and an OR per g ((w & 0x000F000F) | (w << 4 & 0x0F000F00), and the same
   of w >> 8 and w >> 4 for g = 1); vpmaddubsw multiplies them by x's signed bytes, a pair of products per
   16-bit lane (|sum| <= 2 * 15 * 128), summed in 16 bits over the block's <= 8 k tiles (<= 30720: no
   overflow) and widened once per block by vpmaddwd. x: 16-bit fixed point per row and k block, hi and lo
   bytes, as avx512vnni. Per half-line and row: 9 ops to unpack (shared by the rows), 2 x (multiply, add)
   per g, where the fp32 path it replaced spent a shift, an AND, a convert and an FMA per nibble (session
   15, build box, user shape in L3, one thread: 8.0 -> 12.4 GB/s at M = 1, 4.0 -> 5.4 at M = 3). */

/* acc += u8 a . s8 b, four products per 32-bit lane: AVX-VNNI's VEX-encoded vpdpbusd (Alder Lake and later
   client cores, Sierra Forest: AVX2 without AVX-512), as inline asm as the AVX-512 one (dot_u8s8, below), and
   "{vex}" so that an assembler never picks the EVEX form, which such CPUs lack. Run only where
   mo_host_isa_available(ISA_AVXVNNI). */
T256 static inline __m256i dot256_u8s8(__m256i acc, __m256i a, __m256i b) {
#ifndef MO_NO_AVXVNNI
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
#else
    (void)a, (void)b; /* never run: the path is unavailable in this build */
#endif
    return acc;
}

/* k-tile row kt of the half-line into accumulators [g][at + m][hi, lo] for rows m < MB (blk256i, below). */
T256 static inline __attribute__((always_inline)) void
kt256i(const uint32_t *wb, const uint32_t *pf, int64_t stride, int kt, const __m256i *xe, int M, int c,
       __m256i acc[2][2][2], const int MB, const int at, const int VNNI) {
    const __m256i m1 = _mm256_set1_epi32(0x000F000F), m2 = _mm256_set1_epi32(0x0F000F00);
    if (pf) _mm_prefetch((const char *)(pf + kt * stride), PF_HINT); /* 32 bytes: within one line */
    const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + kt * stride));
    const __m256i g0 = _mm256_or_si256(_mm256_and_si256(w, m1), _mm256_and_si256(_mm256_slli_epi32(w, 4), m2));
    const __m256i g1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w, 8), m1),
                                       _mm256_and_si256(_mm256_srli_epi32(w, 4), m2));
    const __m256i *xk = xe + (kt * 2 + c) * 2 * M;
#pragma GCC unroll 2
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            const __m256i xv = _mm256_load_si256(xk + p * M + m);
            if (VNNI) {
                acc[0][at + m][p] = dot256_u8s8(acc[0][at + m][p], g0, xv);
                acc[1][at + m][p] = dot256_u8s8(acc[1][at + m][p], g1, xv);
            } else {
                acc[0][at + m][p] = _mm256_add_epi16(acc[0][at + m][p], _mm256_maddubs_epi16(g0, xv));
                acc[1][at + m][p] = _mm256_add_epi16(acc[1][at + m][p], _mm256_maddubs_epi16(g1, xv));
            }
        }
}

/* One half-line c of a line x MB <= 2 rows (a whole line at once spills at MB = 1: 16 ymm registers, measured
   no faster), 4 MB accumulators [g][m][hi, lo]: 16-bit pairs of products (vpmaddubsw), or with VNNI 32-bit
   quadruples (vpdpbusd: one instruction for the multiply, the add and the widening). xe: [kt][c][hi, lo][M];
   xq: [c][M] lane sums of q; scv: the line's scales; T: [g][M] of this half. */
T256 static inline __attribute__((always_inline)) void
blk256i(const uint32_t *wb, const uint32_t *pf, int64_t stride, int nkt, const __m256i *xe, int M, int c,
        const __m256i *xq, const float *sx, __m256 *T, const float *scv, const int MB, const int VNNI) {
    __m256i acc[2][2][2];
#pragma GCC unroll 2
    for (int g = 0; g < 2; g++)
#pragma GCC unroll 2
        for (int m = 0; m < 2; m++) acc[g][m][0] = acc[g][m][1] = _mm256_setzero_si256();
    if (VNNI && MB == 1) { /* one row: even k tiles into slot 0, odd into slot 1 (the idle row's), so that
                              vpdpbusd's latency (a chain through its accumulator) is paid on 8 chains, not 4 */
        int kt = 0;
        for (; kt + 1 < nkt; kt += 2) {
            kt256i(wb, pf, stride, kt, xe, M, c, acc, 1, 0, 1);
            kt256i(wb, pf, stride, kt + 1, xe, M, c, acc, 1, 1, 1);
        }
        if (kt < nkt) kt256i(wb, pf, stride, kt, xe, M, c, acc, 1, 0, 1);
#pragma GCC unroll 2
        for (int g = 0; g < 2; g++)
#pragma GCC unroll 2
            for (int p = 0; p < 2; p++) acc[g][0][p] = _mm256_add_epi32(acc[g][0][p], acc[g][1][p]);
    } else {
        for (int kt = 0; kt < nkt; kt++) kt256i(wb, pf, stride, kt, xe, M, c, acc, MB, 0, VNNI);
    }
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 2
    for (int g = 0; g < 2; g++) {
        const __m256 sv = _mm256_broadcast_ps((const __m128 *)(scv + g * 4)); /* columns j, both 128-bit halves */
#pragma GCC unroll 2
        for (int m = 0; m < MB; m++) {
            __m256i hi = VNNI ? acc[g][m][0] : _mm256_madd_epi16(acc[g][m][0], ones),
                    lo = VNNI ? acc[g][m][1] : _mm256_madd_epi16(acc[g][m][1], ones);
            __m256i r = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo), _mm256_slli_epi32(xq[c * M + m], 3));
            __m256 *Tp = T + g * M + m;
            *Tp = _mm256_fmadd_ps(sv, _mm256_mul_ps(_mm256_cvtepi32_ps(r), _mm256_set1_ps(sx[m])), *Tp); /* as blk512vn */
        }
    }
}

/* y[(i*M + m)*64 + n] for tiles nt0 + i (i < C <= seg_tiles(M)), its 64 columns n (VNNI: the avxvnni path). */
T256 static inline __attribute__((always_inline)) void
seg256i_(const mat_t *A, int64_t nt0, int C, const act_t *X, float *y, float *scratch, const int VNNI) {
    const int M = X->M;
    const int64_t NT = A->N / 64, stride = NT * 128;
    __m256i *xe = (__m256i *)scratch;       /* [8 kt][2 c][hi, lo][M] */
    float *sx = (float *)(xe + 32 * M);     /* [M] (within the 64 M vectors before xq) */
    __m256i *xq = xe + 64 * M;              /* [2 c][M] */
    __m256 *T = (__m256 *)(xq + 2 * M);     /* [C][8 b][2 c][2 g][M] */
    float *scv = (float *)(T + 32 * M * C); /* [C][64] */
    const int BK = block_k(A);
    const int nb = (M + 1) / 2, MB = (M + nb - 1) / nb;
    __m256i idx[2]; /* half c: byte 4(p%4) + e of 128-bit lane p/4 = x of k = 2(2c + p/4) + (0, 8, 1, 9)[e] */
    for (int c = 0; c < 2; c++) {
        uint8_t v[32];
        static const int ke[4] = {0, 8, 1, 9};
        for (int p = 0; p < 8; p++)
            for (int e = 0; e < 4; e++) v[4 * p + e] = (uint8_t)(2 * (2 * c + (p >> 2)) + ke[e]);
        idx[c] = _mm256_loadu_si256((const __m256i *)v);
    }
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int i = 0; i < C; i++)
        for (int k = 0; k < 32 * M; k++) T[i * 32 * M + k] = _mm256_setzero_ps();
    prefetch_head(A, nt0);
    int64_t cur = -1;
    for (int64_t k0 = 0; k0 < A->K; k0 += BK) {
        const int64_t k1 = k0 + BK < A->K ? k0 + BK : A->K;
        const int nkt = (int)((k1 - k0) / 16);
        const int64_t grp = k0 / A->gs;
        if (grp != cur) {
            for (int i = 0; i < C; i++) tile_scales(A, nt0 + i, grp, scv + 64 * i);
            cur = grp;
        }
        for (int m = 0; m < M; m++) {
            float amax = 0.f;
            int nan = 0;
            for (int64_t k = k0; k < k1; k++) {
                const float v = fabsf(load_scalar(X->xrow[m], k, X->xdt));
                nan |= v != v;
                amax = v > amax ? v : amax;
            }
            if (nan) amax = NAN;
            float pre;
            const __m256 vinv = _mm256_set1_ps(q16_scale(amax, &sx[m], &pre)), vpre = _mm256_set1_ps(pre);
            __m256i sh[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, sl[2] = {sh[0], sh[0]};
            for (int kt = 0; kt < nkt; kt++) {
                int32_t q[16];
                for (int half = 0; half < 2; half++)
                    _mm256_storeu_si256((__m256i *)(q + 8 * half),
                                        _mm256_cvtps_epi32(_mm256_mul_ps(
                                            _mm256_mul_ps(load8_256(X->xrow[m], k0 + 16 * kt + 8 * half, X->xdt), vpre), vinv)));
                int8_t hb8[16], lb8[16];
                for (int k = 0; k < 16; k++) {
                    const int hi = (q[k] + 128) >> 8;
                    hb8[k] = (int8_t)hi;
                    lb8[k] = (int8_t)(q[k] - 256 * hi);
                }
                const __m256i bh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)hb8));
                const __m256i bl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lb8));
                for (int c = 0; c < 2; c++) {
                    const __m256i eh = _mm256_shuffle_epi8(bh, idx[c]), el = _mm256_shuffle_epi8(bl, idx[c]);
                    xe[((kt * 2 + c) * 2 + 0) * M + m] = eh;
                    xe[((kt * 2 + c) * 2 + 1) * M + m] = el;
                    sh[c] = _mm256_add_epi32(sh[c], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, eh), ones16));
                    sl[c] = _mm256_add_epi32(sl[c], _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, el), ones16));
                }
            }
            for (int c = 0; c < 2; c++) xq[c * M + m] = _mm256_add_epi32(_mm256_slli_epi32(sh[c], 8), sl[c]);
        }
        const uint32_t *row0 = A->w + (k0 / 16) * stride + nt0 * 128;
        for (int i = 0; i < C; i++) {
            const uint32_t *w0 = row0 + 128 * i, *pf = next_tile(A, row0, i, C, k1, nkt);
            for (int m0 = 0; m0 < M; m0 += MB) {
                const int mb = M - m0 < MB ? M - m0 : MB;
                for (int hl = 0; hl < 16; hl++) { /* half-lines: line hl / 2, half hl % 2 */
                    const uint32_t *wb = w0 + 8 * hl, *pb = m0 == 0 && pf ? pf + 8 * hl : NULL;
                    __m256 *Tb = T + i * 32 * M + hl * 2 * M + m0;
                    const float *sb = scv + 64 * i + (hl >> 1) * 8;
                    if (mb == 1) blk256i(wb, pb, stride, nkt, xe + m0, M, hl & 1, xq + m0, sx + m0, Tb, sb, 1, VNNI);
                    else blk256i(wb, pb, stride, nkt, xe + m0, M, hl & 1, xq + m0, sx + m0, Tb, sb, 2, VNNI);
                }
            }
        }
    }
    for (int i = 0; i < C; i++) {
        const __m256 *Ti = T + i * 32 * M;
        float *yi = y + (size_t)i * 64 * M;
        for (int b = 0; b < 8; b++)
            for (int g = 0; g < 2; g++)
                for (int m = 0; m < M; m++) {
                    __m256 v = _mm256_add_ps(Ti[((b * 2 + 0) * 2 + g) * M + m], Ti[((b * 2 + 1) * 2 + g) * M + m]);
                    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                    float o[4];
                    _mm_storeu_ps(o, r);
                    for (int j = 0; j < 4; j++) yi[m * 64 + 16 * j + 8 * g + b] = o[j];
                }
    }
}

/* The two AVX2 paths as seg_fn: avx2 (vpmaddubsw), avxvnni (vpdpbusd). */
T256 static void seg256i(const mat_t *A, int64_t nt0, int C, const act_t *X, float *y, float *scr) {
    seg256i_(A, nt0, C, X, y, scr, 0);
}
T256 static void seg256vn(const mat_t *A, int64_t nt0, int C, const act_t *X, float *y, float *scr) {
    seg256i_(A, nt0, C, X, y, scr, 1);
}

#endif /* MO_X86 */

typedef void (*seg_fn)(const mat_t *, int64_t, int, const act_t *, float *, float *);

/* The plain path's segment: one tile at a time (y of tile i at y + 64 M i). */
static void seg_plain(const mat_t *A, int64_t nt0, int C, const act_t *X, float *y, float *scr) {
    for (int i = 0; i < C; i++) tile_plain(A, nt0 + i, X, y + (size_t)i * 64 * X->M, scr);
}

static seg_fn pick_seg(int isa) {
#if MO_X86
    if (isa == ISA_AVX512VNNI) return seg512vn;
    if (isa == ISA_AVX512VNNI_NOVBMI) return seg512vn_novbmi;
    if (isa == ISA_AVX512BW) return seg512bw;
    if (isa == ISA_AVX2) return seg256i;
    if (isa == ISA_AVXVNNI) return seg256vn;
#endif
    (void)isa;
    return seg_plain;
}

/* The most tiles x rows of a segment of any job with at most M rows: m * seg_tiles(m) for m <= M (a job
   with fewer rows than the call's largest may take more tiles). */
static size_t seg_cm(int M) {
    if (M >= SEG_TM) return (size_t)M;
    return (size_t)M * SEG_MAX < SEG_TM ? (size_t)M * SEG_MAX : SEG_TM;
}

/* Scratch floats one thread needs for jobs of at most M rows (any path), the last ytiles_floats(M) of them
   the segment's outputs. */
static size_t ytiles_floats(int M) { return (size_t)64 * seg_cm(M) + 16; }
static size_t scratch_floats(int M) {
    /* xe, xs, T of a segment, scales of SEG_MAX tiles + 64, in 16-float vectors (avx2: the same bytes) */
    size_t simd = (size_t)16 * (32 * (size_t)M + M + 16 * seg_cm(M) + 4 * SEG_MAX + 8) + 128;
    size_t plain = (size_t)64 * M + 64;
    return (simd > plain ? simd : plain) + ytiles_floats(M);
}
/* A thread's scratch for jobs of at most M rows: scratch_floats(M), then (64-byte aligned) the M row
   pointers of the unit it runs. Allocated when the call is prepared, where a failure is -ENOMEM for
   the call: a worker never allocates, so it never fails on its own (a call whose workers skipped their
   share would wait for ever). */
static size_t rows_offset(int M) { return (scratch_floats(M) + 15) & ~(size_t)15; }
static size_t thread_floats(int M) { return rows_offset(M) + (size_t)M * (sizeof(void *) / sizeof(float)); }

/* ------------------------------------------------------------------ the pool */

typedef struct pool pool_t;
struct mlp_task_s;
/* --- SIGBUS guard of the reads from the mapped cache (sigbus_guard.h) -------------------------
 * The jobs' weights and scales are views of the cache's mapping. A page that cannot be read (the file
 * truncated under the mapping, or a disk I/O error on a page the page cache had dropped) raises SIGBUS
 * in the thread that touches it. Each thread of a call runs its units inside the guard (installed by the
 * first mo_host_create): the call is marked failed with the faulting address, and every later unit is
 * counted without its reads, so the call ends as usual and returns -EFAULT (mo_host_last_fault: the
 * address); out's rows are then not the experts' (ranges that ended before the fault wrote theirs):
 * discard them. */

/* The handler this library's passes faults outside its calls on to (NULL: the default or a plain one). */
void *mo_host_sigbus_prev(void) { return guard_prev_handler(); }

/* 1 while the process's SIGBUS handler is this library's (one installed later that does not pass
   faults on disarms the guard). */
int mo_host_sigbus_guarded(void) { return guard_is_current(); }

/* Reads a byte of every 4 KiB of [p, p + n) inside the guard: 0, or -EFAULT with *fault the address whose
   read failed. The torch host path (bf16 caches) calls it before torch computes on mapped views, so a page
   that cannot be read fails the job instead of the process (a page dropped and unreadable between this
   and torch's read is not caught: a window of one job). */
int mo_host_touch(const void *p, int64_t n, int64_t *fault) {
    guard_install();
    sigjmp_buf jb;
    if (sigsetjmp(jb, 0)) {
        const int64_t a = (int64_t)(uintptr_t)guard_fault_addr();
        if (fault) *fault = a ? a : 1;
        return -EFAULT;
    }
    guard_arm(&jb);
    const volatile unsigned char *b = p;
    unsigned acc = 0;
    for (int64_t o = 0; o < n; o += 4096) acc += b[o];
    if (n > 0) acc += b[n - 1];
    guard_disarm();
    (void)acc;
    return 0;
}

typedef void (*task_fn)(pool_t *, int tid, void *arg);
static int64_t now_ns(void);

/* Where a call's time goes (mo_host_diag). The call-level sums are always kept (four clock reads per
   call); the per-thread ones only in a build with -DDIAG_TIMING (scripts/host_kernel_sweep.sh), which
   reads the clock around every unit. */
typedef struct {
    int64_t joined;   /* calls this thread took part in */
    int64_t join;     /* ns from the call's open to this thread's first unit */
    int64_t busy;     /* ns inside units (reductions and waits included) */
    int64_t red;      /* ns of the chunk sums (phase 1: silu * up; phase 2: the rows' weighted sums) */
    int64_t wait;     /* ns a phase-2 unit waited for its job's phase 1 */
    int64_t last;     /* ns from the call's open to this thread's leaving it */
    int64_t units;
    int64_t pad;
} diag_thread_t;
#ifdef DIAG_TIMING
static __thread diag_thread_t *diag_self;
#define DIAG_NOW(v) const int64_t v = now_ns()
#define DIAG_ADD(field, v) (diag_self->field += (v))
#else
#define DIAG_NOW(v) ((void)0)
#define DIAG_ADD(field, v) ((void)0)
#endif

struct pool {
    int nthreads;
    pthread_t *threads;
    pthread_mutex_t mu;          /* wakes idle workers */
    pthread_cond_t cv;
    pthread_mutex_t call_mu;     /* guards busy */
    pthread_cond_t idle_cv;      /* busy went 0 */
    int busy;                    /* a call is in progress (1) or started and not yet waited for (2) */
    struct mlp_task_s *async_task; /* the started call's task (mo_host_mlp_start) */
    int async_empty;             /* it had nothing to compute */
    int64_t async_t0, async_t1;  /* its start, and the end of its last unit of work (ns, atomic) */
    volatile int stop;
    int64_t gen;                 /* task generation (atomic) */
    task_fn fn;
    void *arg;
    int64_t open_gen;            /* the generation workers may still join, 0 once its work is done (atomic) */
    int active;                  /* workers inside the task now (atomic) */
    float **scratch;             /* per thread */
    size_t scratch_n;
    float *acc;                  /* [rows][H] fp32 */
    size_t acc_n;
    float *inter;                /* the jobs' fp32 intermediates */
    size_t inter_n;
    float *part;                 /* the units' partial sums per (job, k chunk) */
    size_t part_n;
    unsigned char *mark;
    size_t mark_n;
    int64_t *uniq;
    size_t uniq_n;
    int64_t spin_ns;             /* an idle worker spins this long before it sleeps (atomic) */
    int64_t last_fault;          /* the last failed call's fault address (mo_host_last_fault) */
    int64_t diag_open;           /* the current call's open (ns) */
    int64_t diag_entry;          /* its entry (ns) */
    int64_t diag_calls, diag_wall, diag_prep, diag_run, diag_finish; /* sums over calls (ns), mo_host_diag */
    diag_thread_t *diag;         /* [nthreads] (DIAG_TIMING builds) */
};

typedef struct { pool_t *P; int tid; } worker_arg;

/* How long an idle worker spins (pause by pause) before it sleeps on the condition variable, unless
   mo_host_set_spin says otherwise. A sleeping worker joins a call late: session 28 on the H200's host
   (16 threads, the user's shape, M = 1, 6 experts per call, a ~110 us gap between calls) found the
   threads joining 121 us after the open on average when they spun 4000 pauses (~0.1 ms there), 3 us
   when they spun 10x longer; the call took 763 -> 384 us in C. */
#ifndef SPIN_NS_DEFAULT
#define SPIN_NS_DEFAULT 1000000
#endif

static void *worker_main(void *vp) {
    worker_arg wa = *(worker_arg *)vp;
    free(vp);
    pool_t *P = wa.P;
    int64_t seen = 0;
    for (;;) {
        int64_t g, idle0 = 0;
        unsigned spins = 0;
        while ((g = __atomic_load_n(&P->gen, __ATOMIC_ACQUIRE)) == seen && !P->stop) {
            if (++spins & 63) { CPU_RELAX(); continue; }
            const int64_t t = now_ns(); /* every 64 pauses: spin for spin_ns, then sleep */
            if (!idle0) idle0 = t;
            if (t - idle0 < __atomic_load_n(&P->spin_ns, __ATOMIC_RELAXED)) { CPU_RELAX(); continue; }
            pthread_mutex_lock(&P->mu);
            while ((g = __atomic_load_n(&P->gen, __ATOMIC_ACQUIRE)) == seen && !P->stop) pthread_cond_wait(&P->cv, &P->mu);
            pthread_mutex_unlock(&P->mu);
            break;
        }
        if (P->stop) return NULL;
        seen = g;
        /* join only while the call is open: a worker that wakes after the work is done (woken late,
           or preempted by another process) is not waited for and never touches the finished task.
           Seq-cst join-then-check against the caller's close-then-count: either the caller sees
           this worker active and waits for it, or the worker sees the call closed. */
        __atomic_add_fetch(&P->active, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&P->open_gen, __ATOMIC_SEQ_CST) == g) P->fn(P, wa.tid, P->arg);
        __atomic_sub_fetch(&P->active, 1, __ATOMIC_RELEASE);
    }
}

void mo_host_destroy(void *h);

void *mo_host_create(int nthreads) {
    if (nthreads < 1) nthreads = 1;
    pool_t *P = calloc(1, sizeof *P);
    if (!P) return NULL;
    P->nthreads = nthreads;
    P->spin_ns = SPIN_NS_DEFAULT;
    guard_install();
#if MO_X86
    pthread_once(&sperm_once, make_sperms);
#endif
    pthread_mutex_init(&P->mu, NULL);
    pthread_cond_init(&P->cv, NULL);
    pthread_mutex_init(&P->call_mu, NULL);
    pthread_cond_init(&P->idle_cv, NULL);
    P->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    P->scratch = calloc((size_t)nthreads, sizeof(float *));
    P->diag = calloc((size_t)nthreads, sizeof(diag_thread_t));
    if (!P->threads || !P->scratch || !P->diag) {
        free(P->threads);
        free(P->scratch);
        free(P->diag);
        free(P);
        return NULL;
    }
    for (int t = 1; t < nthreads; t++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) { P->nthreads = t; mo_host_destroy(P); return NULL; }
        wa->P = P;
        wa->tid = t;
        if (pthread_create(&P->threads[t], NULL, worker_main, wa) != 0) {
            free(wa);
            P->nthreads = t;
            mo_host_destroy(P);
            return NULL;
        }
    }
    return P;
}

int mo_host_mlp_wait(void *h, int64_t *ns, int *ready);

void mo_host_destroy(void *h) {
    pool_t *P = h;
    if (!P) return;
    if (P->busy == 2) mo_host_mlp_wait(P, NULL, NULL); /* a started call's workers finish before they stop */
    free(P->async_task);
    pthread_mutex_lock(&P->mu);
    P->stop = 1;
    pthread_cond_broadcast(&P->cv);
    pthread_mutex_unlock(&P->mu);
    for (int t = 1; t < P->nthreads; t++) pthread_join(P->threads[t], NULL);
    for (int t = 0; t < P->nthreads; t++) free(P->scratch[t]);
    free(P->scratch);
    free(P->diag);
    free(P->threads);
    free(P->acc);
    free(P->inter);
    free(P->part);
    free(P->mark);
    free(P->uniq);
    free(P);
}

int mo_host_threads(void *h) { return ((pool_t *)h)->nthreads; }

/* How long (ns) an idle worker spins before it sleeps; ns < 0 leaves it. Returns the value before. */
int64_t mo_host_set_spin(void *h, int64_t ns) {
    pool_t *P = h;
    const int64_t old = __atomic_load_n(&P->spin_ns, __ATOMIC_RELAXED);
    if (ns >= 0) __atomic_store_n(&P->spin_ns, ns, __ATOMIC_RELAXED);
    return old;
}

/* A call runs fn on the calling thread (worker 0) and on every worker that joins while the call is open.
   fn takes work from shared counters and returns when none is left; the call is complete once
   *done >= total (work units completed, counted by fn), so it does not wait for workers that were slow
   to wake: those that joined are waited for (they are inside fn, finishing a unit or about to find
   none), the others see the call closed and skip it. Session 6 on the two-H200 host (32 cores, 23 of
   these threads beside 8 copy threads): a 2-expert decode call had a median of 3.7 ms and a minimum of
   0.32 ms, when every call waited for all 23 threads to wake. */
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Waits until *v >= want (spins briefly, then yields). */
static inline void spin_until(const int64_t *v, int64_t want) {
    for (int i = 0; __atomic_load_n(v, __ATOMIC_ACQUIRE) < want; i++) {
        if (i < 4000) CPU_RELAX();
        else sched_yield();
    }
}

static void pool_open(pool_t *P, task_fn fn, void *arg) {
    P->diag_open = now_ns();
    P->fn = fn;
    P->arg = arg;
    pthread_mutex_lock(&P->mu);
    const int64_t g = __atomic_load_n(&P->gen, __ATOMIC_RELAXED) + 1; /* only one call at a time (busy) moves gen */
    __atomic_store_n(&P->open_gen, g, __ATOMIC_SEQ_CST);  /* open before a worker can see g */
    __atomic_store_n(&P->gen, g, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&P->cv);
    pthread_mutex_unlock(&P->mu);
}

/* The caller takes part (worker 0) until no work is left, waits for *done >= total, then closes the
   call and waits for the workers inside it. Returns 1 if the work was complete before the caller took
   part (its time is then the workers' alone). */
static int pool_finish(pool_t *P, int64_t *done, int64_t total) {
    int ready = __atomic_load_n(done, __ATOMIC_ACQUIRE) >= total;
    if (!ready) P->fn(P, 0, P->arg);
    spin_until(done, total);
    __atomic_store_n(&P->open_gen, 0, __ATOMIC_SEQ_CST);
    for (int i = 0; __atomic_load_n(&P->active, __ATOMIC_SEQ_CST) > 0; i++) {
        if (i < 4000) CPU_RELAX();
        else sched_yield();
    }
    return ready;
}

static int grow(void **p, size_t *have, size_t need, size_t elem) {
    if (*have >= need) return 0;
    void *q = NULL;
    if (posix_memalign(&q, 64, need * elem > 0 ? need * elem : 64) != 0) return -1;
    free(*p);
    *p = q;
    *have = need;
    return 0;
}

/* ------------------------------------------------------------------ the MLP task */

/* Work is a list of units: phase 1 (w13) units of every job, then phase 2 (w2) units, each in job order.
   A unit is (job, k chunk, column range) of one matrix: the chunk's k-tile rows over the range's tiles
   (phase 1: gate/up tile pairs; phase 2: tiles of H), at most RANGE_TILES of them, so a unit reads runs of
   up to 8 KiB of consecutive rows, and a whole row where the matrix is narrow (the user's w13: 12 pairs, the
   rows of a chunk one contiguous stream). Splitting K, not only N, is what keeps the units long for small
   experts: with N split alone, 16 threads cut one such expert's w13 into quarter-tile strips of 128-byte
   runs over 320 rows. Session 16, the H200's host, 16 threads, M = 1, user shape, GB/s before -> after:
   calls of 1 expert 28.5 -> 44.3, of 6 49.3 -> 60.5, of 24 52.2 -> 78.9; M = 3 (6 experts) 30.8 -> 53.2;
   mixtral's shape 64.3 -> 79.2 (M = 1), 44.1 -> 70.6 (M = 3). A unit's sums over its chunk go to the (job, chunk) partial buffer; the unit that completes the last
   chunk of a (job, range) sums the chunks in order (the result does not depend on which thread ran what),
   then phase 1 applies silu(gate) * up into the job's fp32 intermediate and phase 2 weights and sums every
   job's rows into an fp32 accumulator per out row, rounded once into out. A phase-2 unit of a job starts
   once that job's phase 1 is complete (a count, not a barrier of threads). Threads take one unit at a
   time from one counter. */
#ifndef RANGE_TILES
#define RANGE_TILES 16   /* tiles (phase 2) or gate/up pairs (phase 1) of a unit at most */
#endif
#ifndef UNITS_PER_THREAD
#define UNITS_PER_THREAD 4 /* units per phase per thread aimed at (balance against per-unit costs) */
#endif
#define PART_CAP (1 << 22) /* floats of one job's partials per phase at most */
#ifndef CHUNK_K
#define CHUNK_K 256      /* k rows of a chunk per row of x, at least (plan_matrix) */
#endif

typedef struct {
    int64_t nk, ku, nku;  /* k chunks; k per chunk step (whole blocks and scale groups); steps in K */
    int64_t first;        /* its first unit */
    int64_t part;         /* offset (floats) of its partials [nk][m][N] in pool->part */
} plan_t;

typedef struct {
    plan_t p1, p2;
    int64_t inter;        /* offset (floats) of its [m][I] intermediate in pool->inter */
    int64_t ready;        /* phase-1 ranges completed (atomic) */
} job_plan_t;

typedef struct mlp_task_s {
    const mo_job_t *jobs;
    int njobs;
    const void *x;
    int xdt;
    int64_t H, I;
    void *out;
    int mode;             /* 0: out[rows] = sum, 1: out[rows] += sum */
    seg_fn seg;
    job_plan_t *jp;       /* per job (mlp_prepare allocates it and the counters, mlp_free frees them) */
    int64_t *cnt1;        /* [njobs][nr1]: chunks done per (job, range) (atomics) */
    int64_t *cnt2;        /* [nr2]: units done per range, all jobs (atomics) */
    int64_t nr1, nr2;     /* column ranges of the phases (the same for every job) */
    int64_t n1, n2;       /* units of the phases */
    int64_t per_range2;   /* phase-2 units of one range (sum of the jobs' chunks) */
    int64_t nuniq;
    int64_t next;         /* unit counter (atomic) */
    int64_t done2;        /* phase-2 units completed, reductions included (atomic): the call ends at n2 */
    int64_t fault;        /* 0, or the address whose read raised SIGBUS (1: unknown) (atomic): the call failed */
    int maxm;
} mlp_task;

/* k per chunk step of a matrix with K rows and scale groups of gs: whole blocks (block_k), and whole scale
   groups where there are several (a chunk's scales start at its first group's row). */
static int64_t chunk_k(int64_t K, int gs) {
    const mat_t A = {NULL, NULL, K, 64, gs, 1, 0};
    const int64_t bk = block_k(&A);
    return gs < K && gs > bk ? gs : bk;
}

/* The k chunks of one job's matrix (K rows, N columns, m rows of x): chunks of >= CHUNK_K * m rows, so the
   partial sums a chunk writes (4 m bytes per column) stay within ~3% of the weights it reads (K / 2 bytes
   per column); at most PART_CAP floats of partials. A function of the matrix and m alone, not of the
   threads or the other jobs: a job's sums, and so out's bytes, are the same for any thread count. */
static void plan_matrix(plan_t *p, int64_t K, int64_t N, int gs, int64_t m) {
    p->ku = chunk_k(K, gs);
    p->nku = (K + p->ku - 1) / p->ku;
    int64_t nk = K / (CHUNK_K * m), cap = PART_CAP / (m * N);
    if (nk > p->nku) nk = p->nku;
    if (nk > cap) nk = cap;
    p->nk = nk < 1 ? 1 : nk;
}

/* A sub-matrix: rows [k0, k1) of A (its scales from k0's group on). */
static inline mat_t sub_k(const uint32_t *w, const void *s, int sdt, int64_t K, int64_t N, int gs, int grouped,
                          int64_t k0, int64_t k1) {
    const int64_t srow = gs < K ? k0 / gs : 0, ssz = sdt == DT_FP32 ? 4 : 2;
    mat_t A = {w + (k0 / 16) * (N / 64) * 128, (const char *)s + srow * N * ssz, k1 - k0, N, gs, grouped, sdt};
    return A;
}

static inline void chunk_rows(const plan_t *p, int64_t K, int64_t c, int64_t *k0, int64_t *k1) {
    *k0 = c * p->nku / p->nk * p->ku;
    int64_t e = (c + 1) * p->nku / p->nk * p->ku;
    *k1 = e < K ? e : K;
}

/* A segment of tiles nt0 .. nt0 + C - 1 of A into a chunk's partials pc ([M][A->N]; y: the segment's scratch). */
static void seg_part(const mlp_task *T, const mat_t *A, int64_t nt0, int C, const act_t *X, float *y, float *scr,
                     float *pc) {
    T->seg(A, nt0, C, X, y, scr);
    for (int i = 0; i < C; i++)
        for (int m = 0; m < X->M; m++)
            memcpy(pc + (size_t)m * A->N + (nt0 + i) * 64, y + ((size_t)i * X->M + m) * 64, 64 * sizeof(float));
}

/* Phase-1 unit: job j, chunk c, gate/up pairs of range r. */
static void unit1(pool_t *P, mlp_task *T, int j, int64_t c, int64_t r, const void **xrow, float *scr, float *y,
                  int compute) {
    const mo_job_t *J = &T->jobs[j];
    job_plan_t *JP = &T->jp[j];
    const int esz = T->xdt == DT_FP32 ? 4 : 2, M = (int)J->m, cmax = seg_tiles(M);
    const int64_t pairs = T->I / 64, a0 = r * pairs / T->nr1, a1 = (r + 1) * pairs / T->nr1, N = 2 * T->I;
    int64_t k0, k1;
    chunk_rows(&JP->p1, T->H, c, &k0, &k1);
    mat_t A = sub_k(J->w13, J->s13, J->sdtype, T->H, N, J->gs13, J->grouped13, k0, k1);
    for (int64_t m = 0; m < M; m++) xrow[m] = (const char *)T->x + ((size_t)J->rows[m] * T->H + k0) * esz;
    act_t X = {xrow, T->xdt, M};
    float *part = P->part + JP->p1.part;
    float *pc = part + (size_t)c * M * N;
    for (int64_t c0 = a0; compute && c0 < a1; c0 += cmax) {
        const int C = (int)(a1 - c0 < cmax ? a1 - c0 : cmax);
        for (int h = 0; h < 2; h++) seg_part(T, &A, c0 + h * pairs, C, &X, y, scr, pc); /* gate, up */
    }
    if (__atomic_add_fetch(&T->cnt1[(int64_t)j * T->nr1 + r], 1, __ATOMIC_ACQ_REL) < JP->p1.nk) return;
    if (__atomic_load_n(&T->fault, __ATOMIC_ACQUIRE)) { /* a failed call: its sums are not the experts' */
        __atomic_add_fetch(&JP->ready, 1, __ATOMIC_ACQ_REL);
        return;
    }
    /* the range's last chunk: silu(gate) * up of the chunks' sums, in chunk order */
    DIAG_NOW(tr);
    float *inter = P->inter + JP->inter;
    const int64_t nk = JP->p1.nk;
    for (int m = 0; m < M; m++)
        for (int64_t n0 = a0 * 64; n0 < a1 * 64; n0 += 64) {
            float g[64], u[64];
            memcpy(g, part + (size_t)m * N + n0, sizeof g);
            memcpy(u, part + (size_t)m * N + T->I + n0, sizeof u);
            for (int64_t q = 1; q < nk; q++) {
                const float *pq = part + ((size_t)q * M + m) * N + n0;
                for (int n = 0; n < 64; n++) g[n] += pq[n];
                for (int n = 0; n < 64; n++) u[n] += pq[T->I + n];
            }
            float *o = inter + (size_t)m * T->I + n0;
            for (int n = 0; n < 64; n++) o[n] = g[n] / (1.f + expf(-g[n])) * u[n];
        }
    DIAG_ADD(red, now_ns() - tr);
    __atomic_add_fetch(&JP->ready, 1, __ATOMIC_ACQ_REL);
}

/* Phase-2 unit: job j, chunk c, tiles of H of range r; the range's last unit sums every job's rows. */
static void unit2(pool_t *P, mlp_task *T, int j, int64_t c, int64_t r, const void **xrow, float *scr, float *y,
                  int compute) {
    const mo_job_t *J = &T->jobs[j];
    job_plan_t *JP = &T->jp[j];
    const int M = (int)J->m, cmax = seg_tiles(M);
    const int64_t tiles = T->H / 64, t0 = r * tiles / T->nr2, t1 = (r + 1) * tiles / T->nr2, N = T->H;
    DIAG_NOW(tw);
    spin_until(&JP->ready, T->nr1); /* this job's intermediate */
    DIAG_ADD(wait, now_ns() - tw);
    int64_t k0, k1;
    chunk_rows(&JP->p2, T->I, c, &k0, &k1);
    mat_t A = sub_k(J->w2, J->s2, J->sdtype, T->I, N, J->gs2, J->grouped2, k0, k1);
    const float *inter = P->inter + JP->inter;
    for (int m = 0; m < M; m++) xrow[m] = inter + (size_t)m * T->I + k0;
    act_t X = {xrow, DT_FP32, M};
    float *pc = P->part + JP->p2.part + (size_t)c * M * N;
    for (int64_t c0 = t0; compute && c0 < t1; c0 += cmax) {
        const int C = (int)(t1 - c0 < cmax ? t1 - c0 : cmax);
        seg_part(T, &A, c0, C, &X, y, scr, pc);
    }
    if (__atomic_add_fetch(&T->cnt2[r], 1, __ATOMIC_ACQ_REL) < T->per_range2) return;
    if (__atomic_load_n(&T->fault, __ATOMIC_ACQUIRE)) return; /* a failed call: no more rows written */
    /* the range's last unit: out rows = sum over jobs (in order) of weight * (sum of its chunks) */
    DIAG_NOW(tr);
    const int64_t n0 = t0 * 64, n1 = t1 * 64;
    for (int64_t i = 0; i < T->nuniq; i++) memset(P->acc + (size_t)P->uniq[i] * N + n0, 0, (size_t)(n1 - n0) * sizeof(float));
    for (int jj = 0; jj < T->njobs; jj++) {
        const mo_job_t *Jj = &T->jobs[jj];
        const plan_t *p = &T->jp[jj].p2;
        const int Mj = (int)Jj->m;
        const float *part = P->part + p->part;
        for (int m = 0; m < Mj; m++) {
            const float w = Jj->weights ? Jj->weights[m] : 1.f;
            float *a = P->acc + (size_t)Jj->rows[m] * N;
            for (int64_t c0 = n0; c0 < n1; c0 += 64) {
                float sum[64];
                memcpy(sum, part + (size_t)m * N + c0, sizeof sum);
                for (int64_t q = 1; q < p->nk; q++) {
                    const float *pq = part + ((size_t)q * Mj + m) * N + c0;
                    for (int n = 0; n < 64; n++) sum[n] += pq[n];
                }
                for (int n = 0; n < 64; n++) a[c0 + n] += w * sum[n];
            }
        }
    }
    for (int64_t i = 0; i < T->nuniq; i++) {
        const int64_t row = P->uniq[i];
        const float *a = P->acc + (size_t)row * N;
        for (int64_t n = n0; n < n1; n++) {
            float v = a[n];
            if (T->mode) v += load_scalar(T->out, row * N + n, T->xdt);
            store_scalar(T->out, row * N + n, T->xdt, v);
        }
    }
    DIAG_ADD(red, now_ns() - tr);
}

/* The job whose units [first, first + count) hold unit u (jobs in order; jobs without rows own none). */
static int find_job(const mlp_task *T, int j, int64_t u, int phase) {
    for (;;) {
        const plan_t *p = phase == 1 ? &T->jp[j].p1 : &T->jp[j].p2;
        const int64_t nr = phase == 1 ? T->nr1 : T->nr2;
        if (u < p->first && j > 0) { j--; continue; }
        if (T->jobs[j].m == 0 || u >= p->first + p->nk * nr) { j++; continue; }
        return j;
    }
}

/* The call's units, one at a time from the shared counter, from unit ``again`` first where >= 0 (the unit
   a fault interrupted: counted once more, without its reads). *cur: the unit under way (mlp_run's guard). */
static __attribute__((noinline)) void run_units(pool_t *P, mlp_task *T, const void **xrow, float *scr, float *y,
                                                volatile int64_t *cur, int64_t again) {
    int j1 = 0, j2 = 0;
    for (;;) {
        int64_t u = again;
        again = -1;
        if (u < 0) {
            u = __atomic_fetch_add(&T->next, 1, __ATOMIC_RELAXED);
            if (u >= T->n1 + T->n2) break;
        }
        const int compute = !__atomic_load_n(&T->fault, __ATOMIC_ACQUIRE); /* a failed call reads no more */
        *cur = u;
        DIAG_NOW(tu);
        if (u < T->n1) {
            j1 = find_job(T, j1, u, 1);
            const int64_t local = u - T->jp[j1].p1.first;
            unit1(P, T, j1, local / T->nr1, local % T->nr1, xrow, scr, y, compute);
        } else {
            const int64_t v = u - T->n1;
            j2 = find_job(T, j2, v, 2);
            const int64_t local = v - T->jp[j2].p2.first;
            unit2(P, T, j2, local / T->nr2, local % T->nr2, xrow, scr, y, compute);
            if (__atomic_add_fetch(&T->done2, 1, __ATOMIC_ACQ_REL) == T->n2)
                __atomic_store_n(&P->async_t1, now_ns(), __ATOMIC_RELEASE); /* the call's work ends here */
        }
        *cur = -1;
        DIAG_ADD(busy, now_ns() - tu);
        DIAG_ADD(units, 1);
    }
}

static void mlp_run(pool_t *P, int tid, void *vp) {
    mlp_task *T = vp;
    /* volatile: read after a jump to the guard below (they do not change; -Wclobbered cannot tell) */
    float *const scr = P->scratch[tid];
    float *volatile const y = scr + scratch_floats(T->maxm) - ytiles_floats(T->maxm);
    const void **volatile const xrow = (const void **)(void *)(scr + rows_offset(T->maxm));
#ifdef DIAG_TIMING
    diag_self = &P->diag[tid];
    diag_self->joined++;
    diag_self->join += now_ns() - P->diag_open;
#endif
    /* the guard: nothing of this frame but cur (volatile) changes between sigsetjmp and a jump to it */
    sigjmp_buf jb;
    volatile int64_t cur = -1, again = -1;
    if (sigsetjmp(jb, 0)) { /* a read of unit cur raised SIGBUS: the call fails; every unit still counts */
        const int64_t a = (int64_t)(uintptr_t)guard_fault_addr();
        int64_t none = 0;
        __atomic_compare_exchange_n(&T->fault, &none, a ? a : 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        again = cur;
    }
    guard_arm(&jb);
    run_units(P, T, xrow, scr, y, &cur, again);
    guard_disarm();
    DIAG_ADD(last, now_ns() - P->diag_open);
}

/* out[rows] (+)= sum over jobs of weights * down(silu(gate(x[rows])) * up(x[rows])).
   x: [x_rows, H] of xdt (bf16/fp16/fp32), out: the same shape and dtype. Returns 0, or -EINVAL /
   -ENOMEM / -ENOTSUP (isa not available). */
/* Checks the arguments and fills *T (its jp malloc'd); the pool's buffers grown. 0, 1 (nothing
   to compute), or -EINVAL / -ENOMEM / -ENOTSUP. The caller holds the pool (busy). */
static int mlp_prepare(pool_t *P, mlp_task *T, int isa, const void *x, int xdt, int64_t x_rows, int64_t H,
                       int64_t I, const mo_job_t *jobs, int njobs, void *out, int mode) {
    if (H <= 0 || I <= 0 || H % 64 || I % 64 || njobs < 0 || xdt < 0 || xdt > 2) return -EINVAL;
    if (!mo_host_isa_available(isa)) return -ENOTSUP;
    if (njobs == 0) return 1;
    int64_t maxm = 0, tot_m = 0;
    for (int j = 0; j < njobs; j++) {
        const mo_job_t *J = &jobs[j];
        if (J->m < 0 || J->gs13 <= 0 || J->gs2 <= 0 || J->sdtype < 0 || J->sdtype > 2) return -EINVAL;
        for (int64_t m = 0; m < J->m; m++)
            if (J->rows[m] < 0 || J->rows[m] >= x_rows) return -EINVAL;
        if (J->m > maxm) maxm = J->m;
        tot_m += J->m;
    }
    if (maxm == 0) return 1;
    if (maxm > (1 << 20)) return -EINVAL;
    /* chunks of K per job (plan_matrix), then column ranges of <= RANGE_TILES, narrower where the units
       would be fewer than the threads want (few k chunks: short K, large M, few jobs); ranges do not
       change the sums */
    const int64_t want = (int64_t)UNITS_PER_THREAD * P->nthreads, pairs = I / 64, tiles = H / 64;
    int64_t nr1 = (pairs + RANGE_TILES - 1) / RANGE_TILES, nr2 = (tiles + RANGE_TILES - 1) / RANGE_TILES;
    job_plan_t *jp = calloc((size_t)njobs, sizeof *jp);
    if (!jp) return -ENOMEM;
    int64_t n1 = 0, n2 = 0;
    for (int j = 0; j < njobs; j++) {
        if (!jobs[j].m) continue;
        plan_matrix(&jp[j].p1, H, 2 * I, jobs[j].gs13, jobs[j].m);
        plan_matrix(&jp[j].p2, I, H, jobs[j].gs2, jobs[j].m);
        n1 += jp[j].p1.nk;
        n2 += jp[j].p2.nk;
    }
    if (n1 * nr1 < want) nr1 = (want + n1 - 1) / n1 < pairs ? (want + n1 - 1) / n1 : pairs;
    if (n2 * nr2 < want) nr2 = (want + n2 - 1) / n2 < tiles ? (want + n2 - 1) / n2 : tiles;
    const int64_t per_range2 = n2;
    n1 *= nr1;
    n2 *= nr2;
    int64_t part = 0, inter = 0, u1 = 0, u2 = 0;
    for (int j = 0; j < njobs; j++) {
        jp[j].inter = inter;
        inter += jobs[j].m * I;
        jp[j].p1.first = u1;
        jp[j].p2.first = u2;
        if (!jobs[j].m) continue;
        u1 += jp[j].p1.nk * nr1;
        u2 += jp[j].p2.nk * nr2;
        jp[j].p1.part = part;
        part += jp[j].p1.nk * jobs[j].m * 2 * I;
        jp[j].p2.part = part;
        part += jp[j].p2.nk * jobs[j].m * H;
    }
    int rc = 0;
    size_t need = thread_floats((int)maxm);
    if (P->scratch_n < need) {
        for (int t = 0; t < P->nthreads; t++) {
            free(P->scratch[t]);
            P->scratch[t] = NULL;
            if (posix_memalign((void **)&P->scratch[t], 64, need * sizeof(float)) != 0) { P->scratch[t] = NULL; rc = -ENOMEM; }
        }
        P->scratch_n = rc ? 0 : need;
    }
    int64_t *cnt = calloc((size_t)(njobs * nr1 + nr2), sizeof(int64_t));
    if (!cnt) rc = -ENOMEM;
    if (!rc && (grow((void **)&P->acc, &P->acc_n, (size_t)x_rows * H, sizeof(float)) ||
                grow((void **)&P->inter, &P->inter_n, (size_t)tot_m * I, sizeof(float)) ||
                grow((void **)&P->part, &P->part_n, (size_t)part, sizeof(float)) ||
                grow((void **)&P->mark, &P->mark_n, (size_t)x_rows, 1) ||
                grow((void **)&P->uniq, &P->uniq_n, (size_t)tot_m, sizeof(int64_t))))
        rc = -ENOMEM;
    if (rc) { free(jp); free(cnt); return rc; }
    memset(T, 0, sizeof *T);
    T->jobs = jobs;
    T->njobs = njobs;
    T->x = x;
    T->xdt = xdt;
    T->H = H;
    T->I = I;
    T->out = out;
    T->mode = mode;
    T->seg = pick_seg(isa);
    T->jp = jp;
    T->cnt1 = cnt;
    T->cnt2 = cnt + njobs * nr1;
    T->nr1 = nr1;
    T->nr2 = nr2;
    T->n1 = n1;
    T->n2 = n2;
    T->per_range2 = per_range2;
    T->maxm = (int)maxm;
    int64_t nu = 0;
    memset(P->mark, 0, (size_t)x_rows);
    for (int j = 0; j < njobs; j++)
        for (int64_t m = 0; m < jobs[j].m; m++) {
            int64_t r = jobs[j].rows[m];
            if (!P->mark[r]) { P->mark[r] = 1; P->uniq[nu++] = r; }
        }
    T->nuniq = nu;
    return 0;
}

/* The task's allocations (mlp_prepare's). */
static void mlp_free(mlp_task *T) {
    free(T->jp);
    free(T->cnt1);
    T->jp = NULL;
    T->cnt1 = NULL;
}

static int pool_acquire(pool_t *P) { /* 0 once no call runs, or -EBUSY (a started call not waited for) */
    pthread_mutex_lock(&P->call_mu);
    while (P->busy) {
        if (P->busy == 2) { pthread_mutex_unlock(&P->call_mu); return -EBUSY; }
        pthread_cond_wait(&P->idle_cv, &P->call_mu);
    }
    P->busy = 1;
    pthread_mutex_unlock(&P->call_mu);
    return 0;
}

static void pool_release(pool_t *P) {
    pthread_mutex_lock(&P->call_mu);
    P->busy = 0;
    pthread_cond_broadcast(&P->idle_cv);
    pthread_mutex_unlock(&P->call_mu);
}

/* A finished call's times into the pool's sums (the caller holds the pool). */
static void diag_call(pool_t *P) {
    const int64_t end = now_ns(), done = __atomic_load_n(&P->async_t1, __ATOMIC_ACQUIRE);
    P->diag_calls++;
    P->diag_wall += end - P->diag_entry;
    P->diag_prep += P->diag_open - P->diag_entry;
    P->diag_run += done - P->diag_open;
    P->diag_finish += end - done;
}

/* Where the calls' time went since the last mo_host_diag, then zeroes it: out[0..5] = calls and the
   sums (ns) of their time in C (entry to return), before the work opened (checks, plan), from the open
   to the end of the last unit, from there to the return (closing, waiting for the threads inside), and
   the pool's threads; out[6..] = 8 sums per thread (diag_thread_t, thread t at 6 + 8 t), zero unless built with
   -DDIAG_TIMING. n: out's length. Returns 1 (per-thread sums kept), 0 (call-level only), or -EINVAL /
   -EBUSY (a call is running: read between calls). */
int mo_host_diag(void *h, int64_t *out, int n) {
    pool_t *P = h;
    if (!P || !out || n < 6) return -EINVAL;
    pthread_mutex_lock(&P->call_mu);
    const int busy = P->busy;
    pthread_mutex_unlock(&P->call_mu);
    if (busy) return -EBUSY;
    const int64_t call[6] = {P->diag_calls, P->diag_wall, P->diag_prep, P->diag_run, P->diag_finish, P->nthreads};
    memcpy(out, call, 6 * sizeof(int64_t));
    for (int t = 0; t < P->nthreads && 6 + 8 * (t + 1) <= n; t++) memcpy(out + 6 + 8 * t, &P->diag[t], 64);
    P->diag_calls = P->diag_wall = P->diag_prep = P->diag_run = P->diag_finish = 0;
    memset(P->diag, 0, (size_t)P->nthreads * sizeof(diag_thread_t));
#ifdef DIAG_TIMING
    return 1;
#else
    return 0;
#endif
}

/* out[rows] (+)= sum over jobs of weights * down(silu(gate(x[rows])) * up(x[rows])).
   x: [x_rows, H] of xdt (bf16/fp16/fp32), out: the same shape and dtype. Returns 0, or -EINVAL /
   -ENOMEM / -ENOTSUP (isa not available), -EBUSY (a call started with mo_host_mlp_start is not waited
   for), -EFAULT (a read of the jobs' weights raised SIGBUS: out not to be used; mo_host_last_fault).
   Calls from several threads run one after the other. */
int mo_host_mlp(void *h, int isa, const void *x, int xdt, int64_t x_rows, int64_t H, int64_t I,
                const mo_job_t *jobs, int njobs, void *out, int mode) {
    pool_t *P = h;
    if (!P) return -EINVAL;
    int rc = pool_acquire(P);
    if (rc) return rc;
    P->diag_entry = now_ns();
    mlp_task T;
    rc = mlp_prepare(P, &T, isa, x, xdt, x_rows, H, I, jobs, njobs, out, mode);
    if (rc == 0) {
        pool_open(P, mlp_run, &T);
        pool_finish(P, &T.done2, T.n2);
        mlp_free(&T);
        diag_call(P);
        if (T.fault) { P->last_fault = T.fault; rc = -EFAULT; }
    }
    pool_release(P);
    return rc < 0 ? rc : 0;
}

/* The address whose read failed the last call that returned -EFAULT (1: unknown; 0: none yet). */
int64_t mo_host_last_fault(void *h) { return h ? ((pool_t *)h)->last_fault : 0; }

/* The same call, started on the pool's workers; the caller returns at once and collects it with
   mo_host_mlp_wait (x, jobs, their rows and weights, and out must stay valid until then; nothing runs
   on the calling thread meanwhile, so a Python caller keeps running while the experts are computed,
   without a Python thread and the GIL between them). One started call at a time: -EBUSY if one is
   not waited for. With one thread (no workers) the work runs in mo_host_mlp_wait. */
int mo_host_mlp_start(void *h, int isa, const void *x, int xdt, int64_t x_rows, int64_t H, int64_t I,
                      const mo_job_t *jobs, int njobs, void *out, int mode) {
    pool_t *P = h;
    if (!P) return -EINVAL;
    int rc = pool_acquire(P);
    if (rc) return rc;
    mlp_task *T = P->async_task;
    if (!T && !(T = P->async_task = calloc(1, sizeof *T))) { pool_release(P); return -ENOMEM; }
    P->diag_entry = now_ns();
    rc = mlp_prepare(P, T, isa, x, xdt, x_rows, H, I, jobs, njobs, out, mode);
    if (rc < 0) { pool_release(P); return rc; }
    P->async_empty = rc == 1;
    P->async_t0 = now_ns();
    if (!P->async_empty) pool_open(P, mlp_run, T);
    pthread_mutex_lock(&P->call_mu);
    P->busy = 2;
    pthread_mutex_unlock(&P->call_mu);
    return 0;
}

/* Collects the call of mo_host_mlp_start: the caller takes part in what is left, then returns 0 with
   *ns = nanoseconds from the start to the end of its work and *ready = 1 if that work was complete
   before this call (then *ns is the workers' time alone; else it may include the caller's delay).
   -EINVAL if no call was started; -EFAULT if a read of the jobs' weights raised SIGBUS (out not to be used,
   the call collected all the same; mo_host_last_fault: the address). */
int mo_host_mlp_wait(void *h, int64_t *ns, int *ready) {
    pool_t *P = h;
    if (!P) return -EINVAL;
    pthread_mutex_lock(&P->call_mu);
    int started = P->busy == 2;
    if (started) P->busy = 1;
    pthread_mutex_unlock(&P->call_mu);
    if (!started) return -EINVAL;
    mlp_task *T = P->async_task;
    int r = 1, rc = 0;
    if (!P->async_empty) {
        r = pool_finish(P, &T->done2, T->n2);
        mlp_free(T);
        diag_call(P);
        if (T->fault) { P->last_fault = T->fault; rc = -EFAULT; }
    }
    int64_t end = __atomic_load_n(&P->async_t1, __ATOMIC_ACQUIRE);
    if (ns) *ns = (P->async_empty || end < P->async_t0) ? 0 : end - P->async_t0;
    if (ready) *ready = r;
    pool_release(P);
    return rc;
}
