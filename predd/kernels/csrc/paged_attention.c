/* Paged attention on the CPU, reading K and V where they lie in the pool: float32, or
 * bfloat16 storage (q, the pool, out), or float32 q and out over a bfloat16 pool,
 * computed in float32.
 *
 * Built by predd/kernels/cpu_kernels.py on the machine that runs it (cc -O3 -march=native
 * -fno-trapping-math -fopenmp) and called through ctypes. OpenMP here is the same
 * libgomp torch loaded, so the kernel shares torch's threads and their count
 * (torch.set_num_threads).
 *
 * One query row r (a new token of some call) attends to the first row_visible[r]
 * entries of its call's page table (indices + row_pages[r]): causality within a chunk
 * is the caller's choice of row_visible. A task is one row and `span` of its kv heads
 * (all of them when there are rows enough for the threads: each entry's K and V are
 * then read once, contiguously): the query heads of those kv heads are scored over
 * the entries a page at a time, softmaxed, and their weighted sum of V written to out.
 * No gather, no padding.
 *
 * Pool layout per layer (predd/worker/paged_kv.py): [pages, 2, page_size, kv_heads, head_dim].
 * In bfloat16 every value is widened to float32 as it is read (its 16 bits are a
 * float32's top half), scores and sums stay float32, and out is rounded to nearest even
 * as torch rounds.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "bf16.h"
#include "exp_approx.h"
#include "lanes.h"
#include "prefetch.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 8
#endif

#ifdef VECTOR
static inline __m256 load8(const void *p, int64_t i, const int bf16)
{
    if (!bf16)
        return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* q . k over n values: q float32, k of the pool's type */
static inline float dot(const float *q, const void *k, int64_t n, const int bf16)
{
#ifdef VECTOR
    if (n % 16 == 0) {
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (int64_t d = 0; d < n; d += 16) {
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k, d, bf16), a);
            b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k, d + 8, bf16), b);
        }
        a = _mm256_add_ps(a, b);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
#endif
    float s = 0.0f;
    for (int64_t d = 0; d < n; d++)
        s += q[d] * load1(k, d, bf16);
    return s;
}

/* acc[0:n] += sum over e < count of p[e] * v[e * stride : e * stride + n] (v of the
 * pool's type, stride in values) */
static inline void weighted_sum(float *acc, const float *p, const void *v, int64_t count,
                                int64_t stride, int64_t n, const int bf16)
{
#ifdef VECTOR
    if (n % 64 == 0) {
        for (int64_t d = 0; d < n; d += 64) {
            __m256 a[8];
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_loadu_ps(acc + d + 8 * i);
            for (int64_t e = 0; e < count; e++) {
                const __m256 w = _mm256_broadcast_ss(p + e);
                for (int i = 0; i < 8; i++)
                    a[i] = _mm256_fmadd_ps(w, load8(v, e * stride + d + 8 * i, bf16), a[i]);
            }
            for (int i = 0; i < 8; i++)
                _mm256_storeu_ps(acc + d + 8 * i, a[i]);
        }
        return;
    }
#endif
    for (int64_t e = 0; e < count; e++) {
        for (int64_t d = 0; d < n; d++)
            acc[d] += p[e] * load1(v, e * stride + d, bf16);
    }
}

#if defined(__AVX512F__)
/* AVX-512: 16 lanes; dot products of bfloat16 straight from storage where the CPU has
 * VDPBF16PS (pairs of bf16 products summed into float32 lanes: no widening), and V
 * widened once per entry for all the query heads that read it. */
#define WIDE 16

static inline __m512 load16(const void *p, int64_t i, const int bf16)
{
    if (!bf16)
        return _mm512_loadu_ps((const float *)p + i);
    return bf16_widen16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
}

/* q . k over n values, n a multiple of 64: qraw in q's type (bf16 where `qb`), qf the
 * same as float32, k bf16 where `kb` (both bf16 with VDPBF16PS read qraw, else qf) */
static inline float dot_wide(const void *qraw, const float *qf, const void *k, int64_t n,
                             const int qb, const int kb)
{
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
    if (qb && kb) {
        const uint16_t *q16 = qraw, *k16 = k;
        for (int64_t d = 0; d < n; d += 64) {
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q16 + d),
                                 (__m512bh)_mm512_loadu_si512(k16 + d));
            b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(q16 + d + 32),
                                 (__m512bh)_mm512_loadu_si512(k16 + d + 32));
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
#endif
    (void)qraw;
    (void)qb;
    for (int64_t d = 0; d < n; d += 32) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), load16(k, d, kb), a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d + 16), load16(k, d + 16, kb), b);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}

#if defined(__AVX512BF16__)
#define PAGE_DOTS 16
/* q . k for a page's 16 entries of bf16 (entry e at k + e * stride), n a multiple of
 * 32: lane e holds entry e's score, unscaled */
static inline __m512 dots16_bf16(const uint16_t *q, const uint16_t *k, int64_t stride,
                                 int64_t n)
{
    __m512 acc[16];
    if (n == 64) {
        /* entry by entry, one pointer stepped by the stride: dims outermost, GCC kept 16
         * entry pointers and spilled them to the stack, reloading one for each product
         * (measured: docs/kernels.md, "A page's dot products entry by entry"; the same
         * sums in the same order, the same bits) */
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q);
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512(q + 32);
        for (int e = 0; e < 16; e++, k += stride) {
            acc[e] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0,
                                      (__m512bh)_mm512_loadu_si512(k));
            acc[e] = _mm512_dpbf16_ps(acc[e], q1, (__m512bh)_mm512_loadu_si512(k + 32));
        }
        return sum_lanes16(acc);
    }
    for (int e = 0; e < 16; e++)
        acc[e] = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
        for (int e = 0; e < 16; e++)
            acc[e] = _mm512_dpbf16_ps(acc[e], qv,
                                      (__m512bh)_mm512_loadu_si512(k + e * stride + d));
    }
    return sum_lanes16(acc);
}
#endif

/* acc[g * n : (g + 1) * n] += sum over e < count of p[g * ldp + e] * v[e * stride :
 * e * stride + n] for the gn (1..4, a literal) query heads g that read one kv head:
 * each V value is read and widened once, and the gn x 64 sums stay in registers. n is
 * a multiple of 64. */
static inline __attribute__((always_inline)) void weighted_sum_heads(
    const int gn, float *acc, const float *p, int64_t ldp, const void *v, int64_t count,
    int64_t stride, int64_t n, const int bf16, const char *next)
{
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t d = 0; d < n; d += 64) {
        __m512 a[4][4];
        for (int g = 0; g < gn; g++)
            for (int i = 0; i < 4; i++)
                a[g][i] = _mm512_loadu_ps(acc + g * n + d + 16 * i);
        for (int64_t e = 0; e < count; e++) {
            if (next && d == 0)      /* the same entry of the next page (NULL: none) */
                prefetch_entries(next + e * stride * size, 1, 0, n * size);
            __m512 x[4];
            if (bf16) {          /* in bf16_widen_pairs' order: see attend_task */
                const uint16_t *ve = (const uint16_t *)v + e * stride + d;
                bf16_widen_pairs(ve, &x[0], &x[1]);
                bf16_widen_pairs(ve + 32, &x[2], &x[3]);
            } else {
                for (int i = 0; i < 4; i++)
                    x[i] = load16(v, e * stride + d + 16 * i, bf16);
            }
            for (int g = 0; g < gn; g++) {
                const __m512 w = _mm512_set1_ps(p[g * ldp + e]);
                for (int i = 0; i < 4; i++)
                    a[g][i] = _mm512_fmadd_ps(w, x[i], a[g][i]);
            }
        }
        for (int g = 0; g < gn; g++)
            for (int i = 0; i < 4; i++)
                _mm512_storeu_ps(acc + g * n + d + 16 * i, a[g][i]);
    }
}

#endif

/* q . k over n values: qraw in q's type, qf the same as float32, k bf16 where `kb` */
static inline float dot_q(const void *qraw, const float *qf, const void *k, int64_t n,
                          const int qb, const int kb)
{
#ifdef WIDE
    if (n % 64 == 0)
        return dot_wide(qraw, qf, k, n, qb, kb);
#endif
    (void)qraw;
    (void)qb;
    return dot(qf, k, n, kb);
}

/* weighted_sum for the G query heads that read one kv head: head g's probabilities at
 * p + g * ldp, its sums at acc + g * n; `next` (or NULL): the same kv head's V in the
 * next page, asked for entry by entry as these are read (where n is a multiple of 64;
 * otherwise before them, all at once) */
static inline __attribute__((always_inline)) void weighted_sum_group(
    float *acc, const float *p, int64_t ldp, const void *v, int64_t count, int64_t stride,
    int64_t n, int64_t G, const int bf16, const char *next)
{
#ifdef WIDE
    if (n % 64 == 0) {
        for (int64_t g = 0; g < G; g += 4) {      /* four heads at a time */
            float *a = acc + g * n;
            const float *pg = p + g * ldp;
            next = g ? NULL : next;                /* asked for once */
            switch (G - g < 4 ? G - g : 4) {
            case 1: weighted_sum_heads(1, a, pg, ldp, v, count, stride, n, bf16, next); break;
            case 2: weighted_sum_heads(2, a, pg, ldp, v, count, stride, n, bf16, next); break;
            case 3: weighted_sum_heads(3, a, pg, ldp, v, count, stride, n, bf16, next); break;
            default: weighted_sum_heads(4, a, pg, ldp, v, count, stride, n, bf16, next); break;
            }
        }
        return;
    }
#endif
    if (next)                     /* here the next page's entries all at once */
        prefetch_entries(next, count, stride * (bf16 ? 2 : 4), n * (bf16 ? 2 : 4));
    for (int64_t g = 0; g < G; g++)
        weighted_sum(acc + g * n, p + g * ldp, v, count, stride, n, bf16);
}

#define AT(p, i) ((const void *)((const char *)(p) + (i) * size))

/* The next page's K (or V) is asked for while this one's is read (prefetch.h): without
 * that a decode step waited on memory at every page. Asking for a task's first page
 * too, or two pages ahead, gained nothing more (measured: docs/kernels.md, "Prefetching
 * attention's next page"). */

/* The arguments of both exported functions (below), and their names. */
#define ARGS const void *q, int64_t q_stride, void *out, const void *kv, int64_t page_size, \
    int64_t kv_heads, int64_t heads, int64_t head_dim, const int32_t *indices,           \
    const int64_t *row_token, const int64_t *row_pages, const int64_t *row_visible,      \
    int64_t rows, int64_t max_visible, float scale, int64_t span, const int64_t *row_start, \
    const float *prior
#define PASS q, q_stride, out, kv, page_size, kv_heads, heads, head_dim, indices, row_token, \
    row_pages, row_visible, rows, max_visible, scale, span, row_start, prior

/* One task: query row r's heads of kv heads h0 .. h0 + sp - 1 (scores, acc, qf: the
 * thread's scratch). `qb` (q and out bf16) and `kb` (the pool bf16) are literals at each
 * call (see paged_attention). */
static inline __attribute__((always_inline)) void attend_task(
    const int qb, const int kb, ARGS, int64_t r, int64_t h0, int64_t sp, float *scores,
    float *acc, float *qf)
{
    (void)span;                                      /* this task's: sp */
    const int64_t size = kb ? 2 : 4;                 /* bytes per K or V value */
    const int64_t qsize = qb ? 2 : 4;                /* bytes per q or out value */
    const int64_t G = heads / kv_heads, D = head_dim, S = sp * G;
    const int64_t entry = kv_heads * D;              /* values per entry (K or V) */
    const int64_t page = 2 * page_size * entry;      /* values per page */
    /* query heads s = 0..S-1 of this task read kv head h0 + s / G */
    const int64_t L = row_visible[r];
    const int32_t *pages = indices + row_pages[r];
    /* a shared prefix's part, done (shared_prefix_tiles_bf16): entries from `start` on */
    const int64_t start = row_start ? row_start[r] : 0;
    const float *pr = start ? prior + (r * heads + h0 * G) * (D + 2) : NULL;
    const char *qt = (const char *)q + (row_token[r] * q_stride + h0 * G * D) * qsize;
    const float *qh = (const float *)qt;
    if (qb) {
        for (int64_t i = 0; i < S * D; i++)
            qf[i] = load1(qt, i, 1);
        qh = qf;
    }
    float best[S], total[S], carry[S];
    for (int64_t s = 0; s < S; s++)
        best[s] = pr ? pr[s * (D + 2) + D] : -INFINITY;
#ifdef PAGE_DOTS
    /* whole pages' maxima lane by lane, reduced once after the last page (a reduction a
     * page and head was ~10% of the kernel's time) */
    __m512 page_best[S];
    for (int64_t s = 0; s < S; s++)
        page_best[s] = _mm512_set1_ps(-INFINITY);
#endif
    /* scores, a page at a time, the task's heads of each entry together */
    for (int64_t j0 = start; j0 < L; j0 += page_size) {
        const int64_t k = pages[j0 / page_size] * page + h0 * D;
        const int64_t n = L - j0 < page_size ? L - j0 : page_size;
        const void *next = j0 + page_size < L
            ? AT(kv, pages[j0 / page_size + 1] * page + h0 * D) : NULL;
#ifdef PAGE_DOTS
        if (qb && kb && n == PAGE_DOTS && D % 64 == 0) {  /* a whole page of 16 entries */
            for (int64_t s = 0; s < S; s++) {
                /* the next page's entries asked for a few at a time, one share for each
                 * head, not all before the page: ~100 lines at once filled the queue
                 * of misses and stalled the prefetches themselves */
                const int64_t e0 = page_size * s / S, e1 = page_size * (s + 1) / S;
                if (next)
                    prefetch_entries((const char *)next + e0 * entry * size, e1 - e0,
                                     entry * size, sp * D * size);
                const __m512 x = _mm512_mul_ps(
                    dots16_bf16((const uint16_t *)qt + s * D, AT(kv, k + (s / G) * D),
                                entry, D),
                    _mm512_set1_ps(scale));
                _mm512_storeu_ps(scores + s * L + j0, x);
                page_best[s] = _mm512_max_ps(page_best[s], x);
            }
            continue;
        }
#endif
        if (next)
            prefetch_entries(next, page_size, entry * size, sp * D * size);
        for (int64_t e = 0; e < n; e++) {
            for (int64_t s = 0; s < S; s++) {
                const float x = dot_q(qt + s * D * qsize, qh + s * D,
                                      AT(kv, k + e * entry + (s / G) * D), D, qb, kb) * scale;
                scores[s * L + j0 + e] = x;
                best[s] = x > best[s] ? x : best[s];
            }
        }
    }
#ifdef PAGE_DOTS
    for (int64_t s = 0; s < S; s++) {
        const float m = _mm512_reduce_max_ps(page_best[s]);
        best[s] = m > best[s] ? m : best[s];
    }
#endif
    for (int64_t s = 0; s < S; s++) {
        float *row = scores + s * L, m = best[s], sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = start; j < L; j++) {
            row[j] = exp_approx(row[j] - m);
            sum += row[j];
        }
        /* the prefix's sums count by e^(its best - best) */
        carry[s] = pr ? exp_approx(pr[s * (D + 2) + D] - m) : 0.0f;
        total[s] = pr ? sum + pr[s * (D + 2) + D + 1] * carry[s] : sum;
    }
    /* the weighted sum of V, a page at a time, each output vector held while
     * the page's entries add into it */
    if (pr) {
        for (int64_t s = 0; s < S; s++)
            for (int64_t d = 0; d < D; d++)
                acc[s * D + d] = pr[s * (D + 2) + d] * carry[s];
    } else {
        memset(acc, 0, sizeof(float) * S * D);
    }
#ifdef WIDE
    /* bf16 V is widened in pairs (weighted_sum_heads): the sums are kept in that order
     * while the pages add into them (the same sums, in other lanes) */
    const int pairs = kb && D % 64 == 0;
    if (pairs && pr)
        for (int64_t i = 0; i < S * D; i += 32)
            bf16_pairs_order(acc + i, 1);
#endif
    for (int64_t j0 = start; j0 < L; j0 += page_size) {
        const int64_t v = pages[j0 / page_size] * page + page_size * entry + h0 * D;
        const int64_t n = L - j0 < page_size ? L - j0 : page_size;
        /* the next page's V, asked for as this one's is read (weighted_sum_group) */
        const char *next = j0 + page_size < L ? AT(kv, pages[j0 / page_size + 1] * page
                                                   + page_size * entry + h0 * D) : NULL;
        for (int64_t h = 0; h < sp; h++)
            weighted_sum_group(acc + h * G * D, scores + h * G * L + j0, L,
                               AT(kv, v + h * D), n, entry, D, G, kb,
                               next ? next + h * D * size : NULL);
    }
#ifdef WIDE
    if (pairs)
        for (int64_t i = 0; i < S * D; i += 32)
            bf16_pairs_order(acc + i, 0);
#endif
    const int64_t o = row_token[r] * heads * D + h0 * G * D;
    for (int64_t s = 0; s < S; s++) {
        const float inv = 1.0f / total[s];
        for (int64_t d = 0; d < D; d++)
            store1(out, o + s * D + d, acc[s * D + d] * inv, qb);
    }
}

/* q: query row t at q + t * q_stride, [heads, head_dim]; out: [tokens, heads, head_dim],
 * contiguous; kv: this layer's pool; indices: page ids of every call, table after
 * table; per row: row_token (its token in q and out), row_pages (where its call's
 * table starts), row_visible (entries it attends to, >= 1); span: kv heads per task, a
 * divisor of kv_heads. row_start (NULL: none): per row, the entries (whole pages, fewer
 * than row_visible; 0: none) already attended to, whose part of the softmax is in prior
 * [rows][heads][head_dim + 2] float32: per query head the sum of V weighted by
 * e^(score - best), best, and the weights' total (shared_prefix_tiles_bf16,
 * attention_tiles.c); the rest is added to it as online softmax does. The parallel
 * region is one for every dtype (OpenMP outlines it before inlining, so `qb` and `kb` are
 * variables in it): each task branches once to the body inlined for its dtypes. */
static inline __attribute__((always_inline)) int paged_attention(const int qb, const int kb,
                                                                 ARGS)
{
    /* a task a row and `span` kv heads; but where the rows do not share out evenly over
     * the threads, the last rows % threads rows take a task a kv head, after the others
     * (7 decodes on 2 threads: 4 tasks against 3, as long as 8, where now 10.5 / 10.5
     * kv heads' work) */
    const int threads = omp_get_max_threads();
    const int64_t split = span > 1 && threads > 1 ? rows % threads : 0;
    const int64_t whole = (rows - split) * (kv_heads / span);
    const int64_t S = span * (heads / kv_heads), tasks = whole + split * kv_heads;
    int failed = 0;

    #pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * S * max_visible);
        float *acc = malloc(sizeof(float) * S * head_dim);
        float *qf = malloc(sizeof(float) * S * head_dim);   /* bf16: the task's q, widened */
        if (!scores || !acc || !qf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores || !acc || !qf)
                continue;
            const int64_t t = task - whole, groups = kv_heads / span;
            const int64_t r = t < 0 ? task / groups : rows - split + t / kv_heads;
            const int64_t h0 = t < 0 ? task % groups * span : t % kv_heads;
            const int64_t sp = t < 0 ? span : 1;
            if (qb)
                attend_task(1, 1, PASS, r, h0, sp, scores, acc, qf);
            else if (kb)
                attend_task(0, 1, PASS, r, h0, sp, scores, acc, qf);
            else
                attend_task(0, 0, PASS, r, h0, sp, scores, acc, qf);
        }
        free(scores);
        free(acc);
        free(qf);
    }
    return failed ? -1 : 0;
}

int paged_attention_f32(ARGS) { return paged_attention(0, 0, PASS); }
int paged_attention_bf16(ARGS) { return paged_attention(1, 1, PASS); }
int paged_attention_f32_kvbf16(ARGS) { return paged_attention(0, 1, PASS); }

/* The step's new K and V into their slots: entry i of k (at k + i * src_stride bytes,
 * `entry` bytes of contiguous heads) to row rows[i] of the layer's pool seen as rows of
 * `entry` bytes, and v's to row rows[i] + page_size (the page's V half). One copy per
 * entry, cheaper than index_copy_ from a strided view of qkv (measured: docs/kernels.md,
 * "New K and V stored in one call a layer"). */
void store_entries(void *kv, const int64_t *rows, int64_t n, const void *k, const void *v,
                   int64_t src_stride, int64_t entry, int64_t page_size)
{
    for (int64_t i = 0; i < n; i++) {
        memcpy((char *)kv + rows[i] * entry, (const char *)k + i * src_stride, entry);
        memcpy((char *)kv + (rows[i] + page_size) * entry, (const char *)v + i * src_stride,
               entry);
    }
}

/* store_entries of float32 K and V into a bfloat16 pool (`entry` its bytes), each value
 * rounded to nearest even as torch rounds (a NaN stays NaN, quietened: bf16.h) */
void store_entries_bf16(void *kv, const int64_t *rows, int64_t n, const void *k,
                        const void *v, int64_t src_stride, int64_t entry, int64_t page_size)
{
    uint16_t *pool = kv;
    entry /= 2;                                      /* in values */
    for (int64_t i = 0; i < n; i++) {
        const float *ki = (const float *)((const char *)k + i * src_stride);
        const float *vi = (const float *)((const char *)v + i * src_stride);
        uint16_t *kd = pool + rows[i] * entry, *vd = pool + (rows[i] + page_size) * entry;
        for (int64_t j = 0; j < entry; j++)
            kd[j] = bf16_narrow(ki[j]);
        for (int64_t j = 0; j < entry; j++)
            vd[j] = bf16_narrow(vi[j]);
    }
}
