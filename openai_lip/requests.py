"""OpenAI request bodies, checked: `/v1/chat/completions` and `/v1/completions` into one
`Completion` record, or a `RequestError` with the HTTP status and the offending `param`.

Supported: model, messages | prompt (text, token ids, or a list of either: a batch of
prompts, each answered with n choices, choice i * n + j the jth of prompt i, as vLLM and
llama.cpp's server do), max_tokens (max_completion_tokens), temperature,
top_p, seed, stop, n, logprobs/top_logprobs, response_format (text, json_object,
json_schema), stream + stream_options.include_usage, echo (completions; with logprobs the
prompt's tokens are scored too), user; and, as
vLLM and SGLang accept them (their benchmark clients send `ignore_eos`), ignore_eos (go
on past the model's end-of-sequence token, to max_tokens or a stop string) and
min_tokens (no end-of-sequence token, and no stop string, before that many).
Fields this server cannot honour (tools, logit_bias, penalties, best_of, suffix) are a
400 unless they hold their neutral value; unknown fields are ignored, as vLLM does.
"""
from __future__ import annotations

import json

from dataclasses import dataclass, field

MAX_N = 16
MAX_CHOICES = 64        # n times the prompts of one request (each choice is a cache and a thread)
MAX_STOP = 4
MAX_STOP_CHARS = 1000   # a stop string's length: each token's text is checked against it
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 256
ROLES = {"system", "developer", "user", "assistant"}


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str = "EINVAL") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class Completion:
    chat: bool
    model: str
    messages: list[dict] = field(default_factory=list)   # chat
    prompts: list[str | list[int]] = field(default_factory=list)   # completions: text or ids
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    schema: dict | None = None         # JSON schema the output must follow
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's own logprobs are asked for: `echo` with `logprobs`."""
        return self.echo and self.logprobs

    @property
    def parts(self) -> int:
        """Its choices in all: n for each prompt (a chat is one prompt)."""
        return self.n * max(len(self.prompts), 1)

    @property
    def sample(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p}


def _bad(message: str, param: str) -> RequestError:
    return RequestError(400, message, param)


def _int(body: dict, name: str, lo: int, hi: int, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(f"{name} must be an integer in [{lo}, {hi}]", name)
    return value


def _float(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise _bad(f"{name} must be a number in [{lo}, {hi}]", name)
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{name} must be a boolean", name)
    return value


def _unsupported(body: dict) -> None:
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {},
               "tools": [], "functions": [], "tool_choice": "none", "best_of": 1,
               "suffix": ""}
    for name, value in neutral.items():
        if body.get(name) not in (None, value):
            raise _bad(f"{name} is not supported by this server", name)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad("only text content parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad("content must be a string or a list of text parts", f"messages[{i}].content")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or m["role"] not in ROLES:
            raise _bad(f"each message needs a role in {sorted(ROLES)}", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m, i)})
    return out


def _ids(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)


def _prompts(body: dict) -> list[str | list[int]]:
    """The request's prompts: a string, a list of token ids, or a non-empty list of
    either (a batch)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_ids(p) for p in prompt)):
        return list(prompt)
    raise _bad("prompt must be a string, a list of token ids, or a non-empty list of "
               "strings or of token id lists", "prompt")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise _bad(f"stop must be a non-empty string or a list of at most {MAX_STOP}, each "
                   f"of at most {MAX_STOP_CHARS} characters", "stop")
    return stop


def _response_format(body: dict) -> dict | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema must be a JSON schema object",
                       "response_format")
        return schema
    raise _bad("response_format.type must be text, json_object or json_schema",
               "response_format")


def parse(body, chat: bool, served: str) -> Completion:
    """Check a request body; RequestError(400) names the first bad field, (404) a model
    other than the `served` one."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    try:        # JSON's \ud800 escapes make strings that are not Unicode text
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise _bad("the request body has a string that is not Unicode text (a lone "
                   "surrogate escape)", None) from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required", "model")
    if model != served:
        raise RequestError(404, f"The model `{model}` does not exist (this server serves "
                           f"`{served}`)", "model", "model_not_found")
    _unsupported(body)
    c = Completion(chat=chat, model=model)
    if chat:
        c.messages = _messages(body)
        c.logprobs = _bool(body, "logprobs")
        c.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
        if c.top_logprobs and not c.logprobs:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        c.max_tokens = _int(body, "max_completion_tokens", 1, 1 << 20, None)
    else:
        c.prompts = _prompts(body)
        n_lp = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, None)
        c.logprobs, c.top_logprobs = n_lp is not None, n_lp or 0
        c.echo = _bool(body, "echo")
    c.max_tokens = _int(body, "max_tokens", 1, 1 << 20, c.max_tokens)
    c.n = _int(body, "n", 1, MAX_N, 1)
    if c.parts > MAX_CHOICES:
        raise _bad(f"n times the prompts may be at most {MAX_CHOICES}",
                   "n" if c.n > 1 else "prompt")
    c.temperature = _float(body, "temperature", 0.0, 2.0, 1.0)
    c.top_p = _float(body, "top_p", 0.0, 1.0, 1.0)
    if c.top_p == 0.0:
        raise _bad("top_p must be > 0", "top_p")
    c.seed = _int(body, "seed", -(2**63), 2**63 - 1, None)
    c.stop = _stop(body)
    c.ignore_eos = _bool(body, "ignore_eos")
    c.min_tokens = _int(body, "min_tokens", 0, 1 << 20, 0)
    if c.max_tokens is not None and c.min_tokens > c.max_tokens:
        raise _bad("min_tokens must be at most max_tokens", "min_tokens")
    c.schema = _response_format(body)
    c.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or not c.stream:
            raise _bad("stream_options needs stream: true and is an object", "stream_options")
        c.include_usage = _bool(opts, "include_usage")
    return c
