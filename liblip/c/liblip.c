/* liblip for C (liblip.h): requests as msgpack maps on a ZeroMQ DEALER socket, replies
 * read back by `rid`. The wire format is docs/protocol.md's: frame 0 a map
 * {op, rid, fields...}; a reply {rid, ok, fields...} or {rid, ok: false, error: {code,
 * message}}; raw logits as one frame of float32 after the map. */
#include "liblip.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#define DESCRIPTOR_MAX 4096      /* a .kv file's descriptor (symphony_protocol/descriptor.py) */

struct lip_client {
    void *ctx, *sock;
    uint64_t rid;
    char error[512];
    /* the last reply: its map (its strings point into `head`, kept until the next
       request) and its first binary frame */
    msgpack_unpacked reply;
    zmq_msg_t head, frame;
    int has_head, has_frame;
    char addr[1024];
};

/* ------------------------------------------------------------------ errors */

static const struct { const char *name; int code; } ERRNOS[] = {
    {"EPERM", EPERM}, {"ENOENT", ENOENT}, {"ESRCH", ESRCH}, {"EIO", EIO},
    {"E2BIG", E2BIG}, {"EBADF", EBADF}, {"EAGAIN", EAGAIN}, {"ENOMEM", ENOMEM},
    {"EACCES", EACCES}, {"EBUSY", EBUSY}, {"EEXIST", EEXIST}, {"EINVAL", EINVAL},
    {"EMFILE", EMFILE}, {"ENOSPC", ENOSPC}, {"ENOSYS", ENOSYS},
    {"ENAMETOOLONG", ENAMETOOLONG}, {"EBADMSG", EBADMSG}, {"EOVERFLOW", EOVERFLOW},
    {"EDQUOT", EDQUOT}, {"ETIMEDOUT", ETIMEDOUT}, {"ECANCELED", ECANCELED},
    {"ENOTDIR", ENOTDIR}, {"EISDIR", EISDIR},
};

static int fail(lip_client *c, int code, const char *fmt, ...) {
    const char *name = "EIO";
    for (size_t i = 0; i < sizeof ERRNOS / sizeof ERRNOS[0]; i++)
        if (ERRNOS[i].code == code)
            name = ERRNOS[i].name;
    int at = snprintf(c->error, sizeof c->error, "%s: ", name);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->error + at, sizeof c->error - (size_t)at, fmt, ap);
    va_end(ap);
    return -code;
}

static int errno_of(const char *name, size_t len) {
    for (size_t i = 0; i < sizeof ERRNOS / sizeof ERRNOS[0]; i++)
        if (strlen(ERRNOS[i].name) == len && !memcmp(ERRNOS[i].name, name, len))
            return ERRNOS[i].code;
    return EIO;
}

const char *lip_error(const lip_client *c) { return c->error; }

/* ------------------------------------------------------------------ msgpack */

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static void pack_ids(msgpack_packer *pk, const int32_t *ids, size_t n) {
    msgpack_pack_array(pk, n);
    for (size_t i = 0; i < n; i++)
        msgpack_pack_int32(pk, ids[i]);
}

static void pack_sample(msgpack_packer *pk, const lip_sample *s) {
    msgpack_pack_map(pk, s->seed >= 0 ? 4 : 3);
    pack_str(pk, "temperature"); msgpack_pack_double(pk, s->temperature);
    pack_str(pk, "top_p"); msgpack_pack_double(pk, s->top_p);
    pack_str(pk, "top_k"); msgpack_pack_int(pk, s->top_k);
    if (s->seed >= 0) { pack_str(pk, "seed"); msgpack_pack_int64(pk, s->seed); }
}

/* A request's map: {op, rid} and `fields` more keys, which the caller packs next. */
static void begin(lip_client *c, msgpack_packer *pk, const char *op, size_t fields) {
    msgpack_pack_map(pk, 2 + fields);
    pack_str(pk, "op"); pack_str(pk, op);
    pack_str(pk, "rid"); msgpack_pack_uint64(pk, ++c->rid);
}

static const msgpack_object *get(const msgpack_object *map, const char *key) {
    if (map == NULL || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t n = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n
            && !memcmp(k->via.str.ptr, key, n))
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

static int as_int(const msgpack_object *o, int64_t *out) {
    if (o == NULL)
        return 0;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) { *out = (int64_t)o->via.u64; return 1; }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) { *out = o->via.i64; return 1; }
    return 0;
}

static int as_double(const msgpack_object *o, double *out) {
    int64_t i;
    if (o != NULL && (o->type == MSGPACK_OBJECT_FLOAT64 || o->type == MSGPACK_OBJECT_FLOAT32)) {
        *out = o->via.f64;
        return 1;
    }
    if (as_int(o, &i)) { *out = (double)i; return 1; }
    return 0;
}

/* Copy a reply's string (NUL-terminated, at most cap bytes with the NUL). */
static int copy_str(lip_client *c, const msgpack_object *o, char *out, size_t cap,
                    const char *what) {
    if (o == NULL || o->type != MSGPACK_OBJECT_STR)
        return fail(c, EBADMSG, "reply without %s", what);
    if (o->via.str.size + 1 > cap)
        return fail(c, E2BIG, "%s of %u bytes, room for %zu", what, o->via.str.size, cap);
    memcpy(out, o->via.str.ptr, o->via.str.size);
    out[o->via.str.size] = '\0';
    return 0;
}

static int copy_ids(lip_client *c, const msgpack_object *o, int32_t *ids, size_t cap,
                    size_t *n, const char *what) {
    if (o == NULL || o->type != MSGPACK_OBJECT_ARRAY)
        return fail(c, EBADMSG, "reply without %s", what);
    *n = o->via.array.size;
    if (*n > cap)
        return fail(c, E2BIG, "%zu %s, room for %zu", *n, what, cap);
    for (size_t i = 0; i < *n; i++) {
        int64_t v;
        if (!as_int(&o->via.array.ptr[i], &v))
            return fail(c, EBADMSG, "%s: not an integer", what);
        ids[i] = (int32_t)v;
    }
    return 0;
}

/* ------------------------------------------------------------------ the wire */

static void drop_reply(lip_client *c) {
    msgpack_unpacked_destroy(&c->reply);
    msgpack_unpacked_init(&c->reply);
    if (c->has_head) {
        zmq_msg_close(&c->head);
        c->has_head = 0;
    }
    if (c->has_frame) {
        zmq_msg_close(&c->frame);
        c->has_frame = 0;
    }
}

/* Send the packed request and wait for the reply to it (its map in c->reply, its first
 * binary frame in c->frame); 0, or the reply's errno. */
static int exchange(lip_client *c, msgpack_sbuffer *buf) {
    uint64_t rid = c->rid;
    drop_reply(c);
    c->error[0] = '\0';
    int sent = zmq_send(c->sock, buf->data, buf->size, 0);
    msgpack_sbuffer_destroy(buf);
    if (sent < 0 && zmq_errno() == EAGAIN)
        return fail(c, EIO, "predd at %s unreachable for %d ms", c->addr, LIP_CONNECT_MS);
    if (sent < 0)
        return fail(c, EIO, "send to predd: %s", zmq_strerror(zmq_errno()));
    for (;;) {
        zmq_pollitem_t item = {c->sock, 0, ZMQ_POLLIN, 0};
        int ready = zmq_poll(&item, 1, LIP_TIMEOUT_MS);
        if (ready < 0 && zmq_errno() == EINTR)
            continue;
        if (ready <= 0)
            return fail(c, ETIMEDOUT, "no reply from predd in %d ms", LIP_TIMEOUT_MS);
        drop_reply(c);
        zmq_msg_init(&c->head);
        c->has_head = 1;
        if (zmq_msg_recv(&c->head, c->sock, 0) < 0)
            return fail(c, EIO, "receive from predd: %s", zmq_strerror(zmq_errno()));
        int more = zmq_msg_more(&c->head);
        if (more) {                          /* the first binary frame; others dropped */
            zmq_msg_init(&c->frame);
            zmq_msg_recv(&c->frame, c->sock, 0);
            c->has_frame = 1;
            while (zmq_msg_more(&c->frame)) {
                zmq_msg_t rest;
                zmq_msg_init(&rest);
                zmq_msg_recv(&rest, c->sock, 0);
                int again = zmq_msg_more(&rest);
                zmq_msg_close(&rest);
                if (!again)
                    break;
            }
        }
        msgpack_unpack_return r = msgpack_unpack_next(
            &c->reply, zmq_msg_data(&c->head), zmq_msg_size(&c->head), NULL);
        int64_t got;
        if (r != MSGPACK_UNPACK_SUCCESS || !as_int(get(&c->reply.data, "rid"), &got)) {
            drop_reply(c);
            return fail(c, EBADMSG, "a reply that is not a msgpack map with a rid");
        }
        const msgpack_object *more_obj = get(&c->reply.data, "more");
        if ((uint64_t)got != rid || (more_obj && more_obj->type == MSGPACK_OBJECT_BOOLEAN
                                     && more_obj->via.boolean)) {
            drop_reply(c);                   /* an earlier, abandoned request's */
            continue;
        }
        const msgpack_object *ok = get(&c->reply.data, "ok");
        if (ok != NULL && ok->type == MSGPACK_OBJECT_BOOLEAN && ok->via.boolean)
            return 0;
        const msgpack_object *error = get(&c->reply.data, "error");
        const msgpack_object *code = get(error, "code"), *message = get(error, "message");
        if (code == NULL || code->type != MSGPACK_OBJECT_STR)
            return fail(c, EBADMSG, "an error reply without a code");
        int err = errno_of(code->via.str.ptr, code->via.str.size);
        snprintf(c->error, sizeof c->error, "%.*s: %.*s", (int)code->via.str.size,
                 code->via.str.ptr,
                 message && message->type == MSGPACK_OBJECT_STR ? (int)message->via.str.size : 0,
                 message && message->type == MSGPACK_OBJECT_STR ? message->via.str.ptr : "");
        return -err;
    }
}

#define REQUEST(c, op, fields)                                   \
    msgpack_sbuffer buf;                                         \
    msgpack_packer pk;                                           \
    msgpack_sbuffer_init(&buf);                                  \
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);       \
    begin((c), &pk, (op), (fields))

/* ------------------------------------------------------------------ sessions */

static void default_addr(char *out, size_t cap) {
    const char *env = getenv("PREDD_ADDR"), *rundir = getenv("SYMPHONY_RUNDIR");
    struct stat st;
    if (env && *env)
        snprintf(out, cap, "%s", env);
    else if (rundir && *rundir)
        snprintf(out, cap, "ipc://%s/predd.sock", rundir);
    else if (stat("/run/symphony/predd.sock", &st) == 0)
        snprintf(out, cap, "ipc:///run/symphony/predd.sock");
    else if (geteuid() == 0)
        snprintf(out, cap, "ipc:///run/symphony/predd.sock");
    else {
        const char *xdg = getenv("XDG_RUNTIME_DIR");
        snprintf(out, cap, "ipc://%s/symphony-%u/predd.sock", xdg && *xdg ? xdg : "/tmp",
                 (unsigned)geteuid());
    }
}

int lip_connect(lip_client **out, const char *addr) {
    *out = NULL;
    lip_client *c = calloc(1, sizeof *c);
    if (c == NULL)
        return -ENOMEM;
    msgpack_unpacked_init(&c->reply);
    *out = c;
    char *where = c->addr;
    if (addr == NULL)
        default_addr(where, sizeof c->addr);
    else
        snprintf(where, sizeof c->addr, "%s", addr);
    c->ctx = zmq_ctx_new();
    c->sock = c->ctx ? zmq_socket(c->ctx, ZMQ_DEALER) : NULL;
    /* a request waits for a connection (immediate), at most LIP_CONNECT_MS */
    int linger = 0, immediate = 1, wait_ms = LIP_CONNECT_MS;
    if (c->sock == NULL || zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger)
        || zmq_setsockopt(c->sock, ZMQ_IMMEDIATE, &immediate, sizeof immediate)
        || zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &wait_ms, sizeof wait_ms)
        || zmq_connect(c->sock, where)) {
        return fail(c, EINVAL, "cannot connect to %s: %s", where, zmq_strerror(zmq_errno()));
    }
    REQUEST(c, "hello", 3);
    pack_str(&pk, "client"); pack_str(&pk, "liblip-c");
    pack_str(&pk, "pid"); msgpack_pack_int64(&pk, getpid());
    pack_str(&pk, "lease_s"); msgpack_pack_double(&pk, 10.0);
    return exchange(c, &buf);
}

void lip_disconnect(lip_client *c) {
    if (c == NULL)
        return;
    if (c->sock) {
        REQUEST(c, "bye", 0);
        zmq_send(c->sock, buf.data, buf.size, ZMQ_DONTWAIT);
        msgpack_sbuffer_destroy(&buf);
        zmq_close(c->sock);
    }
    if (c->ctx)
        zmq_ctx_term(c->ctx);
    drop_reply(c);
    msgpack_unpacked_destroy(&c->reply);
    free(c);
}

int lip_ping(lip_client *c) {
    REQUEST(c, "ping", 0);
    return exchange(c, &buf);
}

int lip_vocab_size(lip_client *c, size_t *vocab) {
    REQUEST(c, "info", 0);
    int rc = exchange(c, &buf);
    int64_t v;
    if (rc == 0 && !as_int(get(&c->reply.data, "vocab_size"), &v))
        return fail(c, EBADMSG, "info without vocab_size");
    if (rc == 0)
        *vocab = (size_t)v;
    return rc;
}

/* ------------------------------------------------------------------ text */

int lip_tokenize(lip_client *c, const char *text, int32_t *ids, size_t cap, size_t *n) {
    REQUEST(c, "tokenize", 1);
    pack_str(&pk, "text"); pack_str(&pk, text);
    int rc = exchange(c, &buf);
    return rc ? rc : copy_ids(c, get(&c->reply.data, "tokens"), ids, cap, n, "tokens");
}

int lip_detokenize(lip_client *c, const int32_t *ids, size_t n, char *text, size_t cap) {
    REQUEST(c, "detokenize", 1);
    pack_str(&pk, "tokens"); pack_ids(&pk, ids, n);
    int rc = exchange(c, &buf);
    return rc ? rc : copy_str(c, get(&c->reply.data, "text"), text, cap, "text");
}

/* ------------------------------------------------------------------ caches */

static int new_kv(lip_client *c, lip_kv *kv) {
    const msgpack_object *rights = get(&c->reply.data, "rights");
    int rc = copy_str(c, get(&c->reply.data, "cap"), kv->cap, sizeof kv->cap, "cap");
    if (rc == 0)
        rc = copy_str(c, rights, kv->rights, sizeof kv->rights, "rights");
    kv->fd = -1;
    return rc;
}

int lip_kv_create(lip_client *c, lip_kv *kv) {
    REQUEST(c, "kv_create", 0);
    int rc = exchange(c, &buf);
    return rc ? rc : new_kv(c, kv);
}

int lip_kv_fork(lip_client *c, const lip_kv *kv, lip_kv *fork) {
    REQUEST(c, "kv_fork", 1);
    pack_str(&pk, "cap"); pack_str(&pk, kv->cap);
    int rc = exchange(c, &buf);
    return rc ? rc : new_kv(c, fork);
}

/* The value of `key`'s line in a descriptor ("key value\n") into `out`; 0 if none. */
static int descriptor_value(const char *text, const char *key, char *out, size_t cap) {
    size_t n = strlen(key);
    for (const char *line = text; *line; ) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        if (len > n && !strncmp(line, key, n) && line[n] == ' ' && len - n - 1 < cap) {
            memcpy(out, line + n + 1, len - n - 1);
            out[len - n - 1] = '\0';
            return 1;
        }
        if (!end)
            break;
        line = end + 1;
    }
    return 0;
}

/* `path` as a file of the mount: absolute as given, relative under $KVFS_MOUNT (default
 * /mnt/kvfs); -ENAMETOOLONG where it does not fit PATH_MAX. */
static int mount_path(lip_client *c, const char *path, char full[PATH_MAX]) {
    const char *mount = getenv("KVFS_MOUNT");
    int n = path[0] == '/' ? snprintf(full, PATH_MAX, "%s", path)
        : snprintf(full, PATH_MAX, "%s/%s", mount && *mount ? mount : "/mnt/kvfs", path);
    return n < 0 || n >= PATH_MAX ? fail(c, ENAMETOOLONG, "a path of %d bytes", n) : 0;
}

int lip_kv_open(lip_client *c, const char *path, int write, lip_kv *kv) {
    char full[PATH_MAX], text[DESCRIPTOR_MAX + 1];
    int rc = mount_path(c, path, full);
    if (rc)
        return rc;
    int fd = open(full, write ? O_RDWR : O_RDONLY);
    if (fd < 0)
        return fail(c, errno, "%s: %s", full, strerror(errno));
    ssize_t got = pread(fd, text, DESCRIPTOR_MAX, 0);
    if (got < 0) {
        int err = errno;
        close(fd);
        return fail(c, err, "%s: %s", full, strerror(err));
    }
    text[got] = '\0';
    char cap[LIP_CAP_LEN + 2], rights[4];
    if (strncmp(text, "kvfs 1\n", 7) || !descriptor_value(text, "cap", cap, sizeof cap)
        || strlen(cap) != LIP_CAP_LEN || strspn(cap, "0123456789abcdef") != LIP_CAP_LEN) {
        close(fd);
        return fail(c, EINVAL, "%s: not a KV cache file", full);
    }
    memcpy(kv->cap, cap, LIP_CAP_LEN + 1);
    if (!descriptor_value(text, "rights", rights, sizeof rights) || strcmp(rights, "rw"))
        strcpy(rights, "r");
    strcpy(kv->rights, rights);
    kv->fd = fd;
    c->error[0] = '\0';
    return 0;
}

int lip_kv_close(lip_client *c, lip_kv *kv) {
    if (kv->fd >= 0) {            /* a file: the cache lives on under its name */
        close(kv->fd);
        kv->fd = -1;
        return 0;
    }
    REQUEST(c, "kv_free", 1);
    pack_str(&pk, "cap"); pack_str(&pk, kv->cap);
    return exchange(c, &buf);
}

int lip_kv_remove(lip_client *c, lip_kv *kv, const char *path) {
    if (path != NULL) {
        char full[PATH_MAX];
        int rc = mount_path(c, path, full);
        if (rc)
            return rc;
        if (unlink(full))
            return fail(c, errno, "%s: %s", full, strerror(errno));
    }
    return lip_kv_close(c, kv);
}

int lip_kv_tokens(lip_client *c, const lip_kv *kv, int32_t *ids, size_t cap, size_t *n) {
    REQUEST(c, "kv_tokens", 1);
    pack_str(&pk, "cap"); pack_str(&pk, kv->cap);
    int rc = exchange(c, &buf);
    return rc ? rc : copy_ids(c, get(&c->reply.data, "tokens"), ids, cap, n, "tokens");
}

/* ------------------------------------------------------------------ pred and generate */

int lip_pred(lip_client *c, const lip_kv *kv, const int32_t *tokens, size_t n,
             float *logits, size_t vocab) {
    REQUEST(c, "pred", 2);
    pack_str(&pk, "cap"); pack_str(&pk, kv->cap);
    pack_str(&pk, "tokens"); pack_ids(&pk, tokens, n);
    int rc = exchange(c, &buf);
    if (rc)
        return rc;
    if (!c->has_frame || zmq_msg_size(&c->frame) != vocab * sizeof(float))
        return fail(c, EBADMSG, "logits of %zu bytes, not %zu floats",
                    c->has_frame ? zmq_msg_size(&c->frame) : 0, vocab);
    memcpy(logits, zmq_msg_data(&c->frame), vocab * sizeof(float));
    return 0;
}

int lip_pred_sample(lip_client *c, const lip_kv *kv, const int32_t *tokens, size_t n,
                    const lip_sample *sample, int32_t *token, float *logprob) {
    REQUEST(c, "pred", 3);
    pack_str(&pk, "cap"); pack_str(&pk, kv->cap);
    pack_str(&pk, "tokens"); pack_ids(&pk, tokens, n);
    pack_str(&pk, "sample"); pack_sample(&pk, sample);
    int rc = exchange(c, &buf);
    int64_t t;
    double lp = 0.0;
    if (rc)
        return rc;
    if (!as_int(get(&c->reply.data, "token"), &t))
        return fail(c, EBADMSG, "pred_sample reply without a token");
    as_double(get(&c->reply.data, "logprob"), &lp);
    *token = (int32_t)t;
    if (logprob)
        *logprob = (float)lp;
    return 0;
}

int lip_generate(lip_client *c, const lip_kv *kv, const int32_t *tokens, size_t n,
                 int max_tokens, const lip_sample *sample, int ignore_eos,
                 int32_t *out, size_t cap, size_t *n_out, char *finish) {
    REQUEST(c, "generate", ignore_eos ? 6 : 5);
    pack_str(&pk, "cap"); pack_str(&pk, kv->cap);
    pack_str(&pk, "tokens"); pack_ids(&pk, tokens, n);
    pack_str(&pk, "max_tokens"); msgpack_pack_int(&pk, max_tokens);
    pack_str(&pk, "sample"); pack_sample(&pk, sample);
    pack_str(&pk, "stream"); msgpack_pack_false(&pk);
    if (ignore_eos) { pack_str(&pk, "stop"); msgpack_pack_array(&pk, 0); }
    int rc = exchange(c, &buf);
    if (rc == 0 && finish != NULL)
        rc = copy_str(c, get(&c->reply.data, "finish_reason"), finish, 16, "finish_reason");
    return rc ? rc : copy_ids(c, get(&c->reply.data, "tokens"), out, cap, n_out, "tokens");
}
