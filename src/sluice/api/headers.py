"""A request's header, read from its ASGI scope.

starlette's ``request.headers.get(name)`` builds a ``Headers`` view, lowercases and encodes the
name, and for a header the request does not carry raises a ``KeyError`` inside ``Mapping.get``
and catches it again. A request to the hot routes asks for seven headers it almost never carries
(``x-priority``, ``x-request-timeout``, ``idempotency-key``, the SDKs' time-outs and retry count,
``authorization`` in open mode), each one an exception raised and caught that way; a scan of the
raw headers gives the same value without one (docs/benchmarks/overhead.md, the fifth round).
"""

from __future__ import annotations

from starlette.requests import HTTPConnection


def header(connection: HTTPConnection, name: bytes) -> str | None:
    """The first value of the header ``name`` (lowercase, as ASGI servers give the names), decoded
    as latin-1 as starlette decodes it; None if the request has none."""
    for key, value in connection.scope["headers"]:
        if key == name:
            return value.decode("latin-1")  # type: ignore[no-any-return]
    return None


def headers(connection: HTTPConnection, names: dict[bytes, int]) -> list[str | None]:
    """The first value of each header of ``names`` (lowercase name -> its place in the answer), as
    :func:`header` reads each, in one scan of the raw headers: one call for all of them, where a
    :func:`header` per name is a call and a scan each (a chat request's job reads five)."""
    found: list[str | None] = [None] * len(names)
    for key, value in connection.scope["headers"]:
        if key in names:
            place = names[key]
            if found[place] is None:
                found[place] = value.decode("latin-1")
    return found
