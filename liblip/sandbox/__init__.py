"""`lip run --sandbox`: a program (any executable) as an untrusted process.

Layers, each in its own module:
  identity.py  a fresh unprivileged uid per run (or --uid), never 0; no groups
  run_limits.py memory, CPU seconds, wall seconds, processes (rlimits, always)
  cgroups.py   the same limits for the run as a whole where cgroups are writable
  mounts.py    a private mount namespace: only the paths the run needs are
               reachable, a private noexec scratch tmpfs, a fresh /proc
  landlock.py  read-only file system, writes only in scratch and KVFS, execute
               only installed binaries
  seccomp.py   no INET sockets, no TIOCSTI, no memfd, ptrace, mount, namespaces...;
               Python LIPs also get no fork and no exec
  launcher.py  the launcher, the run's init (pid namespace) and the program
Plus: empty network namespace, own IPC namespace, own session (no controlling
terminal), no_new_privs. The launcher needs root; anything it cannot set up makes it
refuse the run (exit 126) instead of running the program less confined.

May import: the standard library only (it runs as root, before the program).
"""
from liblip.sandbox.launcher import Request, SandboxError, run
from liblip.sandbox.run_limits import Limits, format_size, parse_size

__all__ = ["Limits", "Request", "SandboxError", "format_size", "parse_size", "run"]
