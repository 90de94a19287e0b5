/* Values of a float32 or a bfloat16 tensor, as float32: `bf16` is a constant where the
 * caller is inlined, so each variant compiles without the test. A bfloat16 is a
 * float32's top 16 bits; storing one rounds to nearest even, as torch rounds. */
#ifndef PREDD_BF16_H
#define PREDD_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_widen(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_narrow(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    /* round to nearest even; a NaN stays NaN (quietened). A select, not a branch, so
     * that loops storing bf16 vectorise. */
    const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
    const uint32_t quiet = u | 0x00400000u;
    return (uint16_t)(((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded) >> 16);
}

/* f as the nearest bfloat16 would hold it */
static inline float bf16_round(float f)
{
    return bf16_widen(bf16_narrow(f));
}

static inline float load1(const void *p, int64_t i, const int bf16)
{
    return bf16 ? bf16_widen(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float f, const int bf16)
{
    if (bf16)
        ((uint16_t *)p)[i] = bf16_narrow(f);
    else
        ((float *)p)[i] = f;
}
#endif
