"""json's C encoder itself, made once, for the JSON text written, measured or hashed per request.

``json.dumps`` and ``JSONEncoder.encode`` make a C encoder for every call (in ``iterencode``),
through two Python methods. protocol.py (chunks and bodies), cost.py (a body's JSON length) and
routing.py (a prefix's canonical hash) each keep one made here instead, and call it as
``"".join(encoder(value, 0))``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def c_encoder(
    *,
    ascii: bool,
    item_sep: str,
    key_sep: str,
    allow_nan: bool,
    sort_keys: bool = False,
    default: Callable[[Any], Any] | None = None,
) -> Any:
    """json.dumps' C encoder with these options (no indent, ``skipkeys=False``), made once, without
    the check for circular references: what it encodes was decoded from JSON (an engine's chunk, a
    broker's event, a request body), which cannot refer to itself. ``default`` None: JSONEncoder's,
    which raises json.dumps' TypeError for what is not JSON. None where json has no C encoder, or
    one that takes other arguments (``c_make_encoder`` is CPython's private API): the callers then
    use json.dumps or a JSONEncoder's ``encode`` itself."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    if default is None:
        default = json.JSONEncoder().default
    strings = json.encoder.encode_basestring_ascii if ascii else json.encoder.encode_basestring
    try:
        return make(None, default, strings, None, key_sep, item_sep, sort_keys, False, allow_nan)
    except TypeError:
        return None
