"""core.c_json: the kept C encoder writes what its JSONEncoder would, and where json has no C
encoder (or one that takes other arguments), cost.py and routing.py fall back to that encoder."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.core import cost, routing
from sluice.core.c_json import c_encoder

VALUES: list[Any] = [
    {"b": [1, "é\u2028", {"a": None, "z": True}], "a": 1.5, "c": float("inf")},
    ["x", {"é": [{}, []]}],
    {"deep": [[[["\x00"]]]], "n": -3},
]


@pytest.mark.parametrize("value", VALUES)
def test_the_kept_encoders_write_what_their_json_encoder_does(value: Any) -> None:
    assert cost._C_ENCODE is not None and routing._CANONICAL is not None
    assert "".join(cost._C_ENCODE(value, 0)) == cost._encode(value)
    assert "".join(routing._CANONICAL(value, 0)) == routing._canonical(value)


def test_what_is_not_json_raises_what_json_dumps_raises() -> None:
    encode = c_encoder(ascii=False, item_sep=",", key_sep=":", allow_nan=True)
    with pytest.raises(TypeError):
        json.dumps({"a": object()})
    with pytest.raises(TypeError):
        "".join(encode({"a": object()}, 0))
    nan = c_encoder(ascii=False, item_sep=",", key_sep=":", allow_nan=False)
    with pytest.raises(ValueError):
        "".join(nan({"a": float("nan")}, 0))


def test_without_a_c_encoder_the_callers_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def other_signature(*args: Any) -> Any:
        raise TypeError("takes other arguments")

    monkeypatch.setattr(json.encoder, "c_make_encoder", other_signature)
    assert c_encoder(ascii=True, item_sep=", ", key_sep=": ", allow_nan=True) is None
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    assert c_encoder(ascii=False, item_sep=",", key_sep=":", allow_nan=True, sort_keys=True) is None
    body = {"messages": [{"role": "system", "content": VALUES[0]}, {"role": "user", "content": "hi"}]}
    kept_key, kept_chars = routing.prefix_key(body), cost._json_chars(VALUES[1])
    monkeypatch.setattr(cost, "_C_ENCODE", None)
    monkeypatch.setattr(routing, "_CANONICAL", None)
    assert routing.prefix_key(body) == kept_key
    assert cost._json_chars(VALUES[1]) == kept_chars == len(cost._encode(VALUES[1]))
