/* A step's decoder layers in one call, float32 or bfloat16, for a step that
 * predd/kernels/layer_loop.py found every piece of on these kernels: each projection from
 * its blocks (quant_linear.c, and quant_lanes.c, quant_tiles.c or quant_int8.c by the
 * blocks' kind), the norms, RoPE and SwiGLU (layer_ops.c), the new K/V stored and
 * attention over the pages (paged_attention.c, attention_tiles.c). The same functions,
 * with the same arguments in the same order, as the Python loop of predd/model/llama.py
 * makes them one ctypes call at a time: the same bits out. What this saves is that
 * loop's own time, ~10 calls a layer through Python, ctypes and torch's allocator, while
 * the other threads wait (measured: docs/kernels.md, "A step's layers in one C call").
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* A projection of rows of E (the element type, t its suffix) by its blocks' kernel */
#define PROJECT(E, t, TILES) \
static int project_##t(const struct projection *p, const E *x, int64_t rows, E *y) \
{ \
    if (TILES && p->kind == PREDD_LANES) \
        linear_q4_1_lanes_bf16((const uint16_t *)x, rows, p->k, (const uint32_t *)p->q, \
                               p->d, p->m, p->n, p->bias, (uint16_t *)y); \
    else if (!TILES && p->kind == 4 + PREDD_INT8) \
        return linear_q4_1_int8((const float *)x, rows, p->k, p->q, p->d, p->m, p->n, \
                                p->bias, (float *)y); \
    else if (!TILES && p->kind == 8 + PREDD_INT8) \
        return linear_q8_0_int8((const float *)x, rows, p->k, (const int8_t *)p->q, p->d, \
                                p->n, p->bias, (float *)y); \
    else if (p->kind == 4) \
        linear_q4_1_##t(x, rows, p->k, p->q, p->d, p->m, p->n, p->bias, y); \
    else if (p->kind == 8) \
        linear_q8_0_##t(x, rows, p->k, (const int8_t *)p->q, p->d, p->n, p->bias, y); \
    else \
        return -1;            /* a kind this dtype has no kernel for: never computed */ \
    return 0; \
}

/* The layer loop once per dtype of the rows (E, projections by project_##t) and of the
 * pool (K, its attention paged_attention_##a, its store STORE): run_layers_##a. Layers
 * 0 .. n - 1 of a step: x takes each block's output in place, delta holds the last one's;
 * with `final_norm`, x takes that too and h is the model's final norm of every row (what
 * predd.model.llama.LlamaModel.head computes of the rows it wants: one kernel call less from
 * Python, whose few ops after the layers cost several times what they cost alone). 0, or
 * -1 where attention or an int8 projection could not allocate its scratch (ENOMEM; x
 * is then half-way). */
#define LOOP(E, t, TILES, a, K, STORE) \
static int rows_##a(const struct step *s, const void *kv, const int64_t *token, \
                    const int64_t *pages, const int64_t *visible, int64_t n, int64_t span, \
                    const struct prefixes *p) \
{ \
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->head_dim; \
    const int shared = TILES && p->groups && shared_prefix_tiles_bf16( \
        s->qkv, width, kv, s->page_size, s->kv_heads, s->heads, s->head_dim, s->indices, \
        token, pages, p->index, p->row, p->rows, p->pages, p->groups, s->scale, \
        p->prior) == 0; \
    return paged_attention_##a(s->qkv, width, s->attn, kv, s->page_size, s->kv_heads, \
                               s->heads, s->head_dim, s->indices, token, pages, visible, n, \
                               s->max_visible, s->scale, span, shared ? p->start : 0, \
                               p->prior); \
} \
\
static int attend_##a(const struct step *s, const void *kv) \
{ \
    const int64_t width = (s->heads + 2 * s->kv_heads) * s->head_dim; \
    if (TILES && s->calls && paged_attention_tiles_bf16( \
            s->qkv, width, s->attn, kv, s->page_size, s->kv_heads, s->heads, s->head_dim, \
            s->indices, s->row_token, s->row_pages, s->row_visible, s->call_row, \
            s->call_rows, s->calls, s->max_visible, s->scale) == 0) \
        return s->rest ? rows_##a(s, kv, s->rest_token, s->rest_pages, s->rest_visible, \
                                  s->rest, s->span_rest, &s->shared_rest) : 0; \
    return rows_##a(s, kv, s->row_token, s->row_pages, s->row_visible, s->T, s->span_rows, \
                    &s->shared_rows); \
} \
\
int run_layers_##a(const struct layer *layers, int64_t n, const struct step *s) \
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
        STORE(l->kv, s->store_rows, T, qkv + H * D, qkv + (H + KV) * D, \
              width * (int64_t)sizeof(E), KV * D * (int64_t)sizeof(K), s->page_size); \
        if (attend_##a(s, l->kv) != 0) \
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

PROJECT(float, f32, 0)
PROJECT(uint16_t, bf16, 1)
LOOP(float, f32, 0, f32, float, store_entries)
LOOP(uint16_t, bf16, 1, bf16, uint16_t, store_entries)
LOOP(float, f32, 0, f32_kvbf16, uint16_t, store_entries_bf16)

/* (kernels.h) */
int64_t kernel_layout(int64_t *out, int64_t cap)
{
    const int64_t values[] = {
#define AT(s, f) (int64_t)offsetof(struct s, f)
        sizeof(struct prefixes), AT(prefixes, index), AT(prefixes, row), AT(prefixes, rows),
        AT(prefixes, pages), AT(prefixes, groups), AT(prefixes, start), AT(prefixes, prior),
        sizeof(struct projection), AT(projection, kind), AT(projection, k), AT(projection, n),
        AT(projection, q), AT(projection, d), AT(projection, m), AT(projection, bias),
        sizeof(struct layer), AT(layer, input_norm), AT(layer, post_norm), AT(layer, qkv),
        AT(layer, o), AT(layer, gate_up), AT(layer, down), AT(layer, kv),
        sizeof(struct step), AT(step, T), AT(step, C), AT(step, heads), AT(step, kv_heads),
        AT(step, head_dim), AT(step, inter), AT(step, page_size), AT(step, eps),
        AT(step, scale), AT(step, x), AT(step, delta), AT(step, h), AT(step, qkv),
        AT(step, attn), AT(step, gate_up), AT(step, act), AT(step, cos), AT(step, sin),
        AT(step, store_rows), AT(step, indices), AT(step, row_token), AT(step, row_pages),
        AT(step, row_visible), AT(step, max_visible), AT(step, call_row), AT(step, call_rows),
        AT(step, calls), AT(step, rest_token), AT(step, rest_pages), AT(step, rest_visible),
        AT(step, rest), AT(step, span_rows), AT(step, span_rest), AT(step, shared_rows),
        AT(step, shared_rest), AT(step, final_norm),
        PREDD_LANES, PREDD_INT8,
#undef AT
    };
    const int64_t n = (int64_t)(sizeof values / sizeof values[0]);
    for (int64_t i = 0; i < n && i < cap; i++)
        out[i + 1] = values[i];
    out[0] = n;
    return n;
}
