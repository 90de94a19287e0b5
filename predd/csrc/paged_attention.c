/* Paged attention on the CPU, float32, reading K and V where they lie in the pool.
 *
 * Built by predd/cpu_kernels.py on the machine that runs it (cc -O3 -march=native
 * -fopenmp) and called through ctypes. OpenMP here is the same libgomp torch loaded,
 * so the kernel shares torch's threads and their count (torch.set_num_threads).
 *
 * One query row r (a new token of some call) attends to the first row_visible[r]
 * entries of its call's page table (indices + row_pages[r]): causality within a chunk
 * is the caller's choice of row_visible. A task is one row and `span` of its kv heads
 * (all of them when there are rows enough for the threads: each entry's K and V are
 * then read once, contiguously): the query heads of those kv heads are scored over
 * the entries a page at a time, softmaxed, and their weighted sum of V written to out.
 * No gather, no padding.
 *
 * Pool layout per layer (predd/paged_kv.py): [pages, 2, page_size, kv_heads, head_dim].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_approx.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 8
#endif

/* q . k over n floats */
static inline float dot(const float *q, const float *k, int64_t n)
{
#ifdef VECTOR
    if (n % 16 == 0) {
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (int64_t d = 0; d < n; d += 16) {
            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
            b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), b);
        }
        a = _mm256_add_ps(a, b);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
#endif
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (int64_t d = 0; d < n; d++)
        s += q[d] * k[d];
    return s;
}

/* acc[0:n] += sum over e < count of p[e] * v[e * stride : e * stride + n] */
static inline void weighted_sum(float *acc, const float *p, const float *v, int64_t count,
                                int64_t stride, int64_t n)
{
#ifdef VECTOR
    if (n % 64 == 0) {
        for (int64_t d = 0; d < n; d += 64) {
            __m256 a[8];
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_loadu_ps(acc + d + 8 * i);
            for (int64_t e = 0; e < count; e++) {
                const __m256 w = _mm256_broadcast_ss(p + e);
                const float *ve = v + e * stride + d;
                for (int i = 0; i < 8; i++)
                    a[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(ve + 8 * i), a[i]);
            }
            for (int i = 0; i < 8; i++)
                _mm256_storeu_ps(acc + d + 8 * i, a[i]);
        }
        return;
    }
#endif
    for (int64_t e = 0; e < count; e++) {
        #pragma omp simd
        for (int64_t d = 0; d < n; d++)
            acc[d] += p[e] * v[e * stride + d];
    }
}

int paged_attention_f32(
    const float *q, int64_t q_stride,   /* query row t at q + t * q_stride: [heads, head_dim] */
    float *out,                          /* [tokens, heads, head_dim], contiguous */
    const float *kv,                     /* this layer's pool */
    int64_t page_size, int64_t kv_heads, int64_t heads, int64_t head_dim,
    const int32_t *indices,              /* page ids of every call, table after table */
    const int64_t *row_token,            /* [rows]: the row's token in q and out */
    const int64_t *row_pages,            /* [rows]: where its call's table starts */
    const int64_t *row_visible,          /* [rows]: entries it attends to, >= 1 */
    int64_t rows, int64_t max_visible, float scale,
    int64_t span)                        /* kv heads per task: a divisor of kv_heads */
{
    const int64_t G = heads / kv_heads, D = head_dim, S = span * G;
    const int64_t entry = kv_heads * D;              /* floats per entry (K or V) */
    const int64_t page = 2 * page_size * entry;      /* floats per page */
    const int64_t groups = kv_heads / span;
    int failed = 0;

    #pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * S * max_visible);
        float *acc = malloc(sizeof(float) * S * D);
        if (!scores || !acc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < rows * groups; task++) {
            if (!scores || !acc)
                continue;
            /* query heads s = 0..S-1 of this task read kv head h0 + s / G */
            const int64_t r = task / groups, h0 = (task % groups) * span;
            const int64_t L = row_visible[r];
            const int32_t *pages = indices + row_pages[r];
            const float *qh = q + row_token[r] * q_stride + h0 * G * D;
            float best[S], total[S];
            for (int64_t s = 0; s < S; s++)
                best[s] = -INFINITY;
            /* scores, a page at a time, the task's heads of each entry together */
            for (int64_t j0 = 0; j0 < L; j0 += page_size) {
                const float *k = kv + pages[j0 / page_size] * page + h0 * D;
                const int64_t n = L - j0 < page_size ? L - j0 : page_size;
                for (int64_t e = 0; e < n; e++, k += entry) {
                    for (int64_t s = 0; s < S; s++) {
                        const float x = dot(qh + s * D, k + (s / G) * D, D) * scale;
                        scores[s * L + j0 + e] = x;
                        best[s] = x > best[s] ? x : best[s];
                    }
                }
            }
            for (int64_t s = 0; s < S; s++) {
                float *row = scores + s * L, m = best[s], sum = 0.0f;
                #pragma omp simd reduction(+:sum)
                for (int64_t j = 0; j < L; j++) {
                    row[j] = exp_approx(row[j] - m);
                    sum += row[j];
                }
                total[s] = sum;
            }
            /* the weighted sum of V, a page at a time, each output vector held while
             * the page's entries add into it */
            memset(acc, 0, sizeof(float) * S * D);
            for (int64_t j0 = 0; j0 < L; j0 += page_size) {
                const float *v = kv + pages[j0 / page_size] * page + page_size * entry + h0 * D;
                const int64_t n = L - j0 < page_size ? L - j0 : page_size;
                for (int64_t s = 0; s < S; s++)
                    weighted_sum(acc + s * D, scores + s * L + j0, v + (s / G) * D, n, entry, D);
            }
            float *o = out + row_token[r] * heads * D + h0 * G * D;
            for (int64_t s = 0; s < S; s++) {
                const float inv = 1.0f / total[s];
                #pragma omp simd
                for (int64_t d = 0; d < D; d++)
                    o[s * D + d] = acc[s * D + d] * inv;
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
