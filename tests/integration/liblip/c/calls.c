/* Every call of liblip for C once, for tests/integration/liblip/test_c_client.py:
 *     calls TEXT FILE.kv
 * prints: TEXT's ids; the argmax after them (pred) and predd's greedy token
 * (pred_sample) on a new cache; that cache's entries; FILE's entries; the errno name a
 * pred on the freed cache gets; whether FILE is gone after kv_remove; the ids' text. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "liblip.h"

#define MAX_IDS 4096

static lip_client *c;

static void ok(int rc, const char *what) {
    if (rc < 0) {
        fprintf(stderr, "calls: %s: %s\n", what, lip_error(c));
        exit(1);
    }
}

static void print_ids(const int32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++)
        printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    static int32_t ids[MAX_IDS], entries[MAX_IDS];
    size_t n, m, vocab;
    ok(lip_connect(&c, NULL), "connect");
    ok(lip_vocab_size(c, &vocab), "info");
    ok(lip_tokenize(c, argv[1], ids, MAX_IDS, &n), "tokenize");
    print_ids(ids, n);

    lip_kv kv, file;
    ok(lip_kv_create(c, &kv), "kv_create");
    float *logits = malloc(vocab * sizeof *logits);
    ok(lip_pred(c, &kv, ids, n, logits, vocab), "pred");
    int32_t best = 0, token;
    for (size_t v = 1; v < vocab; v++)
        if (logits[v] > logits[best])
            best = (int32_t)v;
    lip_sample greedy = LIP_GREEDY;
    ok(lip_pred_sample(c, &kv, &best, 1, &greedy, &token, NULL), "pred_sample");
    printf("%d %d\n", best, token);
    ok(lip_kv_tokens(c, &kv, entries, MAX_IDS, &m), "kv_tokens");
    print_ids(entries, m);
    ok(lip_kv_close(c, &kv), "kv_close");

    ok(lip_kv_open(c, argv[2], 1, &file), "kv_open");
    ok(lip_kv_tokens(c, &file, entries, MAX_IDS, &m), "kv_tokens");
    print_ids(entries, m);
    int rc = lip_pred(c, &kv, ids, 1, logits, vocab);   /* kv was freed */
    printf("%d %.*s\n", rc == -EBADF, (int)strcspn(lip_error(c), ":"), lip_error(c));
    ok(lip_kv_remove(c, &file, argv[2]), "kv_remove");
    printf("%s\n", access(argv[2], F_OK) ? "removed" : "still there");

    char text[8192];
    ok(lip_detokenize(c, ids, n, text, sizeof text), "detokenize");
    printf("%s\n", text);
    free(logits);
    lip_disconnect(c);
    return 0;
}
