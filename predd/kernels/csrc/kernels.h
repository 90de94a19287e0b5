/* Every function predd's CPU kernel library exports, and the structs the layer loop
 * takes: declared once, here, and included by every .c file of the library (so the
 * compiler checks each definition and each call against one declaration). The Python
 * side binds them in one table (predd/kernels/bindings.py) and compares its ctypes
 * structs and kind codes with `kernel_layout` at load: a mismatch refuses the kernels,
 * saying why. Functions the kernels share among themselves alone are declared in the
 * headers of those files (amx.h, quant_blocks.h); the other headers hold inline code.
 *
 * Tensors are passed as pointers to contiguous rows; `t` suffixes name the element type:
 * f32 float, bf16 uint16_t (bfloat16 bits). Shapes are in each definition's comment. */
#ifndef PREDD_KERNELS_H
#define PREDD_KERNELS_H
#include <stdint.h>

/* ---- a layer's small ops (layer_ops.c) */
void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out,
                      int64_t rows, int64_t n, float eps);
void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t n, float eps);
void rope_f32(float *x, int64_t stride, const float *cos, const float *sin, int64_t rows,
              int64_t heads, int64_t d);
void rope_bf16(uint16_t *x, int64_t stride, const float *cos, const float *sin,
               int64_t rows, int64_t heads, int64_t d);
void silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t n);
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t n);

/* ---- attention over the paged pool (paged_attention.c: the row kernel, the K/V store;
 * attention_tiles.c: blocks of 16 query vectors) */
#define PREDD_ATTENTION_ARGS const void *q, int64_t q_stride, void *out, const void *kv, \
    int64_t page_size, int64_t kv_heads, int64_t heads, int64_t head_dim,                \
    const int32_t *indices, const int64_t *row_token, const int64_t *row_pages,          \
    const int64_t *row_visible, int64_t rows, int64_t max_visible, float scale,          \
    int64_t span, const int64_t *row_start, const float *prior
int paged_attention_f32(PREDD_ATTENTION_ARGS);
int paged_attention_bf16(PREDD_ATTENTION_ARGS);
/* float32 q and out over a bfloat16 pool (a float32 model's `--kv-dtype bfloat16`) */
int paged_attention_f32_kvbf16(PREDD_ATTENTION_ARGS);
void store_entries(void *kv, const int64_t *rows, int64_t n, const void *k, const void *v,
                   int64_t src_stride, int64_t entry, int64_t page_size);
void store_entries_bf16(void *kv, const int64_t *rows, int64_t n, const void *k,
                        const void *v, int64_t src_stride, int64_t entry, int64_t page_size);
int attention_tiles_bf16(int use);
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

/* ---- projections from a GGUF's blocks (quant_linear.c: exact float32 weights and bf16
 * dot products; quant_tiles.c: AMX tiles; quant_lanes.c: Q4_1 in lanes; quant_int8.c:
 * int8 dot products) */
void linear_q4_1_f32(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *d,
                     const float *m, int64_t N, const float *bias, float *y);
void linear_q8_0_f32(const float *x, int64_t M, int64_t K, const int8_t *q, const float *d,
                     int64_t N, const float *bias, float *y);
void linear_q4_1_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *q,
                      const float *d, const float *m, int64_t N, const float *bias, uint16_t *y);
void linear_q8_0_bf16(const uint16_t *x, int64_t M, int64_t K, const int8_t *q,
                      const float *d, int64_t N, const float *bias, uint16_t *y);
int linear_q8_0_bf16_f32(const uint16_t *x, int64_t M, int64_t K, const int8_t *q,
                         const float *d, int64_t N, const float *bias, float *y);
int linear_bf16_dots(void);
void linear_q4_1_lanes_bf16(const uint16_t *x, int64_t M, int64_t K, const uint32_t *q,
                            const float *d, const float *m, int64_t N, const float *bias,
                            uint16_t *y);
/* 1 where linear_tiles_bf16 multiplies 2 rows or more (-1: asks only; 0/1 turns off/on) */
int linear_bf16_tiles(int use);
int linear_int8_vector(void);
/* the int8 kernels' d and m: IEEE half floats, as the GGUF stores them */
int linear_q4_1_int8(const float *x, int64_t M, int64_t K, const uint8_t *q,
                     const uint16_t *d, const uint16_t *m, int64_t N, const float *bias,
                     float *y);
int linear_q8_0_int8(const float *x, int64_t M, int64_t K, const int8_t *q,
                     const uint16_t *d, int64_t N, const float *bias, float *y);

/* ---- the greedy and sampled picks (greedy.c) */
void greedy_pick_f32(const int64_t *rows, int64_t n, int64_t v, int64_t *tokens,
                     float *logprobs);
void sample_pick_f32(const int64_t *rows, int64_t n, int64_t v, const double *temps,
                     const double *draws, int64_t *tokens, float *logprobs);

/* ---- a step's plan (step_plan.c) */
int64_t plan_rows(const int32_t *qo_indptr, const int32_t *kv_len, const int32_t *indptr,
                  const int64_t *calls, int64_t n, int64_t *row_token, int64_t *row_pages,
                  int64_t *row_visible, int64_t *call_rows, int64_t *most);
int64_t plan_tiles(const int64_t *call_rows, int64_t calls, int64_t limit,
                   const int64_t *row_token, const int64_t *row_pages,
                   const int64_t *row_visible, int64_t *call_row, int64_t *chunk_rows,
                   int64_t *rest_token, int64_t *rest_pages, int64_t *rest_visible,
                   int64_t *rest);
int64_t plan_prefixes(const int32_t *indices, const int64_t *row_pages,
                      const int64_t *row_visible, int64_t n, int64_t page_size,
                      int64_t min_pages, int64_t min_rows, int64_t *index, int64_t *row,
                      int64_t *rows, int64_t *pages, int64_t *start, int64_t *order);
void plan_step(int64_t B, const int32_t *qo_indptr, const int32_t *kv_len,
               const int32_t *indptr, const int32_t *indices, int64_t page_size,
               int64_t tile_rows, int64_t min_pages, int64_t min_rows, int64_t *work,
               int64_t cap, int64_t *out);

/* ---- a step's layers in one call (layer_loop.c) */

/* Shared prefixes (predd.kernels.cpu_kernels.SharedPrefixes) of a set of rows of the row
 * kernel: `groups` groups (none: 0), each row's start, the prior they fill. */
struct prefixes {
    const int64_t *index, *row, *rows, *pages;
    int64_t groups;
    const int64_t *start;
    float *prior;
};

/* A projection's blocks (predd.model.loader.QuantBlocks): kind 4 Q4_1, 8 Q8_0,
 * PREDD_LANES Q4_1 in lanes (quant_lanes.c: bfloat16 only), 4 + PREDD_INT8 and
 * 8 + PREDD_INT8 by int8 dot products (quant_int8.c: float32 only); [n, k]. d and m
 * float32, half floats for the int8 kinds. */
#define PREDD_LANES 5
#define PREDD_INT8 16
struct projection {
    int64_t kind, k, n;
    const uint8_t *q;
    const void *d, *m;
    const float *bias;
};

/* One decoder layer's weights (the norms' in the model's dtype) and its part of the pool */
struct layer {
    const void *input_norm, *post_norm;
    struct projection qkv, o, gate_up, down;
    void *kv;
};

/* A step's rows and where each op writes: x, delta, h [T, C]; qkv [T, (H + 2 KV) D];
 * attn [T, H D]; gate_up [T, 2 I]; act [T, I]. Attention as bind_attention plans it
 * (predd/kernels/cpu_kernels.py): the tiles (bf16) for `calls` calls (none: 0) and the
 * row kernel for the `rest` rows beside them, or for all T rows (every call is on these
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

int run_layers_f32(const struct layer *layers, int64_t n, const struct step *s);
int run_layers_bf16(const struct layer *layers, int64_t n, const struct step *s);
int run_layers_f32_kvbf16(const struct layer *layers, int64_t n, const struct step *s);

/* The structs above as this build lays them out, for the bindings to compare with their
 * own: out[0] the count of values written, then for prefixes, projection, layer and step
 * in turn its size and each field's offset in declaration order (the structs nested in
 * layer and step as one field each), then PREDD_LANES and PREDD_INT8. Writes at most
 * `cap` values after out[0]. */
int64_t kernel_layout(int64_t *out, int64_t cap);

#endif
