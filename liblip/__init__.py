"""liblip: the system calls of an LLM Inference Program, and the `lip` command.

    import liblip as lip
    kv = lip.kv_create()
    d = lip.pred(kv, lip.tokenize("Hello"))
    lip.send_to_user(lip.detokenize([d.argmax()]))

Never imports torch: a LIP stays a small process.

May import: msgpack, numpy, zmq, the protocol (symphony_protocol) and, where installed,
tokenizers (`decode`, `encode`: predd's tokenizer held here); never predd, kvfsd
or gatewayd. `liblip.sandbox` (`lip run --sandbox`) uses the standard library only.
"""
from liblip.api import (KV, chat_template, client, client_of, connect, decode, detokenize, encode,
                        fsck, info, info_cached, io_wait, kv_close, kv_create, kv_export,
                        kv_extract, kv_fork, kv_free, kv_import, kv_merge, kv_open, kv_policy,
                        kv_positions, kv_rehome, kv_remove, kv_save, kv_stat, kv_tokens,
                        kv_truncate, ps, send_to_user, stats, tokenize, tokenizer)
from liblip.client import LipError
from liblip.predict import (Distribution, Generated, Sampled, TopK, generate, generate_into,
                            generate_stream, pred, pred_outputs, pred_sample, pred_topk,
                            prefill)
from liblip.textstream import TextStream, stream_text

__all__ = [
    "KV", "Distribution", "Generated", "LipError", "Sampled", "TextStream", "TopK", "chat_template",
    "client", "client_of", "connect", "decode", "detokenize", "encode", "fsck", "generate",
    "generate_into", "generate_stream", "info", "info_cached", "io_wait", "kv_close", "kv_create",
    "kv_export", "kv_extract", "kv_fork", "kv_free", "kv_import", "kv_merge", "kv_open",
    "kv_policy", "kv_positions", "kv_rehome", "kv_remove", "kv_save", "kv_stat", "kv_tokens",
    "kv_truncate", "pred", "pred_outputs", "pred_sample", "pred_topk", "prefill", "ps",
    "send_to_user", "stats", "stream_text", "tokenize", "tokenizer",
]
