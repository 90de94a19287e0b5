"""The packages' layers as their docstrings state them: the protocol package loads
neither the client library, ZeroMQ nor torch (any process may import it), predd
reaches the protocol without loading the client library, and the OpenAI LIP is an
ordinary program (liblip and the protocol only)."""
from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded(code: str) -> set[str]:
    """The top-level modules loaded after `code`, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\n"
                          "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"],
                         capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_the_protocol_package_loads_no_client_zmq_or_torch():
    loaded = _loaded("import symphony_protocol, symphony_protocol.descriptor")
    assert "symphony_protocol" in loaded and "msgpack" in loaded
    assert not loaded & {"liblip", "zmq", "torch", "numpy", "predd", "kvfsd", "gatewayd"}


@pytest.mark.parametrize("module", ["predd.server.loop", "predd.engine.core",
                                    "predd.__main__"])
def test_predd_does_not_load_the_client_library(module):
    loaded = _loaded(f"import {module}")
    assert "predd" in loaded and "symphony_protocol" in loaded
    assert "liblip" not in loaded


def test_the_openai_lip_loads_only_liblip_and_the_protocol():
    loaded = _loaded("import openai_lip.server, openai_lip.format, openai_lip.vocab")
    assert {"openai_lip", "liblip", "symphony_protocol"} <= loaded
    assert not loaded & {"gatewayd", "predd", "kvfsd", "torch", "fastapi"}
