"""How a run is started: the one place that builds `lip run --sandbox` command lines.

Every program, installed, uploaded or the OpenAI LIP, starts as

    python -m liblip.cli run --sandbox [--uid UID] [--wall-seconds S] PROGRAM ARGS...

(PROGRAM is `PYTHON -m MODULE` for a module, the OpenAI LIP's `openai_lip`) with an
environment built here from scratch (never the server's own): PATH (this Python's bin
first, so shell scripts find `lip`), PREDD_ADDR, KVFS_MOUNT, PYTHONPATH = the program's
directory (what `python prog.py` would put on sys.path; none for a module) and then the
directory holding this liblip (so runs use the gateway's own Symphony code), unbuffered
Python output, and the caller's variables from a safe set. Which flags the installed
sandbox takes is read once from `lip run --help`, so the gateway works with the plain
`--sandbox` as with the one that takes a uid.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from gatewayd.errors import ApiError
from gatewayd.programs import Program

SAFE_ENV = frozenset({"LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "NO_COLOR"})
SAFE_PREFIXES = ("LIP_", "APP_", "AGENT_")
ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
MAX_ENV_VALUE = 8192
SERVICE_SECONDS = 10 * 365 * 86400


def check_env(env: dict) -> dict[str, str]:
    """The caller's variables, if every name is in the safe set (else 400 EINVAL)."""
    if not isinstance(env, dict):
        raise ApiError(400, "EINVAL", "env is an object of strings", "env")
    out = {}
    for name, value in env.items():
        if not (isinstance(name, str) and ENV_NAME.fullmatch(name)
                and (name in SAFE_ENV or name.startswith(SAFE_PREFIXES))):
            raise ApiError(400, "EINVAL", f"env: {str(name)[:64]!r} is not allowed (allowed: "
                           f"{', '.join(sorted(SAFE_ENV))} and names starting with "
                           f"{', '.join(SAFE_PREFIXES)})", "env")
        if not isinstance(value, str) or len(value) > MAX_ENV_VALUE or "\0" in value:
            raise ApiError(400, "EINVAL", f"env: {name} must be a string of at most "
                           f"{MAX_ENV_VALUE} characters", "env")
        out[name] = value
    return out


@dataclass(frozen=True)
class Launcher:
    predd_addr: str
    mount: str
    takes_uid: bool = False       # the sandbox has --uid (and --wall-seconds)

    @classmethod
    def probe(cls, predd_addr: str, mount: str) -> Launcher:
        """Ask the installed `lip run` which sandbox flags it knows."""
        out = subprocess.run([sys.executable, "-m", "liblip.cli", "run", "--help"],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": _package_root()})
        return cls(predd_addr, mount, takes_uid="--uid" in out.stdout)

    def on(self, predd_addr: str) -> Launcher:
        """The same launcher for runs on another replica (their PREDD_ADDR)."""
        return dataclasses.replace(self, predd_addr=predd_addr)

    def argv(self, program: Program, args: list[str], uid: int,
             wall_s: float | None) -> list[str]:
        """`wall_s` None: a service (the OpenAI LIP), which runs as long as the server,
        with room for a thread per request."""
        cmd = [sys.executable, "-m", "liblip.cli", "run", "--sandbox"]
        if self.takes_uid:
            cmd += ["--uid", str(uid)]
            if wall_s:
                cmd += ["--wall-seconds", str(int(wall_s) + 1)]   # the gateway kills first
            else:
                cmd += ["--wall-seconds", str(SERVICE_SECONDS), "--cpu-seconds",
                        str(SERVICE_SECONDS), "--memory", "8G", "--max-procs", "1024"]
        if program.kind == "shell":
            cmd += ["/bin/sh", program.path]
        elif program.kind == "module":
            cmd += [sys.executable, "-m", program.path]
        else:
            cmd += [program.path]
        return cmd + list(args)

    def env(self, program: Program, extra: dict[str, str], run_id: str) -> dict[str, str]:
        bindir = os.path.dirname(sys.executable)
        return {
            "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            **extra,
            "PREDD_ADDR": self.predd_addr,
            "KVFS_MOUNT": self.mount,
            # what `python prog.py` puts first on sys.path, then this Symphony's code
            "PYTHONPATH": _package_root() if program.kind == "module"
            else f"{os.path.dirname(program.path)}:{_package_root()}",
            "PYTHONUNBUFFERED": "1",
            "SYMPHONY_RUN": run_id,
        }


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
