"""The one assertion the protocol parsing tests share: a call fails with this code on this field."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from protocols.errors import ProtocolError


def protocol_error(call: Callable[[], Any], code: str, param: str | None = None) -> ProtocolError:
    """Run ``call``; it must raise ``ProtocolError`` with ``code`` (and ``param`` when given)."""
    with pytest.raises(ProtocolError) as e:
        call()
    assert e.value.code == code, e.value
    if param is not None:
        assert e.value.param == param, e.value
    return e.value
