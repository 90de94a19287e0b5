/* Paged attention for chunks (calls of several new tokens) by AMX tiles, bfloat16 pool
 * and rows, pages of 16 entries: paged_attention.c scores each query row against every
 * entry alone (dot products: ~0.24 ms a row over 440 entries for SmolLM2's 30 layers on
 * two Sapphire Rapids cores, so an agent's 41-token observation costs ~10 ms a step);
 * here 16 query vectors are scored against a page's 16 entries in one tile product.
 *
 * A task is one call's block of 16 query vectors (its rows x the query heads of one kv
 * head, row-major) and that kv head. Per page: the page's K, transposed into pairs of
 * dims (the tile unit's layout for the right operand), times the block's q: 16 x 16
 * scores. Softmax per query vector over the entries its row sees (causal within the
 * chunk) in float32, as paged_attention.c does (the same exp_approx, the same max
 * shift). The weighted sum of V: the probabilities as three bfloat16 parts, p = hi +
 * mid + lo (each the rounded rest of the one before: together float32's 24 bits of p,
 * where one bf16 keeps 8, and two left errors of 1e-6 where an output cancels to near
 * 0), each times V laid out in pairs of entries, into float32 tiles. So each output is the
 * float32 computation rounded to bf16 once, as paged_attention.c's (the tests hold both
 * to the same bound). Entries past the call's last are never read: their probabilities
 * are 0 and their V is taken as 0 (a NaN there would poison 0 x NaN).
 *
 * Built with the other kernels (predd/cpu_kernels.py); AMX tiles from quant_tiles.c
 * (amx.h). Returns -1 without computing anything where the tiles are not there or not
 * permitted, the shape is not one this handles (page_size 16, head_dim a multiple of
 * 64), or memory is short: the caller then takes paged_attention.c for these rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "exp_approx.h"

/* The arguments: as paged_attention.c's, with the calls instead of the rows: call c's
 * rows are rows call_row[c] .. call_row[c] + call_rows[c] - 1 of row_token / row_pages /
 * row_visible (its tokens, consecutive in q and out; row_visible rising by one a row). */
#define TILE_ARGS const void *q, int64_t q_stride, void *out, const void *kv,              \
    int64_t page_size, int64_t kv_heads, int64_t heads, int64_t head_dim,                   \
    const int32_t *indices, const int64_t *row_token, const int64_t *row_pages,           \
    const int64_t *row_visible, const int64_t *call_row, const int64_t *call_rows,        \
    int64_t calls, int64_t max_visible, float scale

#if defined(AMX)
#define PAGE 16
#define ENTRY_STEP 32      /* entries per tile product of the weighted sum: two pages */

/* bt[i * 16 + e] = the i-th pair of dims (2i, 2i + 1 from `at`) of entry e, e < n; 0 for
 * e >= n. k: the page's first entry at this kv head, `stride` uint32 to the next. */
static inline void k_pairs(uint32_t *bt, const uint32_t *k, int64_t stride, int64_t n)
{
    const __m512i at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)stride));
    const __mmask16 valid = (__mmask16)((1u << n) - 1);
    for (int i = 0; i < 16; i++)
        _mm512_store_si512(bt + i * 16, _mm512_mask_i32gather_epi32(
            _mm512_setzero_si512(), valid, at, k + i, 4));
}

/* vb[b * 256 + i * 16 + j] (uint32) = dims d0 + 16b + j of entries 2i and 2i + 1 of the
 * 32 entries from `first` (bf16 pairs), b < blocks; entries at or past `valid` are 0.
 * entry(e): its V at this kv head. */
static inline void v_pairs(uint32_t *vb, const uint16_t *const *entry, int64_t valid,
                           int64_t d0, int blocks)
{
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                         25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                         18, 2, 17, 1, 16, 0);
    for (int i = 0; i < 16; i++) {
        const uint16_t *a = 2 * i < valid ? entry[2 * i] : NULL;
        const uint16_t *b = 2 * i + 1 < valid ? entry[2 * i + 1] : NULL;
        for (int blk = 0; blk < blocks; blk++) {
            const __m256i x = a ? _mm256_loadu_si256((const __m256i *)(a + d0 + 16 * blk))
                                : _mm256_setzero_si256();
            const __m256i y = b ? _mm256_loadu_si256((const __m256i *)(b + d0 + 16 * blk))
                                : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
            _mm512_store_si512(vb + blk * 256 + i * 16, _mm512_permutexvar_epi16(mix, both));
        }
    }
}


struct scratch {
    float *s;          /* [16][width] scores, then probabilities */
    uint16_t *hi, *mid, *lo;   /* [16][width] the probabilities' three bf16 parts */
    uint16_t *qa;      /* [16][D] the block's query vectors */
    float *o;          /* [16][64] weighted sums of one half of D */
    uint32_t *bt;      /* [16][16] a page's K in pairs of dims */
    uint32_t *vb;      /* [4][16][16] 32 entries' V in pairs of entries */
    const uint16_t **entry;  /* [32] */
};

static void block_task(TILE_ARGS, int64_t c, int64_t h, int64_t b, int64_t width,
                       const struct scratch *w)
{
    const int64_t G = heads / kv_heads, D = head_dim, R = call_rows[c], r0 = call_row[c];
    const int64_t entry = kv_heads * D, page = 2 * PAGE * entry;   /* in values */
    const int64_t m0 = 16 * b, count = R * G - m0 < 16 ? R * G - m0 : 16;
    const uint16_t *pool = kv;
    const int32_t *pages = indices + row_pages[r0];
    int64_t visible[16];
    /* the block's q, its vectors m = row * G + head of this kv head */
    for (int64_t i = 0; i < 16; i++) {
        if (i < count) {
            const int64_t m = m0 + i, r = r0 + m / G;
            visible[i] = row_visible[r];
            memcpy(w->qa + i * D, (const uint16_t *)q + row_token[r] * q_stride
                   + (h * G + m % G) * D, (size_t)D * 2);
        } else {
            visible[i] = 0;
            memset(w->qa + i * D, 0, (size_t)D * 2);
        }
    }
    const int64_t L = visible[count - 1];          /* the block's last row sees most */
    /* scores: a page of 16 entries at a time, 16 x 16 in tile 0 */
    for (int64_t j0 = 0; j0 < L; j0 += PAGE) {
        const int64_t n = L - j0 < PAGE ? L - j0 : PAGE;
        const uint16_t *k = pool + pages[j0 / PAGE] * page + h * D;
        _tile_zero(0);
        for (int64_t d = 0; d < D; d += 32) {
            k_pairs(w->bt, (const uint32_t *)(k + d), entry / 2, n);
            _tile_loadd(4, w->qa + d, D * 2);
            _tile_loadd(6, w->bt, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, w->s + j0, width * 4);
    }
    /* softmax of each vector over what its row sees; the rest of the width is 0 */
    float total[16];
    for (int64_t i = 0; i < 16; i++) {
        float *row = w->s + i * width;
        uint16_t *hi = w->hi + i * width, *mid = w->mid + i * width, *lo = w->lo + i * width;
        const int64_t V = visible[i];
        float best = -INFINITY, sum = 0.0f;
        #pragma omp simd reduction(max:best)
        for (int64_t j = 0; j < V; j++) {
            row[j] *= scale;
            best = row[j] > best ? row[j] : best;
        }
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < V; j++) {
            row[j] = exp_approx(row[j] - best);
            sum += row[j];
        }
        total[i] = sum;
        for (int64_t j = 0; j < V; j++) {
            hi[j] = bf16_narrow(row[j]);
            const float rest = row[j] - bf16_widen(hi[j]);
            mid[j] = bf16_narrow(rest);
            lo[j] = bf16_narrow(rest - bf16_widen(mid[j]));
        }
        memset(hi + V, 0, (size_t)(width - V) * 2);
        memset(mid + V, 0, (size_t)(width - V) * 2);
        memset(lo + V, 0, (size_t)(width - V) * 2);
    }
    /* the weighted sum of V, 64 dims at a time in tiles 0..3, 32 entries a product */
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j0 = 0; j0 < L; j0 += ENTRY_STEP) {
            for (int e = 0; e < ENTRY_STEP && j0 + e < L; e++)
                w->entry[e] = pool + pages[(j0 + e) / PAGE] * page + PAGE * entry
                              + ((j0 + e) % PAGE) * entry + h * D;
            v_pairs(w->vb, w->entry, L - j0, d0, 4);
            _tile_loadd(4, w->hi + j0, width * 2);
            _tile_loadd(5, w->mid + j0, width * 2);
            _tile_loadd(7, w->lo + j0, width * 2);
#define PRODUCT(t) _tile_loadd(6, w->vb + t * 256, 64); _tile_dpbf16ps(t, 4, 6); \
            _tile_dpbf16ps(t, 5, 6); _tile_dpbf16ps(t, 7, 6);
            PRODUCT(0) PRODUCT(1) PRODUCT(2) PRODUCT(3)
#undef PRODUCT
        }
        _tile_stored(0, w->o, 256);
        _tile_stored(1, w->o + 16, 256);
        _tile_stored(2, w->o + 32, 256);
        _tile_stored(3, w->o + 48, 256);
        for (int64_t i = 0; i < count; i++) {
            const int64_t m = m0 + i, r = r0 + m / G;
            uint16_t *dst = (uint16_t *)out + (row_token[r] * heads + h * G + m % G) * D + d0;
            const float inv = 1.0f / total[i];
            for (int64_t d = 0; d < 64; d++)
                dst[d] = bf16_narrow(w->o[i * 64 + d] * inv);
        }
    }
}

int paged_attention_tiles_bf16(TILE_ARGS)
{
    if (page_size != PAGE || head_dim % 64 != 0 || heads % kv_heads != 0 || !amx_ready())
        return -1;
    const int64_t G = heads / kv_heads, D = head_dim;
    const int64_t width = (max_visible + ENTRY_STEP - 1) / ENTRY_STEP * ENTRY_STEP;
    /* tasks: (call, kv head, block of 16 vectors), counted per call */
    int64_t tasks = 0;
    int64_t *first = malloc(sizeof(int64_t) * (calls + 1));
    if (!first)
        return -1;
    for (int64_t c = 0; c < calls; c++) {
        first[c] = tasks;
        tasks += kv_heads * ((call_rows[c] * G + 15) / 16);
    }
    first[calls] = tasks;
    int failed = 0;
    #pragma omp parallel
    {
        struct scratch w;
        w.s = aligned_alloc(64, sizeof(float) * 16 * width);
        w.hi = aligned_alloc(64, 2 * 16 * width);
        w.mid = aligned_alloc(64, 2 * 16 * width);
        w.lo = aligned_alloc(64, 2 * 16 * width);
        w.qa = aligned_alloc(64, 2 * 16 * D);
        w.o = aligned_alloc(64, sizeof(float) * 16 * 64);
        w.bt = aligned_alloc(64, 4 * 256);
        w.vb = aligned_alloc(64, 4 * 4 * 256);
        w.entry = malloc(sizeof(*w.entry) * ENTRY_STEP);
        const int ok = w.s && w.hi && w.mid && w.lo && w.qa && w.o && w.bt && w.vb && w.entry;
        if (!ok) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
            amx_configure();
            #pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < tasks; t++) {
                int64_t c = 0;
                while (first[c + 1] <= t)
                    c++;
                const int64_t blocks = (call_rows[c] * G + 15) / 16, k = t - first[c];
                block_task(q, q_stride, out, kv, page_size, kv_heads, heads, head_dim,
                           indices, row_token, row_pages, row_visible, call_row, call_rows,
                           calls, max_visible, scale, c, k / blocks, k % blocks, width, &w);
            }
            _tile_release();
        }
        free(w.s); free(w.hi); free(w.mid); free(w.lo); free(w.qa); free(w.o); free(w.bt); free(w.vb);
        free(w.entry);
    }
    free(first);
    return failed ? -1 : 0;
}
#else
int paged_attention_tiles_bf16(TILE_ARGS)
{
    (void)q; (void)q_stride; (void)out; (void)kv; (void)page_size; (void)kv_heads;
    (void)heads; (void)head_dim; (void)indices; (void)row_token; (void)row_pages;
    (void)row_visible; (void)call_row; (void)call_rows; (void)calls; (void)max_visible;
    (void)scale;
    return -1;
}
#endif
