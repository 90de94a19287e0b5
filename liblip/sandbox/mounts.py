"""The file system a sandboxed run sees: its own mount namespace, built by the run's
init before the program starts (as root, inside the new namespaces).

* Every directory on the way to a path the run needs (the Python install, liblip, the
  program, predd's socket, the KVFS mount) that its uid could not traverse — /root of
  a pyenv install, a 0700 pytest tmp dir — is covered by an empty root-owned tmpfs
  (mode 0755) and only the needed children are put back (bind mounts cloned with
  open_tree, symlinks recreated). The rest of that directory disappears.
* /tmp, /var/tmp, /run and /dev/shm are covered the same way even when they are open,
  so the run sees no other user's files or daemon sockets there, only what it needs.
* /tmp/scratch (or scratch-UID when the name is taken) is the run's own tmpfs:
  mode 0700, owned by the run's uid, noexec, nosuid, nodev, sized to its memory limit.
  $HOME and $TMPDIR point there; it vanishes with the namespace.
* the KVFS mount is bound onto itself noexec, nosuid, nodev;
* /proc is a fresh procfs of the run's pid namespace, hidepid=2.
Propagation is private first, so nothing done here reaches the host.

`plan()` is pure (directory modes and symlinks come in as functions) and unit-tested;
`build()` applies a plan.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass
from typing import Callable

HIDDEN = ("/tmp", "/var/tmp", "/run", "/dev/shm")
SCRATCH_PARENT = "/tmp"

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
OPEN_TREE_CLONE, AT_RECURSIVE, AT_SYMLINK_NOFOLLOW = 1, 0x8000, 0x100
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]


@dataclass(frozen=True)
class Cover:
    """A directory hidden under an empty tmpfs, with `children` put back."""
    path: str
    children: tuple[str, ...]


class MountError(OSError):
    pass


def resolution(path: str, readlink: Callable[[str], str | None],
               max_links: int = 40) -> list[tuple[str, str]]:
    """(directory, name) for each lookup the kernel makes resolving absolute `path`,
    following symlinks (`readlink` gives a link's target, None for a non-link).
    Every directory in the result is a real (symlink-free) path."""
    steps: list[tuple[str, str]] = []
    todo = [p for p in path.split("/") if p]
    cur, links = "/", 0
    while todo:
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        steps.append((cur, name))
        child = os.path.join(cur, name)
        target = readlink(child)
        if target is None:
            cur = child
            continue
        links += 1
        if links > max_links:
            raise MountError(errno.ELOOP, f"{path}: too many symbolic links")
        todo = [p for p in target.split("/") if p] + todo
        if target.startswith("/"):
            cur = "/"
    return steps


def plan(needed: list[str], hidden: list[str], blocked: Callable[[str], bool],
         readlink: Callable[[str], str | None]) -> list[Cover]:
    """The covers that make every `needed` path reachable: each `hidden` directory,
    and each directory on the way that is `blocked` for the run's uid; shallow first."""
    covers: dict[str, set[str]] = {h: set() for h in hidden}
    for path in needed:
        for directory, name in resolution(path, readlink):
            if directory in covers or blocked(directory):
                if directory == "/":
                    raise MountError(errno.EACCES, "/ is not searchable by the run's uid")
                covers.setdefault(directory, set()).add(name)
    order = sorted(covers, key=lambda d: (d.count("/"), d))
    return [Cover(d, tuple(sorted(covers[d]))) for d in order]


def can_search(st: os.stat_result, uid: int, gid: int) -> bool:
    """Whether uid:gid (no supplementary groups) may traverse a directory (ACLs aside)."""
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def host_blocked(uid: int, gid: int) -> Callable[[str], bool]:
    return lambda d: not can_search(os.stat(d), uid, gid)


def host_readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:   # not a link (EINVAL) or missing
        return None


def hidden_dirs() -> list[str]:
    return [d for d in HIDDEN if os.path.isdir(d) and not os.path.islink(d)]


# ---------------------------------------------------------------- applying it

def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise MountError(err, f"{what}: {os.strerror(err)}")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()   # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {target}")


def _cover(cover: Cover) -> None:
    clones: list[tuple[str, str, int | str]] = []
    try:
        for name in cover.children:
            src = os.path.join(cover.path, name)
            st = os.lstat(src)
            if stat.S_ISLNK(st.st_mode):
                clones.append((name, "link", os.readlink(src)))
                continue
            fd = _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, src.encode(),
                                      OPEN_TREE_CLONE | AT_RECURSIVE | AT_SYMLINK_NOFOLLOW
                                      | os.O_CLOEXEC), f"open_tree {src}")
            clones.append((name, "dir" if stat.S_ISDIR(st.st_mode) else "file", fd))
        mount("tmpfs", cover.path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              "mode=0755,size=1m,nr_inodes=4096")
        for name, kind, what in clones:
            target = os.path.join(cover.path, name)
            if kind == "link":
                os.symlink(what, target)
                continue
            if kind == "dir":
                os.mkdir(target, 0o755)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
            _check(_libc.syscall(SYS_MOVE_MOUNT, what, b"", AT_FDCWD, target.encode(),
                                 MOVE_MOUNT_F_EMPTY_PATH), f"move_mount {target}")
    finally:
        for _, kind, what in clones:
            if kind != "link":
                os.close(what)


def scratch_path(covers: list[Cover], uid: int) -> str:
    taken = next((c.children for c in covers if c.path == SCRATCH_PARENT), ())
    name = "scratch" if "scratch" not in taken else f"scratch-{uid}"
    if name in taken:
        raise MountError(errno.EEXIST, f"{SCRATCH_PARENT}/{name} is needed by the run")
    return os.path.join(SCRATCH_PARENT, name)


def build(covers: list[Cover], scratch: str, uid: int, gid: int, scratch_bytes: int,
          noexec: list[str]) -> None:
    """In a fresh mount namespace (the caller unshared it): apply `covers`, mount the
    scratch tmpfs, make `noexec` mounts noexec, and mount /proc for the pid namespace."""
    if not any(c.path == os.path.dirname(scratch) for c in covers):
        raise MountError(errno.ENOENT, f"{scratch}: its directory is not covered")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    for cover in covers:
        _cover(cover)
    os.mkdir(scratch, 0o755)   # inside the cover's tmpfs, not on the host
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"mode=0700,uid={uid},gid={gid},size={scratch_bytes},nr_inodes=65536")
    for path in noexec:
        mount(path, path, None, MS_BIND | MS_REC)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
