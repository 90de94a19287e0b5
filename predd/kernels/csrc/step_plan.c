/* A step's plan for the attention kernels, from its page tables (predd.attention.page_table.
 * PageTables: qo_indptr, kv_len, indptr, indices): each query row's token, page table
 * and entries seen (plan_rows), the calls the blocks take and the rows left to the row
 * kernel (plan_tiles), the groups of those rows that share a prefix (plan_prefixes), and
 * for the layer loop all of that at once with the new entries' rows in the pool
 * (plan_step). predd/kernels/cpu_kernels.py and predd/attention/backends.py call the first three for the
 * Python loop; predd/kernels/layer_loop.py calls plan_step into buffers it keeps.
 *
 * In numpy this was ~60 small array ops a step. After the step's layers have streamed
 * ~100 MB of weights through the caches, each cost several times its own time
 * (measured: docs/kernels.md, "A step's tables and plans without small numpy ops").
 */
#include <stdint.h>

#include "kernels.h"

/* For calls calls[0 .. n): per query row (in call order, each call's rows in order) its
 * token in the step's flat batch, where its call's page table starts in `indices`, and
 * the entries it sees (row j of a chunk of q after kv - q entries sees kv - q + j + 1);
 * call_rows[i]: the rows of calls[i]. Returns the rows written; *most, the most any sees. */
int64_t plan_rows(const int32_t *qo_indptr, const int32_t *kv_len, const int32_t *indptr,
                  const int64_t *calls, int64_t n, int64_t *row_token, int64_t *row_pages,
                  int64_t *row_visible, int64_t *call_rows, int64_t *most)
{
    int64_t r = 0, seen = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t c = calls[i];
        const int64_t q = qo_indptr[c + 1] - qo_indptr[c], past = kv_len[c] - q;
        call_rows[i] = q;
        for (int64_t j = 0; j < q; j++, r++) {
            row_token[r] = qo_indptr[c] + j;
            row_pages[r] = indptr[c];
            row_visible[r] = past + j + 1;
        }
        if (q && past + q > seen)
            seen = past + q;
    }
    *most = seen;
    return r;
}

/* The calls (call_rows[i] rows each, in row order) of `limit` rows or more, for the
 * blocks: their first rows (call_row) and row counts (chunk_rows); the other rows'
 * token, pages and visible into rest_* (*rest of them). Returns how many calls the
 * blocks take; none (0): nothing written. */
int64_t plan_tiles(const int64_t *call_rows, int64_t calls, int64_t limit,
                   const int64_t *row_token, const int64_t *row_pages,
                   const int64_t *row_visible, int64_t *call_row, int64_t *chunk_rows,
                   int64_t *rest_token, int64_t *rest_pages, int64_t *rest_visible,
                   int64_t *rest)
{
    int64_t big = 0;
    for (int64_t i = 0; i < calls; i++)
        big += call_rows[i] >= limit;
    if (!big)
        return 0;
    int64_t first = 0, k = 0, left = 0;
    for (int64_t i = 0; i < calls; first += call_rows[i], i++) {
        if (call_rows[i] >= limit) {
            call_row[k] = first;
            chunk_rows[k++] = call_rows[i];
            continue;
        }
        for (int64_t r = first; r < first + call_rows[i]; r++, left++) {
            rest_token[left] = row_token[r];
            rest_pages[left] = row_pages[r];
            rest_visible[left] = row_visible[r];
        }
    }
    *rest = left;
    return big;
}

/* The groups of n rows (the row kernel's) that attend to a shared prefix first: rows
 * whose page tables begin with the same page, each seeing `min_pages` whole pages or more
 * before its last entry, `min_rows` rows or more to a group; a group's prefix is the
 * pages all its rows' tables hold alike (up to the fewest whole pages of any), kept where
 * that is `min_pages` or more. Groups by first page, ascending; a group's rows in row
 * order. index: the groups' rows one group after another; row[g], rows[g]: group g's
 * first place in index and its rows; pages[g]: its prefix's pages; start[r]: the
 * entries row r's prefix holds (0: in no group). `order` holds n scratch values.
 * Returns the groups. */
int64_t plan_prefixes(const int32_t *indices, const int64_t *row_pages,
                      const int64_t *row_visible, int64_t n, int64_t page_size,
                      int64_t min_pages, int64_t min_rows, int64_t *index, int64_t *row,
                      int64_t *rows, int64_t *pages, int64_t *start, int64_t *order)
{
    int64_t m = 0;
    for (int64_t r = 0; r < n; r++) {
        start[r] = 0;
        if ((row_visible[r] - 1) / page_size < min_pages)
            continue;
        /* insertion by first page, after the rows of an equal one: a stable sort */
        const int32_t first = indices[row_pages[r]];
        int64_t at = m++;
        for (; at > 0 && indices[row_pages[order[at - 1]]] > first; at--)
            order[at] = order[at - 1];
        order[at] = r;
    }
    int64_t groups = 0, placed = 0;
    for (int64_t a = 0, b; a < m; a = b) {
        const int32_t first = indices[row_pages[order[a]]];
        int64_t most = INT64_MAX;
        for (b = a; b < m && indices[row_pages[order[b]]] == first; b++) {
            const int64_t whole = (row_visible[order[b]] - 1) / page_size;
            most = whole < most ? whole : most;
        }
        if (b - a < min_rows)
            continue;
        int64_t same = 0;                     /* pages every member's table holds alike */
        const int32_t *lead = indices + row_pages[order[a]];
        for (; same < most; same++) {
            int64_t i = a + 1;
            while (i < b && indices[row_pages[order[i]] + same] == lead[same])
                i++;
            if (i < b)
                break;
        }
        if (same < min_pages)
            continue;
        row[groups] = placed;
        rows[groups] = b - a;
        pages[groups++] = same;
        for (int64_t i = a; i < b; i++) {
            index[placed++] = order[i];
            start[order[i]] = same * page_size;
        }
    }
    return groups;
}

/* A layer loop step's plan, every call's rows (plan_rows), into work[k * cap ..] for
 * k: 0-2 row token, pages, visible; 3 the rows of the new entries' K in a layer of the
 * pool ([pages, 2, page_size, ...] as rows: page * 2 page_size + offset, what
 * PagedKVCache.rows makes of PageTables.new_slots); 4 rows per call; 5, 6 the blocks'
 * calls (plan_tiles, where tile_rows > 0), 7-9 the rest's rows; 10-14 the shared
 * prefixes (plan_prefixes, where min_rows > 0) of the rest where the blocks take calls,
 * else of every row; 15 scratch. out: [max visible, the blocks' calls, rest rows,
 * prefix groups]. cap: at least the step's rows and calls. */
void plan_step(int64_t B, const int32_t *qo_indptr, const int32_t *kv_len,
               const int32_t *indptr, const int32_t *indices, int64_t page_size,
               int64_t tile_rows, int64_t min_pages, int64_t min_rows, int64_t *work,
               int64_t cap, int64_t *out)
{
    int64_t *w[16];
    for (int k = 0; k < 16; k++)
        w[k] = work + k * cap;
    for (int64_t c = 0; c < B; c++)
        w[15][c] = c;
    int64_t most;
    const int64_t T = plan_rows(qo_indptr, kv_len, indptr, w[15], B, w[0], w[1], w[2], w[4],
                                &most);
    for (int64_t r = 0; r < T; r++) {
        const int64_t e = w[2][r] - 1;        /* the entry row r writes: its last seen */
        w[3][r] = (int64_t)indices[w[1][r] + e / page_size] * 2 * page_size + e % page_size;
    }
    int64_t rest = 0;
    const int64_t calls = tile_rows > 0 ? plan_tiles(w[4], B, tile_rows, w[0], w[1], w[2],
                                                     w[5], w[6], w[7], w[8], w[9], &rest)
                                        : 0;
    const int64_t n = calls ? rest : T;
    const int64_t groups = min_rows > 0 && n >= 2
        ? plan_prefixes(indices, calls ? w[8] : w[1], calls ? w[9] : w[2], n, page_size,
                        min_pages, min_rows, w[10], w[11], w[12], w[13], w[14], w[15])
        : 0;
    out[0] = most;
    out[1] = calls;
    out[2] = rest;
    out[3] = groups;
}
