"""Installed programs: what `POST /v1/programs/{name}/runs` may start.

A program is a file in one of the program directories (`--programs DIR`, then, in a
source checkout, mount_examples/ — EXAMPLES, None where the code is installed without
it): a Python file with a `__main__` guard, a shell script (`.sh`), or any other
executable file. Its name is the file name without the extension (`basic_decoding` for
basic_decoding.py); the first directory that has a name wins. Library modules (no
`__main__` guard, like mount_examples/common.py) and files starting with `_` or `.` are
not programs. The directories are read on every lookup, so installing a program is
copying a file there.

A Program of kind "module" is an installed Python module run as `python -m`
(the OpenAI LIP, `openai_lip`); it is started by the gateway itself, never found in a
program directory.

Uploaded programs (`POST /v1/runs`) are written to a private directory per run and
removed when the run ends.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass

from gatewayd.errors import ApiError


def _examples() -> str | None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "mount_examples")
    return path if os.path.isdir(path) else None


EXAMPLES = _examples()
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_UPLOAD = 256 * 1024


@dataclass(frozen=True)
class Program:
    name: str
    path: str            # a file; for kind "module", the module's name
    kind: str            # "python", "shell", "executable" or "module"

    @property
    def description(self) -> str:
        """The first line of its docstring or leading comment, for listings."""
        if self.kind == "module":
            return ""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                head = f.read(4096)
        except OSError:
            return ""
        for line in head.splitlines():
            text = line.strip().strip('"\'#').strip()
            if text and not text.startswith("!") and not text.startswith("from __future__"):
                return text[:200]
        return ""


def classify(path: str) -> str | None:
    """The kind of program `path` is, or None when it is not one."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    base = os.path.basename(path)
    if base.startswith(("_", ".")):
        return None
    if base.endswith(".py"):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(1 << 20)
        except OSError:
            return None
        return "python" if "__name__ == \"__main__\"" in text or \
            "__name__ == '__main__'" in text else None
    if base.endswith(".sh"):
        return "shell"
    return "executable" if st.st_mode & 0o111 else None


class Programs:
    def __init__(self, dirs: list[str]) -> None:
        self.dirs = [os.path.abspath(d) for d in dirs]

    def all(self) -> dict[str, Program]:
        found: dict[str, Program] = {}
        for folder in self.dirs:
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            for base in names:
                path = os.path.join(folder, base)
                kind = classify(path)
                name = os.path.splitext(base)[0]
                if kind and name not in found:
                    found[name] = Program(name, path, kind)
        return found

    def get(self, name: str) -> Program:
        program = self.all().get(name) if NAME.fullmatch(name) else None
        if program is None:
            raise ApiError(404, "ENOENT", f"no program named {name!r} is installed "
                           "(GET /v1/programs lists them)", "name")
        return program


def save_upload(folder: str, filename: str, source: str, owner: int | None) -> Program:
    """Write an uploaded program into `folder` (created; only `owner` may read it when
    given, else anyone who can guess the folder's random name)."""
    if not NAME.fullmatch(filename or "") or not filename.endswith((".py", ".sh")):
        raise ApiError(400, "EINVAL", "filename must be a plain name ending in .py or .sh",
                       "filename")
    data = source.encode("utf-8")
    if len(data) > MAX_UPLOAD:
        raise ApiError(413, "EFBIG", f"an uploaded program is at most {MAX_UPLOAD} bytes",
                       "source")
    os.makedirs(os.path.dirname(folder), mode=0o711, exist_ok=True)
    os.makedirs(folder, mode=0o700)
    path = os.path.join(folder, filename)
    with open(path, "wb") as f:
        f.write(data)
    if owner is None:
        os.chmod(folder, 0o755)
        os.chmod(path, 0o644)
    else:
        os.chown(folder, owner, owner)
        os.chown(path, owner, owner)
        os.chmod(path, 0o400)
    kind = "python" if filename.endswith(".py") else "shell"
    return Program(os.path.splitext(filename)[0], path, kind)


def remove_upload(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
