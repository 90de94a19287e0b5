/* Greedy decoding in C over a cache file of the kvfs mount, three ways:
 *
 *     lip-greedy FILE.kv N
 *
 * forks the file's cache three times and decodes N tokens after it on each fork: a
 * `pred` loop taking the argmax of the logits here, a `pred_sample` loop (predd samples,
 * temperature 0), and predd's own `generate`. Prints each way's ids on a line, then the
 * text; exits 1 with liblip's "ERRNO: message" if anything fails. */
#include <stdio.h>
#include <stdlib.h>

#include "liblip.h"

static int check(lip_client *c, int rc, const char *what) {
    if (rc < 0) {
        fprintf(stderr, "lip-greedy: %s: %s\n", what, lip_error(c));
        exit(1);
    }
    return rc;
}

static void print_ids(const int32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++)
        printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
}

int main(int argc, char **argv) {
    if (argc != 3 || atoi(argv[2]) < 1) {
        fprintf(stderr, "usage: lip-greedy FILE.kv N\n");
        return 2;
    }
    size_t n = (size_t)atoi(argv[2]), vocab;
    lip_client *c;
    lip_kv file, fork;
    if (lip_connect(&c, NULL) < 0) {
        fprintf(stderr, "lip-greedy: connect: %s\n", c ? lip_error(c) : "out of memory");
        lip_disconnect(c);
        return 1;
    }
    check(c, lip_vocab_size(c, &vocab), "info");
    check(c, lip_kv_open(c, argv[1], 0, &file), "open");
    float *logits = malloc(vocab * sizeof *logits);
    int32_t *ids = malloc(n * sizeof *ids);
    size_t got;
    char finish[16], text[8192];

    check(c, lip_kv_fork(c, &file, &fork), "fork");      /* pred: the argmax here */
    for (size_t i = 0; i < n; i++) {
        check(c, lip_pred(c, &fork, ids + i - (i > 0), i > 0, logits, vocab), "pred");
        size_t best = 0;
        for (size_t v = 1; v < vocab; v++)
            if (logits[v] > logits[best])
                best = v;
        ids[i] = (int32_t)best;
    }
    print_ids(ids, n);
    check(c, lip_kv_close(c, &fork), "close");

    check(c, lip_kv_fork(c, &file, &fork), "fork");      /* pred_sample: predd picks */
    lip_sample greedy = LIP_GREEDY;
    for (size_t i = 0; i < n; i++)
        check(c, lip_pred_sample(c, &fork, ids + i - (i > 0), i > 0, &greedy, ids + i, NULL),
              "pred_sample");
    print_ids(ids, n);
    check(c, lip_kv_close(c, &fork), "close");

    check(c, lip_kv_fork(c, &file, &fork), "fork");      /* generate: predd's loop */
    check(c, lip_generate(c, &fork, NULL, 0, (int)n, &greedy, 1, ids, n, &got, finish),
          "generate");
    print_ids(ids, got);
    check(c, lip_detokenize(c, ids, got, text, sizeof text), "detokenize");
    printf("%s\n", text);
    check(c, lip_kv_close(c, &fork), "close");
    check(c, lip_kv_close(c, &file), "close");
    free(ids);
    free(logits);
    lip_disconnect(c);
    return 0;
}
