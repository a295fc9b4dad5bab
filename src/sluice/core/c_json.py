"""json's C encoder itself, made once, for the JSON text measured or hashed on every request.

``JSONEncoder.encode`` makes a C encoder for every call (in ``iterencode``), through two Python
methods; cost.py (a body's JSON length) and routing.py (a prefix's canonical hash) each keep one
made here instead, and call it as ``"".join(encoder(value, 0))``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def c_encoder(default: Callable[[Any], Any], key_separator: str, item_separator: str, sort_keys: bool) -> Any:
    """A C encoder with ``JSONEncoder``'s ``ensure_ascii=False``, no indent, ``skipkeys=False``,
    ``allow_nan=True``, and no check for circular references (what it encodes is a body parsed
    from JSON, which cannot refer to itself); None where json has no C encoder
    (``c_make_encoder`` is CPython's private API) or one that takes other arguments: the caller
    then uses a ``JSONEncoder``'s ``encode``."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        return make(
            None,
            default,
            json.encoder.encode_basestring,
            None,
            key_separator,
            item_separator,
            sort_keys,
            False,
            True,
        )
    except TypeError:
        return None
