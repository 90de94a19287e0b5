"""`lip`: the system calls from a shell, so shell scripts are LIPs.

    lip info | stats | ps | fsck
    lip tokenize TEXT            lip detokenize ID...
    lip prefill FILE TEXT        append TEXT to the cache FILE (created if missing)
    lip chat FILE MESSAGE        append a user turn, stream the reply, append it too
    lip generate FILE [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--stop S]
    lip cat FILE                 the cache's content as text
    lip run [--sandbox] PROGRAM [ARGS...]
                                 run a LIP (a .py file runs under this Python);
                                 --sandbox: as an untrusted process (liblip/sandbox.py)

FILE is a `.kv` file: relative to the current directory when that is inside the KV
file system, else to $KVFS_MOUNT. Errors print `lip: ENAME: message` and exit 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import liblip as lip
from liblip.client import LipError
from liblip.protocol import default_addr, default_mount

CHAT_PROBE = "\x00probe\x00"


def resolve(path: str) -> str:
    if os.path.isabs(path):
        return path
    mount = os.path.realpath(default_mount())
    cwd = os.path.realpath(os.getcwd())
    base = cwd if cwd == mount or cwd.startswith(mount + os.sep) else mount
    return os.path.join(base, path)


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def _stream_text(tokens) -> list[int]:
    """Print tokens as they come (special tokens hidden); return them all."""
    out: list[int] = []
    shown = ""
    for token in tokens:
        out.append(token)
        text = lip.detokenize(out, skip_special=True)
        if not text.endswith("\ufffd"):   # wait for a complete UTF-8 character
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    return out


def _sample_args(args) -> dict | None:
    if args.temperature is None and args.top_p is None and args.seed is None:
        return None
    return {"temperature": args.temperature if args.temperature is not None else 1.0,
            "top_p": args.top_p if args.top_p is not None else 1.0,
            **({"seed": args.seed} if args.seed is not None else {})}


def _turn_affixes() -> tuple[list[int], list[int]]:
    """(tokens that open a user turn and the assistant's reply, tokens that close the
    assistant's turn), read off the model's chat template by difference."""
    user = {"role": "user", "content": CHAT_PROBE}
    first = lip.client().call("chat_template", messages=[user],
                              add_generation_prompt=False)["text"]
    both = lip.client().call("chat_template", messages=[user, {"role": "user", "content": "{M}"}],
                             add_generation_prompt=True)["text"]
    reply = lip.client().call("chat_template", messages=[user, {"role": "assistant",
                              "content": CHAT_PROBE}], add_generation_prompt=False)["text"]
    opening = both[len(first):] if both.startswith(first) else both
    closing = reply[reply.rindex(CHAT_PROBE) + len(CHAT_PROBE):]
    return opening, closing


def cmd_chat(args) -> int:
    path = resolve(args.file)
    with lip.kv_open(path, write=True, create=True) as kv:
        opening, closing = _turn_affixes()
        if lip.kv_stat(kv)["tokens"] == 0:
            text = lip.client().call("chat_template", messages=[
                {"role": "user", "content": args.message}], add_generation_prompt=True)["text"]
        else:
            text = opening.replace("{M}", args.message)
        eos = set(lip.info()["eos_ids"])
        reply = _stream_text(lip.generate_stream(kv, lip.tokenize(text), args.max_tokens,
                                                 sample=_sample_args(args)))
        sys.stdout.write("\n")
        # generate leaves the last token out of the cache; close the turn with the
        # template's own ending (which starts with the end-of-turn token).
        tail = lip.tokenize(closing)
        if reply and reply[-1] in eos and tail and tail[0] == reply[-1]:
            lip.prefill(kv, tail)
        else:
            lip.prefill(kv, reply[-1:] + tail)
    return 0


def cmd_generate(args) -> int:
    path = resolve(args.file)
    with lip.kv_open(path, write=True) as kv:
        stop = [*lip.info()["eos_ids"], *args.stop] if args.stop else None
        out = _stream_text(lip.generate_stream(kv, [], args.max_tokens, stop=stop,
                                               sample=_sample_args(args)))
        sys.stdout.write("\n")
        if out:
            lip.prefill(kv, out[-1:])   # keep the whole output in the file's cache
    return 0


def cmd_prefill(args) -> int:
    path = resolve(args.file)
    with lip.kv_open(path, write=True, create=True) as kv:
        tokens = lip.tokenize(args.text)
        if tokens:
            cost = lip.prefill(kv, tokens)
            print(f"{args.file}: +{len(tokens)} tokens ({cost.get('computed', 0)} computed, "
                  f"{cost.get('reused', 0)} reused)", file=sys.stderr)
    return 0


def cmd_cat(args) -> int:
    with lip.kv_open(resolve(args.file)) as kv:
        sys.stdout.write(lip.detokenize(lip.kv_tokens(kv)))
        sys.stdout.flush()
    return 0


def cmd_run(args) -> int:
    program = args.program
    env = dict(os.environ)
    env.setdefault("PREDD_ADDR", default_addr())
    env.setdefault("KVFS_MOUNT", default_mount())
    if args.sandbox:
        from liblip import sandbox
        try:
            return sandbox.run([os.path.abspath(program) if os.path.exists(program)
                                else program, *args.args], env, env["KVFS_MOUNT"])
        except (OSError, ValueError) as exc:
            code = "EPERM" if isinstance(exc, PermissionError) else "EINVAL"
            raise LipError(code, f"sandbox: {exc}") from None
    argv = [program, *args.args]
    if program.endswith(".py"):
        argv = [sys.executable, *argv]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        raise LipError("ENOENT" if isinstance(exc, FileNotFoundError) else "EACCES",
                       f"{program}: {exc.strerror}") from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lip", description="Symphony's system calls for shells.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("info", "stats", "ps", "fsck"):
        sub.add_parser(name)
    p = sub.add_parser("tokenize")
    p.add_argument("text")
    p = sub.add_parser("detokenize")
    p.add_argument("ids", nargs="+", type=int)
    p = sub.add_parser("prefill")
    p.add_argument("file")
    p.add_argument("text")
    for name in ("chat", "generate"):
        p = sub.add_parser(name)
        p.add_argument("file")
        if name == "chat":
            p.add_argument("message")
        p.add_argument("--max-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float)
        p.add_argument("--top-p", type=float)
        p.add_argument("--seed", type=int)
        if name == "generate":
            p.add_argument("--stop", action="append", help="stop text (repeatable)")
    p = sub.add_parser("cat")
    p.add_argument("file")
    p = sub.add_parser("run")
    p.add_argument("--sandbox", action="store_true",
                   help="own uid, rlimits, no network, read-only file system but scratch "
                        "and $KVFS_MOUNT, no exec/fork/inet sockets (liblip/sandbox.py)")
    p.add_argument("program")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "info":
            _print_json(lip.info())
        elif args.cmd == "stats":
            _print_json(lip.stats())
        elif args.cmd == "ps":
            _print_json(lip.ps())
        elif args.cmd == "fsck":
            report = lip.fsck()
            _print_json(report)
            return 0 if report["clean"] else 1
        elif args.cmd == "tokenize":
            print(" ".join(map(str, lip.tokenize(args.text))))
        elif args.cmd == "detokenize":
            print(lip.detokenize(args.ids))
        else:
            return globals()[f"cmd_{args.cmd}"](args)
    except LipError as exc:
        print(f"lip: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
