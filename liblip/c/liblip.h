/* liblip for C: the LIP system calls of docs/protocol.md over ZeroMQ and msgpack.
 *
 * A program links -llip (built by `make lib` into build/) and talks to predd as the
 * Python liblip does: one DEALER socket to predd's ROUTER, one msgpack map a request,
 * binary frames after it (raw logits). predd learns who the program is from the
 * kernel (SO_PEERCRED on the ipc socket), never from the program's word.
 *
 * Every call returns 0 or a negative errno (-EBADF, -ENOSPC, ...): predd's errno names
 * mapped to <errno.h>, -EIO for a name this library does not know or when predd is
 * unreachable for LIP_CONNECT_MS, -ETIMEDOUT when predd does not answer within
 * LIP_TIMEOUT_MS. lip_error() gives the last error's
 * "NAME: message" text. A client is not thread-safe: one per thread.
 *
 * A session's lease is predd's --lease (10 s by default): a program idle for longer
 * calls lip_ping() now and then, or its caches go with its session.
 */
#ifndef LIBLIP_H
#define LIBLIP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LIP_TIMEOUT_MS 120000   /* a reply later than this is -ETIMEDOUT */
#define LIP_CONNECT_MS 3000     /* no connection to predd for this long is -EIO */
#define LIP_CAP_LEN 32          /* hex digits of a capability */

typedef struct lip_client lip_client;

/* A KV cache: a capability, and the open file it came from (fd -1 for none). */
typedef struct {
    char cap[LIP_CAP_LEN + 1];
    char rights[3];             /* "r" or "rw" */
    int fd;
} lip_kv;

/* Sampling parameters (docs/protocol.md, pred): temperature 0 is greedy. */
typedef struct {
    double temperature;
    double top_p;               /* 1.0: all */
    int top_k;                  /* 0: all */
    int64_t seed;               /* < 0: none */
} lip_sample;

#define LIP_GREEDY ((lip_sample){0.0, 1.0, 0, -1})

/* Connect to predd at `addr` (NULL: $PREDD_ADDR, else predd.sock in $SYMPHONY_RUNDIR,
 * else /run/symphony/predd.sock where it exists, else the per-user run directory).
 * *out is set even on failure (NULL only when out of memory), for lip_error; free it
 * with lip_disconnect either way. */
int lip_connect(lip_client **out, const char *addr);
void lip_disconnect(lip_client *c);             /* ends the session: its caches go */
const char *lip_error(const lip_client *c);      /* the last error, "" after success */
int lip_ping(lip_client *c);
int lip_vocab_size(lip_client *c, size_t *vocab);

/* Text: at most `cap` ids (-E2BIG when there are more; *n says how many). */
int lip_tokenize(lip_client *c, const char *text, int32_t *ids, size_t cap, size_t *n);
/* The text of `ids`, NUL-terminated, at most `cap` bytes with the NUL (-E2BIG beyond). */
int lip_detokenize(lip_client *c, const int32_t *ids, size_t n, char *text, size_t cap);

/* Caches: a new empty one; the cache file `path` on the kvfs mount (a relative path is
 * under $KVFS_MOUNT, default /mnt/kvfs; `write` asks for a read-write capability); a
 * fork (a new read-write cache sharing its pages); close (an anonymous cache is freed,
 * a file's handle closed); remove (a file unlinked, then closed). */
int lip_kv_create(lip_client *c, lip_kv *kv);
int lip_kv_open(lip_client *c, const char *path, int write, lip_kv *kv);
int lip_kv_fork(lip_client *c, const lip_kv *kv, lip_kv *fork);
int lip_kv_close(lip_client *c, lip_kv *kv);
int lip_kv_remove(lip_client *c, lip_kv *kv, const char *path);
int lip_kv_tokens(lip_client *c, const lip_kv *kv, int32_t *ids, size_t cap, size_t *n);

/* Append `tokens` to `kv` and get the next-token logits after the last of them:
 * `vocab` floats (lip_vocab_size) into `logits`. */
int lip_pred(lip_client *c, const lip_kv *kv, const int32_t *tokens, size_t n,
             float *logits, size_t vocab);
/* Append `tokens`; predd samples the next token. */
int lip_pred_sample(lip_client *c, const lip_kv *kv, const int32_t *tokens, size_t n,
                    const lip_sample *sample, int32_t *token, float *logprob);
/* predd's own loop: up to `max_tokens` tokens after `tokens` into `out` (at most `cap`),
 * stopping at the model's end-of-sequence ids unless `ignore_eos`; the cache keeps every
 * generated token but the last. `finish` (at least 16 bytes, or NULL) gets the reason:
 * "stop", "length", or an errno name. */
int lip_generate(lip_client *c, const lip_kv *kv, const int32_t *tokens, size_t n,
                 int max_tokens, const lip_sample *sample, int ignore_eos,
                 int32_t *out, size_t cap, size_t *n_out, char *finish);

#ifdef __cplusplus
}
#endif
#endif
