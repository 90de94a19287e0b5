"""`kvfsd`: mount predd's KV caches as files.

    kvfsd [MOUNTPOINT] [--predd ADDR ...] [--state DIR] [--allow-other | --no-allow-other]
          [--names-per-uid N]

`--predd` is repeatable: several predd replicas under one namespace (the first is
replica 0; kvfsd/replicas.py). A tcp:// replica authenticates with $SYMPHONY_TOKEN.

Mounts with default_permissions (the kernel enforces modes), nosuid, nodev, noexec and,
by default, allow_other; prints `ready MOUNTPOINT` on stdout once mounted; logs go to stderr.
SIGTERM/SIGINT unmount cleanly.
"""
from __future__ import annotations

import argparse
import errno
import os
import signal
import sqlite3
import subprocess
import sys

import pyfuse3
import trio

from kvfsd.caches import Caches
from kvfsd.fs import KvFs
from kvfsd.namespace import NAMES_PER_UID, Namespace
from kvfsd.replicas import Replicas
from kvfsd.state import StateDir, StateDirBusy, default_state_dir
from symphony_protocol import default_addr, default_mount


def log(msg: str) -> None:
    print(f"kvfsd: {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvfsd", description=__doc__.split("\n\n")[0])
    ap.add_argument("mountpoint", nargs="?", default=None,
                    help="where to mount (default $KVFS_MOUNT or /mnt/kvfs)")
    ap.add_argument("--predd", action="append", metavar="ADDR",
                    help="predd endpoint; repeat it for several replicas, in order "
                    "(default $PREDD_ADDR or ipc://$SYMPHONY_RUNDIR/predd.sock)")
    ap.add_argument("--state", help="state directory: namespace and fsync'd snapshots "
                    f"(default {default_state_dir()})")
    ap.add_argument("--allow-other", action=argparse.BooleanOptionalAction, default=True,
                    help="let other users use the mount; modes still apply (default on)")
    ap.add_argument("--names-per-uid", type=int, default=NAMES_PER_UID, metavar="N",
                    help="names (files, directories, links) one uid other than root may "
                    f"own; EDQUOT beyond (default {NAMES_PER_UID}, 0: no bound)")
    return ap.parse_args(argv)


def clear_dead_mount(mountpoint: str) -> None:
    """A kvfsd killed with SIGKILL leaves an unreachable mount (ENOTCONN): detach it."""
    try:
        os.stat(mountpoint)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            log(f"{mountpoint}: detaching the dead mount of an earlier kvfsd")
            subprocess.run(["fusermount3", "-u", "-z", mountpoint], check=False)


def load_namespace(state: StateDir, names_per_uid: int) -> tuple[Namespace, list]:
    """The namespace, and the caches to free (a kvfsd died before it could): a
    capability, or [replica, capability]."""
    doc = state.load()
    if doc is None:
        return Namespace(os.getuid(), os.getgid(), names_per_uid), []
    ns = Namespace.from_dict(doc, names_per_uid)
    return ns, list(doc.get("pending_free", [])) + [list(lost) for lost in ns.lost_caps]


async def serve(fs: KvFs, mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            fs.caches.mounted = True
            nursery.start_soon(pyfuse3.main)
            for recovery in fs.caches.recoveries.values():
                nursery.start_soon(recovery.monitor)
            nursery.start_soon(fs.caches.expiry.run)
            print(f"ready {mountpoint}", flush=True)
            async for signum in sigs:
                log(f"{signal.Signals(signum).name}: unmounting")
                break
            nursery.cancel_scope.cancel()


async def prepare(caches: Caches) -> None:
    """Connect to each replica and re-validate the caches of the state directory homed
    on it; re-home the files of replicas kvfsd does not have any more."""
    for recovery in caches.recoveries.values():
        recovery.stale = True
        await recovery.check_predd()
        if recovery.stale:
            log(f"predd at {recovery.predd.addr} is not answering yet; its caches are "
                "checked when it does")
    await caches.migration.rehome_homeless()
    caches.remove_unused_snapshots()
    caches.expiry.watch_all()


async def finish(fs: KvFs) -> None:
    with trio.move_on_after(10):
        await fs.release_all()
    fs.caches.save_now()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mountpoint = os.path.abspath(args.mountpoint or default_mount())
    addrs = args.predd or [default_addr()]
    try:
        state = StateDir(args.state or default_state_dir())
    except (StateDirBusy, OSError, sqlite3.Error) as exc:
        log(str(exc))
        return 2
    try:
        ns, pending = load_namespace(state, max(0, args.names_per_uid))
    except (ValueError, KeyError, TypeError, sqlite3.Error) as exc:
        log(f"{state.path}: unreadable namespace ({exc}); not mounting")
        return 2
    replicas = Replicas(addrs, log)
    caches = Caches(ns, state, replicas, log, pending)
    fs = KvFs(caches)
    trio.run(prepare, caches)
    clear_dead_mount(mountpoint)
    # A cache file is never a program or a device.
    options = {"fsname=kvfs", "subtype=kvfs", "default_permissions", "nosuid", "nodev",
               "noexec"}
    if args.allow_other:
        options.add("allow_other")
    try:
        pyfuse3.init(fs, mountpoint, options)
    except RuntimeError as exc:
        log(f"cannot mount {mountpoint}: {exc}")
        replicas.close()
        return 1
    log(f"mounted {mountpoint} (predd {' '.join(link.addr for link in replicas)}, "
        f"state {state.path}, "
        f"{sum(1 for _ in ns.files())} caches)")
    try:
        trio.run(serve, fs, mountpoint)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)      # a second signal must not cut cleanup
        pyfuse3.close(unmount=True)
        trio.run(finish, fs)
        replicas.close()
        state.close()
        log("unmounted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
