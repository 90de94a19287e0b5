"""`lip`: the system calls from a shell, so shell scripts are LIPs.

    lip info | stats | ps | fsck
    lip tokenize TEXT            lip detokenize ID...
    lip prefill FILE TEXT        append TEXT to the cache FILE (created if missing)
    lip chat FILE MESSAGE        append a user turn, stream the reply, append it too
    lip generate FILE [--max-tokens N] [--temperature T] [--top-p P] [--seed S] [--stop S]
    lip cat FILE                 the cache's content as text
    lip run [--near FILE]... [--sandbox [--uid UID] [--memory SIZE] [--cpu-seconds N]
            [--wall-seconds N] [--max-procs N]] [--] PROGRAM [ARGS...]
                                 run a LIP (a .py file runs under this Python);
                                 --near: on the predd replica that holds FILEs' caches;
                                 --sandbox: as an untrusted process (docs/sandbox.md)
    lip rehome FILE... [--to ADDR]
                                 move cache files to another predd replica (default:
                                 the live one with the most free pages; docs/scaling.md)

FILE is a `.kv` file: relative to the current directory when that is inside the KV
file system, else to $KVFS_MOUNT. With several predd replicas, prefill, chat, generate
and cat run on the replica that holds FILE's cache (it never moves; a new FILE goes to
the next replica in turn, docs/kvfs.md). Errors print `lip: ENAME: message` and exit 1.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys

import liblip as lip
from liblip.client import LipError
from symphony_protocol import default_addr, default_mount

CHAT_PROBE = "\x00probe\x00"
RUN_SANDBOX_HELP = """\
--sandbox (root only) runs PROGRAM, whatever it is, as an untrusted process:
  a fresh unprivileged uid per run (or --uid), no groups, never root;
  an empty network namespace and no sockets but AF_UNIX; predd is reached through
    its ipc:// socket ($PREDD_ADDR; tcp:// is refused);
  a private file system: read-only, writable only in $HOME (= $TMPDIR, a private
    noexec tmpfs) and $KVFS_MOUNT; private /tmp, /run, /dev/shm; exec only of
    installed binaries, never of a file the program wrote;
  its own pid namespace and cgroup: --max-procs processes, --memory for the whole run
    (and per process), --cpu-seconds, --wall-seconds; ending the run ends all of it;
  no controlling terminal, no TIOCSTI, no ptrace, mount, namespaces, memfd, io_uring;
  a .py PROGRAM may also not fork or exec.
Exit status: the program's (128+N if killed by signal N); 124 when a time limit
ended the run, 137 when the memory limit did; 126 when the sandbox refused to start
the program (it never ran), 127 when PROGRAM does not exist. The sandbox's own
messages read `lip: CODE: sandbox: ...` on stderr."""


def resolve(path: str) -> str:
    if os.path.isabs(path):
        return path
    mount = os.path.realpath(default_mount())
    cwd = os.path.realpath(os.getcwd())
    base = cwd if cwd == mount or cwd.startswith(mount + os.sep) else mount
    return os.path.join(base, path)


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


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
    with lip.kv_open(path, write=True, create=True, move=False) as kv:
        opening, closing = _turn_affixes()
        if lip.kv_stat(kv)["tokens"] == 0:
            text = lip.client().call("chat_template", messages=[
                {"role": "user", "content": args.message}], add_generation_prompt=True)["text"]
        else:
            text = opening.replace("{M}", args.message)
        eos = set(lip.info()["eos_ids"])
        reply = lip.stream_text(lip.generate_stream(kv, lip.tokenize(text), args.max_tokens,
                                                    sample=_sample_args(args)))
        sys.stdout.write("\n")
        # generate leaves the last token out of the cache; close the turn with the
        # template's own ending (which starts with the end-of-turn token).
        tail = lip.tokenize(closing)
        if reply and reply[-1] in eos and tail and tail[0] == reply[-1]:
            lip.prefill(kv, tail)
        else:
            lip.prefill(kv, reply[-1:] + tail)
        _between_turns(kv)
    return 0


def _between_turns(kv: lip.KV) -> None:
    """The turn is done and the script goes on to I/O (a tool, the user): the file's
    cache is the first to move down a tier until the next turn uses it."""
    lip.client_of(kv).call("io_wait", on=True, caps=[kv.cap])


def cmd_generate(args) -> int:
    path = resolve(args.file)
    with lip.kv_open(path, write=True, move=False) as kv:
        stop = [*lip.info()["eos_ids"], *args.stop] if args.stop else None
        out = lip.stream_text(lip.generate_stream(kv, [], args.max_tokens, stop=stop,
                                                  sample=_sample_args(args)))
        sys.stdout.write("\n")
        if out:
            lip.prefill(kv, out[-1:])   # keep the whole output in the file's cache
        _between_turns(kv)
    return 0


def cmd_prefill(args) -> int:
    path = resolve(args.file)
    with lip.kv_open(path, write=True, create=True, move=False) as kv:
        tokens = lip.tokenize(args.text)
        if tokens:
            cost = lip.prefill(kv, tokens)
            print(f"{args.file}: +{len(tokens)} tokens ({cost.get('computed', 0)} computed, "
                  f"{cost.get('reused', 0)} reused)", file=sys.stderr)
        _between_turns(kv)
    return 0


def cmd_cat(args) -> int:
    with lip.kv_open(resolve(args.file), move=False) as kv:
        sys.stdout.write(lip.detokenize(lip.kv_tokens(kv)))
        sys.stdout.flush()
    return 0


def cmd_run(args) -> int:
    program = args.program
    env = dict(os.environ)
    env.setdefault("PREDD_ADDR", default_addr())
    env.setdefault("KVFS_MOUNT", default_mount())
    if args.near:
        env["PREDD_ADDR"] = home_of([resolve(f) for f in args.near])
    if args.sandbox:
        return _run_sandboxed(args, env)
    limited = [f"--{n.replace('_', '-')}" for n in ("uid", "memory", "cpu_seconds",
                                                     "wall_seconds", "max_procs")
               if getattr(args, n) is not None]
    if limited:
        raise LipError("EINVAL", f"{', '.join(limited)}: only with --sandbox")
    argv = [program, *args.args]
    if program.endswith(".py"):
        argv = [sys.executable, *argv]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        raise LipError("ENOENT" if isinstance(exc, FileNotFoundError) else "EACCES",
                       f"{program}: {exc.strerror}") from None


def _xattr(path: str, name: str) -> str:
    try:
        return os.getxattr(path, name).decode()
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP):
            return ""
        raise LipError(errno.errorcode.get(exc.errno or 0, "EIO"),
                       f"{path}: {exc.strerror}") from None


def home_of(paths: list[str]) -> str:
    """The replica that holds most of the tokens cached in `paths` (ties: the first
    named); EINVAL when none is a cache file on a kvfs mount."""
    held: dict[str, int] = {}
    for path in paths:
        home = _xattr(path, "user.kv.replica")
        if home:
            held[home] = held.get(home, 0) + int(_xattr(path, "user.kv.tokens") or 0)
    if not held:
        raise LipError("EINVAL", f"--near {' '.join(paths)}: not a cache file that names "
                       "its replica (user.kv.replica)")
    return max(held, key=lambda home: held[home])


def cmd_rehome(args) -> int:
    failed = 0
    for name in args.files:
        try:
            print(f"{name}: {lip.kv_rehome(resolve(name), args.to or '')}")
        except LipError as exc:
            print(f"lip: {exc.code}: {exc.message}", file=sys.stderr)
            failed = 1
    return failed


def replicas() -> dict:
    """The replicas and the migrations between them, as the mount's root tells them
    (kvfsd over several predds; docs/scaling.md); {} with one predd or no mount."""
    root = default_mount()
    lines = _xattr(root, "user.kv.replicas").splitlines() if os.path.isdir(root) else []
    if not lines:
        return {}
    out = []
    for line in lines:
        addr, state, *fields = line.split()
        item = {"addr": addr, "up": state == "up"}
        for field in fields:
            key, _, value = field.partition("=")
            if key == "pages":
                used, _, total = value.partition("/")
                item["pages_used"], item["pages_total"] = int(used), int(total)
            elif value.isdigit():
                item[key] = int(value)
        out.append(item)
    count, _, moved = _xattr(root, "user.kv.migrations").partition(" ")
    return {"replicas": out,
            "migrations": {"count": int(count or 0), "bytes": int(moved or 0)}}


def _run_sandboxed(args, env: dict[str, str]) -> int:
    from liblip import sandbox
    try:
        memory = sandbox.parse_size(args.memory) if args.memory else None
    except ValueError as exc:
        raise LipError("EINVAL", f"--memory: {exc}") from None
    given = {"memory": memory, "cpu_seconds": args.cpu_seconds,
             "wall_seconds": args.wall_seconds, "max_procs": args.max_procs}
    limits = sandbox.Limits(**{k: v for k, v in given.items() if v is not None})
    request = sandbox.Request([args.program, *args.args], env, limits, args.uid,
                              env["KVFS_MOUNT"])
    try:
        return sandbox.run(request)
    except sandbox.SandboxError as exc:
        print(f"lip: {exc.code}: {exc.message}", file=sys.stderr, flush=True)
        return exc.status


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
    p = sub.add_parser("rehome", help="move cache files to another predd replica")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--to", metavar="ADDR", help="the replica's address (default: the live "
                   "one with the most free pages)")
    p = sub.add_parser(
        "run", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a LIP: PROGRAM is any executable (a .py file runs under this "
                    "Python).",
        epilog=RUN_SANDBOX_HELP)
    p.add_argument("--near", action="append", default=[], metavar="FILE",
                   help="run on the predd replica that holds this cache file (repeatable: "
                   "the one holding most of their tokens); sets PREDD_ADDR")
    p.add_argument("--sandbox", action="store_true",
                   help="run as an untrusted process (needs root; see below)")
    p.add_argument("--uid", type=int, metavar="UID",
                   help="run as this uid (not 0) instead of a fresh one per run")
    p.add_argument("--memory", metavar="SIZE",
                   help="memory of the run: bytes or 512M, 2G... (default 2G)")
    p.add_argument("--cpu-seconds", type=int, metavar="N", help="CPU time (default 600)")
    p.add_argument("--wall-seconds", type=int, metavar="N", help="wall time (default 3600)")
    p.add_argument("--max-procs", type=int, metavar="N",
                   help="processes and threads (default 64)")
    p.add_argument("program")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "info":
            _print_json(lip.info())
        elif args.cmd == "stats":
            _print_json({**lip.stats(), **replicas()})
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
