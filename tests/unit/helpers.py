"""Small helpers shared by the tests."""
from __future__ import annotations

import gc
import os

import pytest

from symphony_protocol import ProtocolError


def code(fn) -> str:
    """The errno name of the ProtocolError `fn()` raises (the test fails if it does not)."""
    with pytest.raises(ProtocolError) as err:
        fn()
    return err.value.code


def assert_same_weights(weights: dict, state_dict: dict, tied: bool) -> None:
    """`weights` (predd.model.loader's) are transformers' `state_dict`, name for name, to 1e-6;
    without `lm_head.weight` when the embeddings are `tied`."""
    expected = {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
    assert sorted(weights) == sorted(expected)
    for name, ref in expected.items():
        got = weights[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        assert (got - ref).abs().max().item() <= 1e-6, name


def secrets_file(tmp_path, text: str, mode: int = 0o600) -> str:
    """A keys file (predd's --auth-keys, the gateway's --api-keys) with `text`, `mode`."""
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def refused_before_loading(tmp_path, capsys, *flags: str) -> tuple[int, str]:
    """(exit status, last stderr line) of predd started with `flags` on a "model" that is
    not one: a refusal that comes before the model loads gets this far and no further."""
    from predd.__main__ import main
    model = tmp_path / "model.gguf"
    model.write_bytes(b"not a model: predd must stop before reading it")
    status = main(["--model", str(model), *flags, "--rundir", str(tmp_path),
                   "--addr", f"ipc://{tmp_path}/p.sock"])
    # main() turns garbage collection off while it loads: on again for the caller
    assert gc.isenabled()
    return status, capsys.readouterr().err.strip().splitlines()[-1]
