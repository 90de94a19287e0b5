"""The gateway's pure parts, without daemons: API keys files, the run environment's
safe set, program discovery, --listen parsing, OpenAI request checking, prefix
matching, and the error body."""
from __future__ import annotations

import os
import sys

import pytest

from gatewayd.errors import ApiError, error_body
from gatewayd.keys import ApiKeys, Limits
from gatewayd.launcher import Launcher, check_env
from gatewayd.openai_bridge import PROGRAM
from gatewayd.programs import EXAMPLES, Programs, classify, save_upload
from gatewayd.serve import is_loopback, parse_listen
from openai_lip.prefix_cache import common_prefix
from openai_lip.requests import RequestError, parse
from tests.conftest import ROOT
from tests.unit.helpers import secrets_file

KEY = "sk-alice-0123456789abcdef"


def test_keys_map_to_callers_with_limits(tmp_path):
    path = secrets_file(tmp_path, f"# comment\n\n{KEY} 1001 alice runs=2 wall=30\n"
                               "sk-bob-0123456789abcdef 1002\n")
    keys = ApiKeys.load(path, Limits(runs=4, wall=600, pages=7))
    alice = keys.lookup(KEY)
    assert (alice.name, alice.uid, alice.limits) == ("alice", 1001, Limits(2, 30.0, 7))
    bob = keys.lookup("sk-bob-0123456789abcdef")
    assert (bob.name, bob.uid, bob.limits) == ("uid1002", 1002, Limits(4, 600.0, 7))
    assert keys.lookup("sk-alice-0123456789abcdeX") is None
    assert keys.lookup("") is None


@pytest.mark.parametrize("text,message", [
    (f"{KEY}\n", "expected `KEY UID"),
    (f"{KEY} 0 root\n", "0 < UID"),
    (f"{KEY} -5\n", "expected `KEY UID"),
    ("sk-short 1001\n", "key shorter than 16"),
    (f"{KEY} 1001\n{KEY} 1002\n", ":2: key listed twice"),
    (f"{KEY} 1001 alice cpus=4\n", "unknown limit 'cpus'"),
    (f"{KEY} 1001 alice runs=x\n", "runs='x' is not a number"),
    (f"{KEY} 1001 alice runs=0\n", "runs=0 is out of range"),
    (f"{KEY} 1001 alice bob\n", "'bob' is not a k=v limit"),
    ("# nothing\n", "no keys"),
])
def test_bad_keys_files_are_refused(tmp_path, text, message):
    with pytest.raises(ValueError) as err:
        ApiKeys.load(secrets_file(tmp_path, text), Limits())
    assert message in str(err.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="owner check needs root to chown")
def test_keys_file_must_be_private(tmp_path):
    with pytest.raises(ValueError) as err:
        ApiKeys.load(secrets_file(tmp_path, f"{KEY} 1001\n", 0o640), Limits())
    assert "mode 0640 lets group or others read it (chmod 600)" in str(err.value)
    path = secrets_file(tmp_path, f"{KEY} 1001\n")
    os.chown(path, 1234, 1234)
    with pytest.raises(ValueError) as err:
        ApiKeys.load(path, Limits())
    assert "owned by uid 1234" in str(err.value)


def test_env_safe_set():
    assert check_env({"LANG": "C", "APP_X": "1", "LIP_ARGS": "--max-tokens 3",
                      "AGENT_CHECK": "true"}) == {"LANG": "C", "APP_X": "1",
                                                  "LIP_ARGS": "--max-tokens 3",
                                                  "AGENT_CHECK": "true"}
    for bad in ({"PATH": "/tmp"}, {"LD_PRELOAD": "x"}, {"PYTHONPATH": "x"},
                {"PREDD_ADDR": "tcp://x"}, {"app_x": "1"}, {"APP_X": 1}, {"APP_X": "a\0b"}):
        with pytest.raises(ApiError) as err:
            check_env(bad)
        assert (err.value.status, err.value.code, err.value.param) == (400, "EINVAL", "env")


def test_launcher_builds_one_command_line(tmp_path):
    prog = save_upload(str(tmp_path / "uploads" / "r1"), "x.sh", "echo hi\n", None)
    plain = Launcher("ipc:///run/p.sock", "/mnt/kvfs", takes_uid=False)
    assert plain.argv(prog, ["a"], 1001, 60)[-5:] == ["run", "--sandbox", "/bin/sh",
                                                       prog.path, "a"]
    with_uid = Launcher("ipc:///run/p.sock", "/mnt/kvfs", takes_uid=True)
    assert with_uid.argv(prog, [], 1001, 60)[-7:-2] == ["--sandbox", "--uid", "1001",
                                                        "--wall-seconds", "61"]
    env = plain.env(prog, {"APP_X": "1", "PREDD_ADDR": "spoofed"}, "run_1")
    assert env["PREDD_ADDR"] == "ipc:///run/p.sock" and env["KVFS_MOUNT"] == "/mnt/kvfs"
    assert env["APP_X"] == "1" and env["SYMPHONY_RUN"] == "run_1"
    assert env["PYTHONPATH"].split(":")[0] == os.path.dirname(prog.path)


def test_the_openai_lip_starts_as_an_installed_module():
    """`python -m openai_lip` with only the directory holding the installed packages on
    PYTHONPATH: no path into a source tree."""
    launcher = Launcher("ipc:///run/p.sock", "/mnt/kvfs", takes_uid=True)
    argv = launcher.argv(PROGRAM, ["--cache-dir", "/mnt/kvfs/openai/1"], 61001, None)
    assert argv[:5] == [sys.executable, "-m", "liblip.cli", "run", "--sandbox"]
    assert argv[-5:] == [sys.executable, "-m", "openai_lip", "--cache-dir",
                         "/mnt/kvfs/openai/1"]
    env = launcher.env(PROGRAM, {}, "openai")
    assert env["PYTHONPATH"] == ROOT
    assert os.path.isfile(os.path.join(env["PYTHONPATH"], "openai_lip", "__main__.py"))
    assert PROGRAM.description == ""


def test_the_examples_are_installed_from_a_source_checkout():
    assert EXAMPLES == os.path.join(ROOT, "mount_examples")
    found = Programs([EXAMPLES]).all()
    assert found["basic_decoding"].kind == "python" and found["agent"].kind == "shell"
    assert not {"common", "openai_server", "prefix_cache"} & set(found)


def test_programs_are_found_by_name(tmp_path):
    (tmp_path / "tool.py").write_text('if __name__ == "__main__":\n    print(1)\n')
    (tmp_path / "helpers.py").write_text("def f(): pass\n")
    (tmp_path / "flow.sh").write_text("echo hi\n")
    (tmp_path / "_hidden.py").write_text('if __name__ == "__main__": pass\n')
    (tmp_path / "notes.txt").write_text("not a program\n")
    (tmp_path / "bin").write_text("#!/bin/sh\n")
    os.chmod(tmp_path / "bin", 0o755)
    found = Programs([str(tmp_path)]).all()
    assert {n: p.kind for n, p in found.items()} == {
        "tool": "python", "flow": "shell", "bin": "executable"}
    assert classify(str(tmp_path / "helpers.py")) is None
    with pytest.raises(ApiError) as err:
        Programs([str(tmp_path)]).get("../tool")
    assert err.value.status == 404


def test_first_directory_wins(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x.sh").write_text("echo a\n")
    (b / "x.py").write_text('if __name__ == "__main__": pass\n')
    assert Programs([str(a), str(b)]).get("x").path == str(a / "x.sh")


@pytest.mark.parametrize("name,status", [("x.exe", 400), ("../x.py", 400), ("", 400),
                                         (".x.py", 400)])
def test_upload_names(tmp_path, name, status):
    with pytest.raises(ApiError) as err:
        save_upload(str(tmp_path / "u"), name, "print(1)", None)
    assert err.value.status == status and err.value.param == "filename"


def test_listen_addresses():
    assert parse_listen("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    for bad in ("8000", "host:", ":80", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            parse_listen(bad)
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")


def test_error_body_is_openai_shaped():
    assert error_body(429, "EAGAIN", "busy") == {"error": {
        "message": "busy", "type": "rate_limit_error", "param": None, "code": "EAGAIN"}}


# ---------------------------------------------------------------- OpenAI requests

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_request_fields():
    c = parse({**CHAT, "messages": [{"role": "developer", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}],
               "n": 3, "max_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 9,
               "stop": "\n", "logprobs": True, "top_logprobs": 2, "stream": True,
               "stream_options": {"include_usage": True},
               "response_format": {"type": "json_object"}, "frequency_penalty": 0,
               "some_future_field": 1}, chat=True, served="m")
    assert c.messages == [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "ab"}]
    assert (c.n, c.max_tokens, c.temperature, c.top_p, c.seed) == (3, 5, 0.0, 0.5, 9)
    assert c.stop == ["\n"] and c.logprobs and c.top_logprobs == 2
    assert c.stream and c.include_usage and c.schema == {"type": "object"}


def test_completion_request_fields():
    c = parse({"model": "m", "prompt": ["Once"], "logprobs": 3, "echo": True}, chat=False,
              served="m")
    assert (c.prompts, c.logprobs, c.top_logprobs, c.echo) == (["Once"], True, 3, True)
    assert parse({"model": "m", "prompt": [1, 2, 3]}, chat=False,
                 served="m").prompts == [[1, 2, 3]]
    assert parse({"model": "m", "prompt": ["a"] * 4, "n": 16}, chat=False,
                 served="m").prompts == ["a"] * 4
    for body, param in (({"prompt": ["a"] * 5, "n": 16}, "n"), ({"prompt": ["a"] * 65}, "prompt")):
        with pytest.raises(RequestError) as err:       # n times the prompts: 64 at most
            parse({"model": "m", **body}, chat=False, served="m")
        assert err.value.param == param
    assert parse({"model": "m", "prompt": [[1], [2, 3]]}, chat=False,
                 served="m").prompts == [[1], [2, 3]]
    assert parse({"model": "m", "prompt": "x"}, chat=False, served="m").logprobs is False


@pytest.mark.parametrize("change,param", [
    ({"model": None}, "model"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"n": 17}, "n"), ({"n": True}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"seed": 1.5}, "seed"), ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"),
    ({"stop": ["x" * 1001]}, "stop"),
    ({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"presence_penalty": 1.0}, "presence_penalty"), ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_chat_requests(change, param):
    with pytest.raises(RequestError) as err:
        parse({**CHAT, **change}, chat=True, served="m")
    assert (err.value.status, err.value.param) == (400, param)


@pytest.mark.parametrize("body,chat", [
    ({"prompt": "a \ud800 b"}, False), ({"prompt": ["ok", "\udfff"]}, False),
    ({"messages": [{"role": "user", "content": "\ud83d"}]}, True),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["\ud800"]}, True)])
def test_a_string_that_is_not_unicode_text_is_a_400(body, chat):
    """JSON's escapes can make lone surrogates, which no tokenizer or msgpack takes."""
    with pytest.raises(RequestError) as err:
        parse({"model": "m", **body}, chat=chat, served="m")
    assert err.value.status == 400 and "lone surrogate" in err.value.message


def test_unknown_model_is_404():
    with pytest.raises(RequestError) as err:
        parse({**CHAT, "model": "gpt-4"}, chat=True, served="m")
    assert (err.value.status, err.value.code) == (404, "model_not_found")
    with pytest.raises(RequestError) as err:
        parse([1, 2], chat=True, served="m")
    assert err.value.status == 400


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
