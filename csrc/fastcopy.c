/* Copy kernels of the mmap engine's fill step: the native pool (copy_pool.c) copies whole-slot
 * chunks with rep movsb and smaller ones with nt4 (its "mixed" kind; nt4 throughout where the CPU
 * lacks ERMS); the Python copy threads use nt4 through ctypes. Built with copy_pool.c as the library
 * mo_native (mmap_offload/native.py). Plain C, no Python API: ctypes calls release the GIL. Other
 * kernels (single-stream nt, temporal AVX2 stores) measured slower and were removed (TRANSFER.md). */
#include "fastcopy.h"
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* AVX2 per function, not per build: the file compiles without -mavx2 (sanitizer builds, other
 * flags); callers check the CPU (native.py loads the library only where AVX2 is present). */
#define MO_AVX2 __attribute__((target("avx2")))

/* "rep movsb": the microcoded string copy (fast on CPUs with ERMS/FSRM). */
void mo_copy_movsb(void *dst, const void *src, size_t n) {
    __asm__ __volatile__("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}

/* AVX2 loads + non-temporal stores, software prefetch `pf` bytes ahead of the source (nt4's
 * head and tail). */
MO_AVX2 static void copy_nt(void *dst, const void *src, size_t n, size_t pf) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    size_t head = (32 - ((uintptr_t)d & 31)) & 31;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t blocks = n / 128;
    for (size_t i = 0; i < blocks; i++) {
        _mm_prefetch(s + pf, _MM_HINT_T0);
        _mm_prefetch(s + pf + 64, _MM_HINT_T0);
        __m256i a = _mm256_loadu_si256((const __m256i *)(s));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + 96));
        _mm256_stream_si256((__m256i *)(d), a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(d + 96), e);
        s += 128; d += 128;
    }
    _mm_sfence();
    memcpy(d, s, n % 128);
}

/* Four interleaved non-temporal streams (quarters of the range): more independent misses in
 * flight per core, so more L2 streamers work at once. */
MO_AVX2 void mo_copy_nt4(void *dst, const void *src, size_t n, size_t pf) {
    size_t q = (n / 4) & ~(size_t)4095;
    if (q < 4096 || ((uintptr_t)dst & 31) != ((uintptr_t)src & 31) % 32 || ((uintptr_t)dst & 31)) {
        copy_nt(dst, src, n, pf);
        return;
    }
    char *d[4];
    const char *s[4];
    for (int k = 0; k < 4; k++) { d[k] = (char *)dst + k * q; s[k] = (const char *)src + k * q; }
    for (size_t off = 0; off < q; off += 128) {
        for (int k = 0; k < 4; k++) {
            const char *sp = s[k] + off;
            char *dp = d[k] + off;
            _mm_prefetch(sp + pf, _MM_HINT_T0);
            _mm_prefetch(sp + pf + 64, _MM_HINT_T0);
            __m256i a = _mm256_loadu_si256((const __m256i *)(sp));
            __m256i b = _mm256_loadu_si256((const __m256i *)(sp + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(sp + 64));
            __m256i e = _mm256_loadu_si256((const __m256i *)(sp + 96));
            _mm256_stream_si256((__m256i *)(dp), a);
            _mm256_stream_si256((__m256i *)(dp + 32), b);
            _mm256_stream_si256((__m256i *)(dp + 64), c);
            _mm256_stream_si256((__m256i *)(dp + 96), e);
        }
    }
    _mm_sfence();
    copy_nt((char *)dst + 4 * q, (const char *)src + 4 * q, n - 4 * q, pf);
}
