"""`symphony serve`: predd, kvfsd and the HTTP gateway as one supervised process tree.

    symphony serve [--model PATH] [--listen HOST:PORT] [--mount DIR] [--programs DIR]...
                   [--api-keys FILE] [--allow-uploads] [--limits 'runs=4 wall=600 pages=0']
                   [--rundir DIR] [--state DIR] [--replicas N] [--predd ADDR]...
                   [predd flags...]

Starts predd (`python -m predd`, any flag this command does not know is passed to it)
and waits for its `ready ADDR`; mounts kvfsd on --mount (default $KVFS_MOUNT or
/mnt/kvfs) and waits for `ready`; starts the OpenAI LIP (`python -m openai_lip`,
sandboxed) and the gateway (uvicorn, in this process) on --listen (default
127.0.0.1:8000); then prints exactly one line on stdout, `ready http://HOST:PORT`.
Logs go to stderr, each line prefixed with its part (`predd: `, `kvfsd: `,
`gatewayd: `, `symphony: `).

SIGTERM or SIGINT stops the gateway (runs killed, their objects freed), then kvfsd
(unmounted), then predd, and exits 0. If a part cannot start (port taken, mount busy,
model missing, not root) or dies later, the others are stopped and the exit status is
1 (2 for bad arguments), after a `symphony: ...` line saying why.

`--replicas N` starts N local predds (replicas.py) under the one kvfsd (given every
replica's address, in order) and the one gateway; `--predd ADDR` attaches a running
remote predd as a further replica. With N > 1 a replica that dies is started again
while the others serve.

Runs as root: kvfsd mounts for every user and `lip run --sandbox` switches uids.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys

import uvicorn

import liblip as lip
from gatewayd.app import create_app
from gatewayd.daemons import Daemon, log_line
from gatewayd.gateway import Gateway
from gatewayd.keys import ApiKeys, Caller, Limits
from gatewayd.launcher import Launcher
from gatewayd.meter import Meter
from gatewayd.metrics import Metrics
from gatewayd.openai_bridge import OpenAIBridge, OpenAIBridges
from gatewayd.programs import EXAMPLES, Programs
from gatewayd.replicas import Replicas, local_addr
from gatewayd.runs import Runs
from symphony_protocol.descriptor import valid_replica
from symphony_protocol import default_mount, default_rundir, is_loopback_host

DEFAULT_LISTEN = "127.0.0.1:8000"
ANONYMOUS_UID = 61000       # every run when there are no API keys
OPENAI_UID = 61001          # the OpenAI LIP (its cache files are its own)
START_TIMEOUT_S = 600.0


class Fatal(Exception):
    """A reason to stop, for the `symphony:` line."""


def log(msg: str) -> None:
    log_line("symphony: ", msg)


def gateway_log(msg: str) -> None:
    log_line("gatewayd: ", msg)


# ---------------------------------------------------------------- arguments

def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--listen {text}: expected HOST:PORT")
    return host, int(port)


is_loopback = is_loopback_host   # --listen's host: the same rule as predd's tcp


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="symphony serve", allow_abbrev=False,
                                 description=__doc__.split("\n\n")[0],
                                 epilog="Other flags go to predd (see predd --help).")
    ap.add_argument("--model", help="GGUF file or HF directory (default: SmolLM2-135M)")
    ap.add_argument("--listen", default=DEFAULT_LISTEN, help="HOST:PORT (default "
                    f"{DEFAULT_LISTEN}; off loopback only with --api-keys)")
    ap.add_argument("--mount", default=None, help="where kvfsd mounts (default "
                    "$KVFS_MOUNT or /mnt/kvfs)")
    ap.add_argument("--programs", action="append", default=[], metavar="DIR",
                    help="a directory of installed programs (repeatable; in a source "
                    "checkout mount_examples/ is installed after them)")
    ap.add_argument("--api-keys", metavar="FILE", help="`KEY UID [NAME] [k=v...]` per "
                    "line, mode 0600 (docs/serving.md)")
    ap.add_argument("--allow-uploads", action="store_true",
                    help="accept uploaded programs (POST /v1/runs)")
    ap.add_argument("--limits", default="", metavar="'runs=N wall=S pages=N'",
                    help="default per-caller limits (default runs=4 wall=600 pages=0)")
    ap.add_argument("--rundir", help="sockets and uploads (default $SYMPHONY_RUNDIR or "
                    "/run/symphony)")
    ap.add_argument("--state", help="kvfsd's state directory (default kvfsd's)")
    ap.add_argument("--replicas", type=int, default=1, metavar="N",
                    help="local predd replicas (default 1); with more, one that dies is "
                    "started again")
    ap.add_argument("--predd", action="append", default=[], metavar="ADDR",
                    help="a running remote predd to attach as a further replica "
                    "(repeatable; $SYMPHONY_TOKEN must be a trusted token there)")
    return ap


def check_setup(args) -> tuple[str, int, ApiKeys | None, Limits]:
    """Everything that can be refused before a daemon starts."""
    if os.geteuid() != 0:
        raise Fatal("symphony serve must run as root: kvfsd mounts for every user and "
                    "runs are started with `lip run --sandbox`, which switches uids")
    host, port = parse_listen(args.listen)
    fields = dict(item.partition("=")[::2] for item in args.limits.replace(",", " ").split())
    limits = Limits().with_fields(fields, "--limits")
    keys = ApiKeys.load(args.api_keys, limits) if args.api_keys else None
    if keys is None and not is_loopback(host):
        raise Fatal(f"--listen {args.listen}: without --api-keys the server listens on "
                    "loopback only (anyone who can connect could run programs)")
    if args.model and not os.path.exists(args.model):
        raise Fatal(f"--model {args.model}: no such file or directory")
    if not 1 <= args.replicas <= 64:
        raise ValueError(f"--replicas {args.replicas}: expected 1 to 64")
    for addr in args.predd:
        if not valid_replica(addr):
            raise ValueError(f"--predd {addr}: expected ipc://PATH or tcp://HOST:PORT")
    return host, port, keys, limits


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Fatal(f"--listen {host}:{port}: {exc.strerror}"
                    + (" (another server is using the port)"
                       if exc.errno == 98 else "")) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def is_mounted(path: str) -> bool:
    path = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1].replace("\\040", " ") == path for line in f
                   if len(line.split()) > 1)


def check_mount(mount: str) -> None:
    if is_mounted(mount):
        raise Fatal(f"--mount {mount}: something is mounted there already (another "
                    "kvfsd?); unmount it (fusermount3 -u) or choose another --mount")
    try:
        os.makedirs(mount, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise Fatal(f"--mount {mount}: {exc.strerror}") from None


def check_rundir(rundir: str, replicas: int = 1) -> None:
    """No other predd may be serving this run directory's sockets."""
    os.makedirs(rundir, mode=0o755, exist_ok=True)
    os.chmod(rundir, 0o755)       # sandboxed runs reach predd's socket through it
    for index in range(replicas):
        path = local_addr(rundir, index)[len("ipc://"):]
        if not os.path.exists(path):
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(path)
            except OSError:
                continue              # a stale socket: predd replaces it
        raise Fatal(f"--rundir {rundir}: a predd already serves {path}")


# ---------------------------------------------------------------- the gateway

def prepare_cache_dir(mount: str, uid: int, sub: str = "") -> None:
    """MOUNT/openai (/K with replicas): the OpenAI LIP's own directory (its prefix cache
    files)."""
    path = os.path.join(mount, "openai", sub) if sub else os.path.join(mount, "openai")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise Fatal(f"{path} is not a directory; the OpenAI program keeps its caches there")
    if st.st_uid != uid:
        os.chown(path, uid, uid)
    os.chmod(path, 0o700)


LOG_CONFIG = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {
        "default": {"()": "uvicorn.logging.DefaultFormatter", "fmt": "gatewayd: %(message)s",
                    "use_colors": False},
        "access": {"()": "uvicorn.logging.AccessFormatter", "use_colors": False,
                   "fmt": 'gatewayd: %(client_addr)s "%(request_line)s" %(status_code)s'}},
    "handlers": {
        "default": {"formatter": "default", "class": "logging.StreamHandler",
                    "stream": "ext://sys.stderr"},
        "access": {"formatter": "access", "class": "logging.StreamHandler",
                   "stream": "ext://sys.stderr"}},
    "loggers": {
        "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
        "uvicorn.error": {"level": "INFO"},
        "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False}},
}


class Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the supervisor owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def start_gateway(args, replicas: Replicas, mount: str, rundir: str, keys, limits,
                        sock: socket.socket):
    addr = replicas.all[0].addr
    lip.connect(addr)
    launcher = await asyncio.to_thread(Launcher.probe, addr, mount)
    if not launcher.takes_uid:
        gateway_log("this `lip run --sandbox` takes no --uid: runs get the sandbox's own "
                    "uid, not their key's")
    metrics = Metrics(replicas, mount)
    meter = Meter(predds=replicas)
    runs = Runs(launcher, meter, metrics, gateway_log, replicas)
    many = len(replicas.local) > 1
    bridge = OpenAIBridges([
        OpenAIBridge(launcher.on(r.addr), OPENAI_UID, args.model, gateway_log,
                     cache_dir=os.path.join(mount, "openai", str(r.index)) if many else None,
                     name=f"openai[{r.index}]" if many else "openai")
        for r in replicas.local], replicas)
    gw = Gateway(mount=mount, rundir=rundir, keys=keys,
                 anonymous=Caller("anonymous", ANONYMOUS_UID, limits),
                 programs=Programs([*args.programs, *([EXAMPLES] if EXAMPLES else [])]),
                 runs=runs, bridge=bridge, meter=meter, metrics=metrics,
                 allow_uploads=args.allow_uploads, log=gateway_log, replicas=replicas)
    meter_task = asyncio.create_task(meter.loop())
    try:
        prepare_cache_dir(mount, OPENAI_UID)
        for r in replicas.local if many else ():
            prepare_cache_dir(mount, OPENAI_UID, str(r.index))
        await bridge.start()
    except BaseException:
        await bridge.stop()
        meter_task.cancel()
        raise
    server = Uvicorn(uvicorn.Config(create_app(gw), log_config=LOG_CONFIG, lifespan="off",
                                    timeout_graceful_shutdown=5, ws="none"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            raise Fatal(f"the gateway did not start: {serving.exception()!r}")
        await asyncio.sleep(0.05)

    async def stop() -> None:
        await runs.shutdown()
        await bridge.stop()
        server.should_exit = True
        await asyncio.wait({serving}, timeout=10)
        meter_task.cancel()
        await asyncio.to_thread(lip.client().close)
    return serving, stop


# ---------------------------------------------------------------- the supervisor

async def serve(args, predd_args: list[str]) -> int:
    host, port, keys, limits = check_setup(args)
    mount = os.path.abspath(args.mount or default_mount())
    rundir = os.path.abspath(args.rundir or default_rundir())
    check_mount(mount)
    check_rundir(rundir, args.replicas)
    sock = bind(host, port)

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    replicas = Replicas.plan(rundir, args.replicas, args.predd, args.model, predd_args, log)
    kvfsd = Daemon("kvfsd", [sys.executable, "-m", "kvfsd", mount,
                             *(["--state", args.state] if args.state else [])])
    stop_gateway = None
    code = 0
    try:
        starting = asyncio.create_task(_start_all(args, replicas, kvfsd, mount, rundir,
                                                  keys, limits, sock))
        stop_wait = asyncio.create_task(stopping.wait())
        done, _ = await asyncio.wait({starting, stop_wait},
                                     return_when=asyncio.FIRST_COMPLETED)
        if starting not in done:
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
            log("stopped while starting")
            return 0
        serving, stop_gateway = starting.result()
        print(f"ready http://{host if ':' not in host else f'[{host}]'}:{port}", flush=True)
        watch = {asyncio.create_task(replicas.watch()): "predd",
                 asyncio.create_task(kvfsd.wait()): "kvfsd", serving: "the gateway"}
        done, pending = await asyncio.wait({stop_wait, *watch},
                                           return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            if task in watch and task is not serving:
                task.cancel()
        for task in done:
            if task in watch:
                status = task.result() if task is not serving else "stopped"
                log(f"{watch[task]} exited ({status}); stopping the rest")
                code = 1
        if code == 0:
            log("stopping: gateway, then kvfsd, then predd")
    except (Fatal, RuntimeError) as exc:
        log(str(exc))
        code = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):   # a second signal must not cut cleanup
            loop.add_signal_handler(sig, lambda: log("still stopping; please wait"))
        if stop_gateway is not None:
            await stop_gateway()
        sock.close()
        await kvfsd.stop()
        if is_mounted(mount):
            log(f"{mount} is still mounted; detaching it")
            subprocess.run(["fusermount3", "-u", "-z", mount], check=False)
        await replicas.stop()
    if code == 0:
        log("stopped")
    return code


async def _start_all(args, replicas: Replicas, kvfsd: Daemon, mount, rundir, keys, limits,
                     sock):
    await replicas.start(START_TIMEOUT_S)
    for addr in replicas.addrs:      # in order: the first is replica 0
        kvfsd.argv += ["--predd", addr]
    await kvfsd.start(60.0)
    return await start_gateway(args, replicas, mount, rundir, keys, limits, sock)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: symphony serve [options]   (symphony serve --help)")
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"symphony: unknown command {argv[0]!r} (try `symphony serve --help`)",
              file=sys.stderr)
        return 2
    args, predd_args = parser().parse_known_args(argv[1:])
    try:
        return asyncio.run(serve(args, predd_args))
    except (Fatal, ValueError) as exc:
        log(str(exc))
        return 2 if isinstance(exc, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
