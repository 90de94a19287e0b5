"""Small helpers shared by the unit tests."""
from __future__ import annotations

import pytest

from liblip.protocol import ProtocolError


def code(fn) -> str:
    """The errno name of the ProtocolError `fn()` raises (the test fails if it does not)."""
    with pytest.raises(ProtocolError) as err:
        fn()
    return err.value.code
