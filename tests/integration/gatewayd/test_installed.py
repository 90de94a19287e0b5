"""Symphony as a user installs it: `pip install .` of the source tree into a fresh venv
outside it, then that venv's `symphony serve`, started outside the source tree, answers
`POST /v1/chat/completions` with the real model — so the OpenAI program and everything
the server runs come from the installed packages, not from the checkout.

The fresh venv takes the heavy dependencies (torch, ...) from this interpreter's
site-packages through a .pth file (a plain path: no .pth file there runs, so an
editable install of the checkout stays out), and pip installs Symphony alone into it
(--no-deps --no-build-isolation --no-index: no network). The tree is copied first,
without build outputs and caches, so the build writes nothing into the checkout.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sysconfig
import venv

import httpx
import pytest

from tests.conftest import ROOT
from tests.integration.gateway_fixtures import checked_client, finish, start_serve

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="symphony serve needs root"),
              pytest.mark.slow]
NOT_COPIED = {".git", ".venv", "run", "build", "dist", ".hypothesis", ".pytest_cache", ".gpu"}
EOS = {0, 2}
PACKAGES = ("gatewayd", "openai_lip", "liblip", "predd", "kvfsd", "symphony_protocol")
QUESTION = [{"role": "system", "content": "You answer in exactly one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


def _not_copied(folder: str, names: list[str]) -> list[str]:
    top = NOT_COPIED if os.path.samefile(folder, ROOT) else set()
    return [n for n in names
            if n in top or n == "__pycache__" or n.endswith((".egg-info", ".gguf"))]


def _run(argv: list[str], cwd: str, env: dict[str, str]) -> str:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{argv[:4]} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """The fresh venv with Symphony installed into it, and the environment to run it:
    this one without PYTHONPATH, the venv's bin first on PATH."""
    tmp = str(tmp_path_factory.mktemp("installed"))
    src, prefix = os.path.join(tmp, "src"), os.path.join(tmp, "venv")
    shutil.copytree(ROOT, src, ignore=_not_copied, symlinks=True)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(prefix)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    env["PATH"] = os.path.join(prefix, "bin") + os.pathsep + env.get("PATH", "")
    python = os.path.join(prefix, "bin", "python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                tmp, env).strip()
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    with open(os.path.join(site, "symphony_test_deps.pth"), "w") as f:
        f.write("".join(f"{path}\n" for path in deps))
    _run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
          "--ignore-installed", "--no-cache-dir", "--disable-pip-version-check", "-q", src],
         tmp, env)
    shutil.rmtree(src)
    return prefix, env


def test_the_installed_packages_are_the_venvs_own(installed):
    prefix, env = installed
    out = _run([os.path.join(prefix, "bin", "python"), "-c",
                "import importlib, json; from gatewayd import programs; print(json.dumps("
                f"[{{m: importlib.import_module(m).__file__ for m in {PACKAGES!r}}}, "
                "programs.EXAMPLES]))"], os.path.dirname(prefix), env)
    files, examples = json.loads(out)
    site = os.path.realpath(prefix) + os.sep
    assert {m: os.path.realpath(f).startswith(site) for m, f in files.items()} == \
        dict.fromkeys(PACKAGES, True)
    assert examples is None                 # no mount_examples/ beside installed packages
    assert os.access(os.path.join(prefix, "bin", "symphony"), os.X_OK)


@pytest.fixture(scope="module")
def server(installed, tmp_path_factory):
    prefix, env = installed
    tmp = str(tmp_path_factory.mktemp("installed-serve"))
    s = start_serve(tmp, command=(os.path.join(prefix, "bin", "symphony"),), cwd=tmp, env=env)
    yield s
    finish(s)


def test_installed_symphony_serve_answers_chat_completions(installed, server):
    prefix, _ = installed
    with checked_client(server) as predd:
        model = predd.call("info")["model"]
        prompt = predd.call("chat_template", messages=QUESTION)["tokens"]
        kv = predd.call("kv_create")
        try:
            ids = predd.call("generate", cap=kv["cap"], tokens=prompt, max_tokens=8,
                             stream=False)["tokens"]
        finally:
            predd.call("kv_free", cap=kv["cap"])
        text = predd.call("detokenize", tokens=ids, skip_special=True)["text"]
        with httpx.Client(base_url=server.url, timeout=300) as http:
            r = http.post("/v1/chat/completions", json={
                "model": model, "messages": QUESTION, "max_tokens": 8, "temperature": 0})
            programs = http.get("/v1/programs")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["object"], body["model"]) == ("chat.completion", model)
    assert [c["index"] for c in body["choices"]] == [0]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert text.strip()
    assert ids[-1] in EOS                       # a whole short answer, ended by the model
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(ids)
    # the OpenAI program is the venv's `python -m openai_lip`; no examples are installed
    assert programs.status_code == 200 and programs.json() == {"object": "list", "data": []}
    ready = re.search(r"gatewayd: openai: ready \(model .*, pid (\d+)\)", server.log_text())
    with open(f"/proc/{ready.group(1)}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    python = os.path.join(prefix, "bin", "python")
    assert argv[:5] == [python, "-m", "liblip.cli", "run", "--sandbox"]
    assert [python, "-m", "openai_lip"] in [argv[i:i + 3] for i in range(5, len(argv))]
