"""The wire format between LIPs, kvfsd and predd — written once, imported by all.

A request is one msgpack map `{"op": ..., "rid": int, ...fields}` optionally followed by
binary frames; a reply echoes `rid` with `"ok": true` and results, or `"ok": false` and
`{"error": {"code": ERRNO_NAME, "message": ...}}`. Every op's fields are a dataclass below;
`decode_request` validates a raw map against it (types, sizes, shapes) and raises
`ProtocolError` (EINVAL, E2BIG, EBADMSG, ENOSYS) — never anything else — so a server can
answer bad input and go on. Every op's reply is a record too (`REPLIES`): its
`wire(rid)` is the map predd sends, `decode_reply` turns a received map back into it. A
request gets exactly one terminal reply; a streamed generate sends `GenerateChunk`s
(`"more": true`) and then that one (`GenerateReply` or `ErrorReply`).
May import: msgpack and the standard library only — no torch, no zmq, not liblip's
client — so predd, kvfsd, liblip and gatewayd all import it.

Its modules: `requests` (one record per op, and their validation), `replies` (one
record per answer), `codec` (msgpack framing), `addresses` (run directories, sockets,
the mount), `secrets` (secret files, loopback hosts, constant-time matching), `logits_buffer`
(the layout of a buffer a client shares with predd), `descriptor` (what a `.kv` file
holds: a capability, its rights, its home replica), `stream` (the framing of predd's
local stream socket). Every
name is declared once in its module; this package re-exports them, so a user writes
`import symphony_protocol as p` and `p.Pred`, `p.default_addr`.
"""
from symphony_protocol.requests import (  # noqa: F401
    PROTOCOL_VERSION, RIGHTS, CAP_HEX_LEN, MAX_ITEMS, MAX_CHARS, ProtocolError,
    Request, Hello, Bye, Ping, Info, Stats, Ps, Fsck, Tokenize, Detokenize, TokenizerSpec,
    ChatTemplate, KvCreate, KvFork, KvGrant, KvFree, KvStat, KvPolicy, IoWait,
    KvTokens, KvTruncate, KvExtract, KvMerge, KvExport, KvImport, Pred, Generate,
    Cancel, REQUESTS, SAMPLE_KEYS, SampleParams, decode_frames, decode_request, check_rights)
from symphony_protocol.replies import (  # noqa: F401
    Reply, ErrorReply, EmptyReply, HelloReply, InfoReply, StatsReply, PsReply,
    FsckReply, TokenizeReply, DetokenizeReply, TokenizerReply, ChatTemplateReply, KvReply,
    KvExportReply, KvTokensReply, Cost, PredReply, PredLogits, PredSample, PredTopk,
    GenerateChunk, GenerateReply, REPLIES, decode_reply)
from symphony_protocol.codec import (  # noqa: F401
    pack, encode_request)
from symphony_protocol.addresses import (  # noqa: F401
    SYSTEM_RUNDIR, default_rundir, same_endpoint_key, default_addr, default_mount,
    default_token)
from symphony_protocol.secrets import (  # noqa: F401
    is_loopback_host, read_private_file, match_secret)
from symphony_protocol.logits_buffer import SEALS, slot_bytes  # noqa: F401
