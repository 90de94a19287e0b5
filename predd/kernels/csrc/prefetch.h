/* Software prefetch of a page's entries. Pages lie anywhere in the pool, so the hardware
 * prefetcher, which follows addresses, cannot run ahead across them: the attention
 * kernels ask for the next page's K (or V) while they read this one's, and for a task's
 * first page before they need it. */
#ifndef PREDD_PREFETCH_H
#define PREDD_PREFETCH_H
#include <stdint.h>

/* Asks for `count` entries of `bytes` each, `stride` bytes apart, to be brought into
 * cache */
static inline void prefetch_entries(const void *at, int64_t count, int64_t stride,
                                    int64_t bytes)
{
    for (int64_t e = 0; e < count; e++)
        for (int64_t b = 0; b < bytes; b += 64)
            __builtin_prefetch((const char *)at + e * stride + b);
}
#endif
