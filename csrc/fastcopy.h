/* Copy kernels of csrc/fastcopy.c, shared with csrc/copy_pool.c. */
#ifndef MO_FASTCOPY_H
#define MO_FASTCOPY_H
#include <stddef.h>
void mo_copy_movsb(void *dst, const void *src, size_t n);
void mo_copy_nt4(void *dst, const void *src, size_t n, size_t pf);
#endif
