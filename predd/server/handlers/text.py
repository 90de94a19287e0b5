"""Text ops: tokenize, detokenize, chat_template."""
from __future__ import annotations

from typing import TYPE_CHECKING

import symphony_protocol as p
from symphony_protocol import ProtocolError

if TYPE_CHECKING:
    from predd.engine.core import Engine
    from predd.server.sessions import Session


def tokenize(e: Engine, s: Session, r: p.Tokenize, extra: list[bytes],
             now: float) -> p.TokenizeReply:
    e.limits.check_text("tokenize.text", r.text)
    return p.TokenizeReply(tokens=e.tokenizer.encode(r.text, add_special=r.add_special))


def detokenize(e: Engine, s: Session, r: p.Detokenize, extra: list[bytes],
               now: float) -> p.DetokenizeReply:
    e.limits.count("detokenize.tokens", r.tokens, e.limits.text_tokens)
    e.limits.ids("detokenize.tokens", r.tokens, e.vocab)
    return p.DetokenizeReply(text=e.tokenizer.decode(r.tokens, skip_special=r.skip_special))


def tokenizer(e: Engine, s: Session, r: p.TokenizerSpec, extra: list[bytes],
              now: float) -> p.TokenizerReply:
    return p.TokenizerReply(json=e.tokenizer.spec())


def chat_template(e: Engine, s: Session, r: p.ChatTemplate, extra: list[bytes],
                  now: float) -> p.ChatTemplateReply:
    e.limits.check_messages(r.messages)
    try:
        text = e.tokenizer.apply_chat_template(r.messages, r.add_generation_prompt)
    except Exception as exc:
        raise ProtocolError("EINVAL", f"chat template failed: {exc}") from None
    return p.ChatTemplateReply(text=text, tokens=e.tokenizer.encode(text))


HANDLERS = {p.Tokenize: tokenize, p.Detokenize: detokenize, p.TokenizerSpec: tokenizer,
            p.ChatTemplate: chat_template}
