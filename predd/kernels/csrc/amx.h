/* AMX tiles, shared by the kernels that use them (quant_tiles.c, which owns the state,
 * and attention_tiles.c): defines AMX where the compiler targets a CPU with them. */
#ifndef PREDD_AMX_H
#define PREDD_AMX_H
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <immintrin.h>
#include <stdint.h>
#define AMX 1

/* 1 where this process may use the tiles (the kernel granted them) and they are not
 * turned off (linear_bf16_tiles(0)), else 0 */
int amx_ready(void);
/* this thread's tiles: all eight 16 rows of 64 bytes */
void amx_configure(void);

#endif
#endif
