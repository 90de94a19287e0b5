"""Where things are: run directories, predd's socket, the mount, the client's token."""
from __future__ import annotations


SYSTEM_RUNDIR = "/run/symphony"


def default_rundir() -> str:
    """$SYMPHONY_RUNDIR, else /run/symphony for root, else a per-user directory under
    $XDG_RUNTIME_DIR or /tmp. predd refuses a rundir it does not own or that others
    can write (predd/server/loop.py)."""
    import os
    if os.environ.get("SYMPHONY_RUNDIR"):
        return os.environ["SYMPHONY_RUNDIR"]
    if os.geteuid() == 0:
        return SYSTEM_RUNDIR
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"symphony-{os.geteuid()}")


def same_endpoint_key(addr: str) -> str:
    """One spelling per ipc socket path (normalized, absolute), so two spellings of one
    predd compare equal; other addresses as given."""
    import os
    if addr.startswith("ipc://") and len(addr) > 6:
        return "ipc://" + os.path.normpath(os.path.abspath(addr[6:]))
    return addr


def default_addr(rundir: str | None = None) -> str:
    """Where a client finds predd: $PREDD_ADDR, else the socket in $SYMPHONY_RUNDIR,
    else the system predd's (/run/symphony/predd.sock) when it exists, else the socket
    in the per-user rundir. With `rundir`, the socket in that directory."""
    import os
    if rundir is not None:
        return f"ipc://{os.path.join(rundir, 'predd.sock')}"
    if os.environ.get("PREDD_ADDR"):
        return os.environ["PREDD_ADDR"]
    system = os.path.join(SYSTEM_RUNDIR, "predd.sock")
    if not os.environ.get("SYMPHONY_RUNDIR") and os.path.exists(system):
        return f"ipc://{system}"
    return f"ipc://{os.path.join(default_rundir(), 'predd.sock')}"


def default_mount() -> str:
    import os
    return os.environ.get("KVFS_MOUNT", "/mnt/kvfs")


def default_token() -> str:
    """$SYMPHONY_TOKEN: the secret a tcp:// client names its uid with (predd --auth-keys)."""
    import os
    return os.environ.get("SYMPHONY_TOKEN", "")
