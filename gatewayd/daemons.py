"""Child daemons of `symphony serve` (predd, kvfsd): start one, show its log lines on
our stderr with its name as prefix, wait for its `ready ...` line, stop it.

A daemon runs in its own session (a terminal's Ctrl+C reaches only the supervisor,
which stops the daemons in order) and gets SIGTERM if the supervisor dies
(PR_SET_PDEATHSIG), so a killed `symphony serve` leaves no predd and no mount behind.
"""
from __future__ import annotations

import asyncio
import ctypes
import signal
import sys
from dataclasses import dataclass, field


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def log_line(prefix: str, text: str) -> None:
    """One line on stderr, prefixed once (predd and kvfsd prefix their own lines)."""
    if not text.startswith(prefix):
        text = prefix + text
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@dataclass
class Daemon:
    name: str
    argv: list[str]
    proc: asyncio.subprocess.Process | None = None
    ready_line: str = ""
    strip: str = ""          # a prefix its own lines carry, replaced by ours (predd[1]: )
    _pumps: list[asyncio.Task] = field(default_factory=list)

    async def start(self, timeout: float) -> str:
        """Start it and return what follows `ready ` on its stdout. RuntimeError with
        a clear message when it exits or stays silent instead."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, preexec_fn=_die_with_parent,
            start_new_session=True)   # Ctrl+C reaches the supervisor alone: it stops them in order
        self._pumps.append(asyncio.create_task(self._pump(self.proc.stderr)))
        ready = asyncio.create_task(self._ready())
        exited = asyncio.create_task(self.proc.wait())
        done, _ = await asyncio.wait({ready, exited}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ready in done and ready.result():
            exited.cancel()
            self._pumps.append(asyncio.create_task(self._pump(self.proc.stdout)))
            return self.ready_line
        ready.cancel()
        if not done:
            exited.cancel()
            await self.stop()
            raise RuntimeError(f"{self.name} was not ready within {timeout:g} s")
        try:     # it closed its stdout without `ready`: it is exiting
            await asyncio.wait_for(exited, 10)
        except asyncio.TimeoutError:
            await self.stop()
        await asyncio.wait(self._pumps, timeout=2)
        raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} "
                           "before it was ready (its log is above)")

    async def _ready(self) -> bool:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                return False
            text = line.decode("utf-8", "replace").rstrip()
            if text.startswith("ready "):
                self.ready_line = text[len("ready "):]
                return True
            self._log(text)

    def _log(self, text: str) -> None:
        if self.strip and text.startswith(self.strip):
            text = text[len(self.strip):]
        log_line(f"{self.name}: ", text)

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        while True:
            line = await stream.readline()
            if not line:
                return
            self._log(line.decode("utf-8", "replace").rstrip())

    async def wait(self) -> int:
        return await self.proc.wait()

    async def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; its exit status."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                log_line("symphony: ", f"{self.name} did not stop in {timeout:g} s; killing it")
                self.proc.kill()
                await self.proc.wait()
        await asyncio.wait(self._pumps, timeout=2)
        return self.proc.returncode
