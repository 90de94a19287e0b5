/* A step's decoder layers in one call, float32 or bfloat16, for a step that
 * predd/kernels/layer_loop.py found every piece of on these kernels: each projection from its blocks
 * (quant_linear.c), the norms, RoPE and SwiGLU (layer_ops.c), the new K/V stored and
 * attention over the pages (paged_attention.c, attention_tiles.c). The same functions,
 * with the same arguments in the same order, as the Python loop of predd/model/llama.py
 * makes them one ctypes call at a time: the same bits out. What this saves is that
 * loop's own time, ~10 calls a layer through Python, ctypes and torch's allocator, while
 * the other threads wait (a third of a decode step of 8 calls on 2 cores).
 */
#include <stdint.h>

/* the kernels this calls, from the other files of the library */
#define OPS(T, t) \
void add_rms_norm_##t(T *x, const T *delta, const T *weight, T *out, int64_t rows, int64_t n, \
                      float eps); \
void rope_##t(T *x, int64_t stride, const float *cos, const float *sin, int64_t rows, \
              int64_t heads, int64_t d); \
void silu_mul_##t(const T *gu, T *out, int64_t rows, int64_t n); \
void linear_q4_1_##t(const T *x, int64_t M, int64_t K, const uint8_t *q, const float *d, \
                     const float *m, int64_t N, const float *bias, T *y); \
void linear_q8_0_##t(const T *x, int64_t M, int64_t K, const int8_t *q, const float *d, \
                     int64_t N, const float *bias, T *y); \
int paged_attention_##t(const void *q, int64_t q_stride, void *out, const void *kv, \
                        int64_t page_size, int64_t kv_heads, int64_t heads, int64_t head_dim, \
                        const int32_t *indices, const int64_t *row_token, \
                        const int64_t *row_pages, const int64_t *row_visible, int64_t rows, \
                        int64_t max_visible, float scale, int64_t span, \
                        const int64_t *row_start, const float *prior);
OPS(float, f32)
OPS(uint16_t, bf16)
int linear_q4_1_int8(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *d,
                     const float *m, int64_t N, const float *bias, float *y);
int linear_q8_0_int8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *d,
                     int64_t N, const float *bias, float *y);
void linear_q4_1_lanes_bf16(const uint16_t *x, int64_t M, int64_t K, const uint32_t *q,
                            const float *d, const float *m, int64_t N, const float *bias,
                            uint16_t *y);
void store_entries(void *kv, const int64_t *rows, int64_t n, const void *k, const void *v,
                   int64_t src_stride, int64_t entry, int64_t page_size);
int paged_attention_tiles_bf16(const void *q, int64_t q_stride, void *out, const void *kv,
                               int64_t page_size, int64_t kv_heads, int64_t heads,
                               int64_t head_dim, const int32_t *indices,
                               const int64_t *row_token, const int64_t *row_pages,
                               const int64_t *row_visible, const int64_t *call_row,
                               const int64_t *call_rows, int64_t calls, int64_t max_visible,
                               float scale);
int shared_prefix_tiles_bf16(const void *q, int64_t q_stride, const void *kv, int64_t page_size,
                             int64_t kv_heads, int64_t heads, int64_t head_dim,
                             const int32_t *indices, const int64_t *row_token,
                             const int64_t *row_pages, const int64_t *group_index,
                             const int64_t *group_row, const int64_t *group_rows,
                             const int64_t *group_pages, int64_t groups, float scale,
                             float *prior);

/* Shared prefixes (cpu_kernels.SharedPrefixes) of a set of rows of the row kernel:
 * `groups` groups (none: 0), each row's start, the prior they fill. */
struct prefixes {
    const int64_t *index, *row, *rows, *pages;
    int64_t groups;
    const int64_t *start;
    float *prior;
};

/* A projection's blocks (predd.model.loader.QuantBlocks): kind 4 Q4_1, 8 Q8_0, 5 Q4_1 in lanes
 * (quant_lanes.c: bfloat16 only), 4 + INT8 and 8 + INT8 by int8 dot products
 * (quant_int8.c: float32 only); [n, k] */
#define INT8 16
struct projection {
    int64_t kind, k, n;
    const uint8_t *q;
    const float *d, *m, *bias;
};

/* One decoder layer's weights (the norms' in the model's dtype) and its part of the pool */
struct layer {
    const void *input_norm, *post_norm;
    struct projection qkv, o, gate_up, down;
    void *kv;
};

/* A step's rows and where each op writes: x, delta, h [T, C]; qkv [T, (H + 2 KV) D];
 * attn [T, H D]; gate_up [T, 2 I]; act [T, I]. Attention as bind_attention plans it
 * (predd/kernels/cpu_kernels.py): the tiles (bf16) for `calls` calls (none: 0) and the row
 * kernel for the `rest` rows beside them, or for all T rows (every call is on these
 * kernels) where the tiles do not run; each set of rows with its shared prefixes, on
 * tiles first where they run. */
struct step {
    int64_t T, C, heads, kv_heads, head_dim, inter, page_size;
    float eps, scale;
    void *x, *delta, *h, *qkv, *attn, *gate_up, *act;
    const float *cos, *sin;
    const int64_t *store_rows;
    const int32_t *indices;
    const int64_t *row_token, *row_pages, *row_visible;
    int64_t max_visible;
    const int64_t *call_row, *call_rows;
    int64_t calls;
    const int64_t *rest_token, *rest_pages, *rest_visible;
    int64_t rest;
    int64_t span_rows, span_rest;    /* the row kernel's kv heads a task, for each set */
    struct prefixes shared_rows, shared_rest;
    const void *final_norm;          /* where not NULL: h = the final norm of x + delta */
};

/* The layer loop once per dtype: E the element type, t its suffix. Layers 0 .. n - 1 of
 * a step: x takes each block's output in place, delta holds the last one's; with
 * `final_norm`, x takes that too and h is the model's final norm of every row (what
 * predd.model.llama.LlamaModel.head computes of the rows it wants: one kernel call less from
 * Python, whose few ops after the layers cost several times what they cost alone). 0, or
 * -1 where attention or an int8 projection could not allocate its scratch (ENOMEM; x
 * is then half-way). */
#define LAYERS(E, t, TILES) \
static int project_##t(const struct projection *p, const E *x, int64_t rows, E *y) \
{ \
    if (TILES && p->kind == 5) \
        linear_q4_1_lanes_bf16((const uint16_t *)x, rows, p->k, (const uint32_t *)p->q, \
                               p->d, p->m, p->n, p->bias, (uint16_t *)y); \
    else if (!TILES && p->kind == 4 + INT8) \
        return linear_q4_1_int8((const float *)x, rows, p->k, p->q, p->d, p->m, p->n, \
                                p->bias, (float *)y); \
    else if (!TILES && p->kind == 8 + INT8) \
        return linear_q8_0_int8((const float *)x, rows, p->k, (const int8_t *)p->q, p->d, \
                                p->n, p->bias, (float *)y); \
    else if (p->kind == 4) \
        linear_q4_1_##t(x, rows, p->k, p->q, p->d, p->m, p->n, p->bias, y); \
    else \
        linear_q8_0_##t(x, rows, p->k, (const int8_t *)p->q, p->d, p->n, p->bias, y); \
    return 0; \
} \
\
static int rows_##t(const struct step *s, const void *kv, const int64_t *token, \
                    const int64_t *pages, const int64_t *visible, int64_t n, int64_t span, \
                    const struct prefixes *p) \
{ \
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->head_dim; \
    const int shared = TILES && p->groups && shared_prefix_tiles_bf16( \
        s->qkv, width, kv, s->page_size, s->kv_heads, s->heads, s->head_dim, s->indices, \
        token, pages, p->index, p->row, p->rows, p->pages, p->groups, s->scale, \
        p->prior) == 0; \
    return paged_attention_##t(s->qkv, width, s->attn, kv, s->page_size, s->kv_heads, \
                               s->heads, s->head_dim, s->indices, token, pages, visible, n, \
                               s->max_visible, s->scale, span, shared ? p->start : 0, \
                               p->prior); \
} \
\
static int attend_##t(const struct step *s, const void *kv) \
{ \
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->head_dim; \
    if (TILES && s->calls && paged_attention_tiles_bf16( \
            s->qkv, width, s->attn, kv, s->page_size, s->kv_heads, s->heads, s->head_dim, \
            s->indices, s->row_token, s->row_pages, s->row_visible, s->call_row, \
            s->call_rows, s->calls, s->max_visible, s->scale) == 0) \
        return s->rest ? rows_##t(s, kv, s->rest_token, s->rest_pages, s->rest_visible, \
                                  s->rest, s->span_rest, &s->shared_rest) : 0; \
    return rows_##t(s, kv, s->row_token, s->row_pages, s->row_visible, s->T, s->span_rows, \
                    &s->shared_rows); \
} \
\
int run_layers_##t(const struct layer *layers, int64_t n, const struct step *s) \
{ \
    const int64_t T = s->T, H = s->heads, KV = s->kv_heads, D = s->head_dim; \
    const int64_t width = (H + 2 * KV) * D; \
    E *x = s->x, *delta = s->delta, *h = s->h, *qkv = s->qkv, *gate_up = s->gate_up; \
    for (int64_t i = 0; i < n; i++) { \
        const struct layer *l = layers + i; \
        add_rms_norm_##t(x, i ? delta : 0, l->input_norm, h, T, s->C, s->eps); \
        if (project_##t(&l->qkv, h, T, qkv) != 0) \
            return -1; \
        rope_##t(qkv, width, s->cos, s->sin, T, H + KV, D); \
        store_entries(l->kv, s->store_rows, T, qkv + H * D, qkv + (H + KV) * D, \
                      width * (int64_t)sizeof(E), KV * D * (int64_t)sizeof(E), s->page_size); \
        if (attend_##t(s, l->kv) != 0) \
            return -1; \
        if (project_##t(&l->o, s->attn, T, delta) != 0) \
            return -1; \
        add_rms_norm_##t(x, delta, l->post_norm, h, T, s->C, s->eps); \
        if (project_##t(&l->gate_up, h, T, gate_up) != 0) \
            return -1; \
        silu_mul_##t(gate_up, s->act, T, s->inter); \
        if (project_##t(&l->down, s->act, T, delta) != 0) \
            return -1; \
    } \
    if (s->final_norm) \
        add_rms_norm_##t(x, n ? delta : 0, s->final_norm, h, T, s->C, s->eps); \
    return 0; \
}

LAYERS(float, f32, 0)
LAYERS(uint16_t, bf16, 1)
