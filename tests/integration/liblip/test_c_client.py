"""liblip for C (liblip/c/liblip.h), built by `make lib`: its example decodes a cache file
of the mount by a pred loop, a pred_sample loop and generate, and gets the Python
liblip's greedy tokens each way; failures come back as errno names."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """`make lib` into a fresh directory, and this test's own caller of every call."""
    out = tmp_path_factory.mktemp("liblip-c")
    subprocess.run(["make", "-s", "lib", f"BUILD={out}"], cwd=ROOT, check=True)
    subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{ROOT}/liblip/c", "-o",
                    str(out / "calls"), str(Path(__file__).parent / "c" / "calls.c"),
                    f"-L{out}", "-llip", f"-Wl,-rpath,{out}"], check=True)
    return out


def greedy(built: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(built / "lip-greedy"), *args], capture_output=True,
                          text=True, timeout=120, env=os.environ)


@pytest.mark.slow
def test_the_c_example_decodes_a_cache_file_as_the_python_liblip_does(lip, kvfs, built):
    kv = lip.kv_open("story.kv", write=True, create=True)
    prompt = lip.tokenize("The lighthouse keeper climbed the stairs and")
    lip.pred(kv, prompt, outputs=[])
    want = list(lip.generate(lip.kv_fork(kv), [], max_tokens=12, stop=[]))
    lip.kv_close(kv)
    run = greedy(built, "story.kv", "12")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split("\n", 3)
    for line in lines[:3]:           # pred loop, pred_sample loop, generate
        assert [int(t) for t in line.split()] == want
    assert lines[3] == lip.detokenize(want) + "\n"
    # the file is as it was: the example decoded on forks
    kv = lip.kv_open("story.kv")
    assert lip.kv_tokens(kv) == prompt
    lip.kv_close(kv)
    assert lip.stats()["pending_calls"] == 0


@pytest.mark.slow
def test_the_c_client_reports_errno_names(lip, kvfs, built, tmp_path):
    run = greedy(built, "missing.kv", "4")
    assert run.returncode == 1
    assert run.stderr.startswith("lip-greedy: open: ENOENT: ")
    run = greedy(built, "x" * 5000 + ".kv", "4")
    assert run.returncode == 1 and "open: ENAMETOOLONG: " in run.stderr
    (tmp_path / "notes.txt").write_text("hello")
    run = greedy(built, str(tmp_path / "notes.txt"), "4")
    assert run.returncode == 1 and "open: EINVAL: " in run.stderr
    run = subprocess.run([str(built / "lip-greedy"), "story.kv", "4"], capture_output=True,
                         text=True, timeout=60,
                         env={**os.environ, "PREDD_ADDR": "ipc:///nonexistent/predd.sock"})
    assert run.returncode == 1 and "connect: EIO: predd at ipc:///nonexistent" in run.stderr


@pytest.mark.slow
def test_every_c_call_agrees_with_the_python_liblip(lip, kvfs, built):
    text = "Caches are files: ls, cp and rm work on them."
    kv = lip.kv_open("notes.kv", write=True, create=True)
    lip.pred(kv, lip.tokenize("A cache file."), outputs=[])
    file_tokens = lip.kv_tokens(kv)
    lip.kv_close(kv)
    ids = lip.tokenize(text)
    ref = lip.kv_create()
    best = lip.pred(ref, ids).argmax()
    then = lip.pred_sample(ref, [best], {"temperature": 0.0}).token
    lip.kv_close(ref)
    path = os.path.join(kvfs.mount, "notes.kv")
    run = subprocess.run([str(built / "calls"), text, path], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout.split("\n", 6)
    assert [int(t) for t in out[0].split()] == ids
    assert out[1] == f"{best} {then}"
    assert [int(t) for t in out[2].split()] == ids + [best]
    assert [int(t) for t in out[3].split()] == file_tokens
    assert out[4] == "1 EBADF"
    assert out[5] == "removed" and not os.path.exists(path)
    assert out[6] == text + "\n"
