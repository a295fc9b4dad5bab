"""A request's header read from its scope (sluice.api.headers) is what starlette's Headers gives,
and the callers KeyRing keeps are the ones it would make again."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from sluice.api import auth
from sluice.api.auth import KeyRing, hash_key
from sluice.api.headers import header, headers
from sluice.config import load_settings
from sluice.config_tables import KeyConfig

RAW = [
    (b"host", b"127.0.0.1"),
    (b"x-priority", b"high"),
    (b"x-priority", b"low"),  # the first one counts, as in starlette
    (b"idempotency-key", b"caf\xe9"),  # latin-1, as starlette decodes it
    (b"x-stainless-retry-count", b""),
]


@pytest.mark.parametrize(
    "name", ["host", "x-priority", "idempotency-key", "x-stainless-retry-count", "authorization", "x-absent"]
)
def test_a_header_is_what_starlette_reads(name: str) -> None:
    request = Request({"type": "http", "headers": RAW})
    assert header(request, name.encode()) == request.headers.get(name)


def test_headers_read_in_one_scan_are_what_header_reads() -> None:
    """Duplicates (the first counts), latin-1, empty and absent values, in the places asked."""
    request = Request({"type": "http", "headers": RAW})
    names = ["x-absent", "idempotency-key", "x-priority", "x-stainless-retry-count", "host"]
    found = headers(request, {name.encode(): place for place, name in enumerate(names)})
    assert found == [header(request, name.encode()) for name in names]
    assert found == [None, "caf\xe9", "high", "", "127.0.0.1"]


def _request(token: str | None) -> Request:
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return Request({"type": "http", "headers": headers})


async def test_open_mode_callers_are_kept_per_token_and_told_apart() -> None:
    ring = KeyRing(load_settings(environ={}))
    assert ring.open
    anonymous = await ring.authenticate(_request(None))
    first = await ring.authenticate(_request("sk-one"))
    assert first is await ring.authenticate(_request("sk-one"))
    other = await ring.authenticate(_request("sk-two"))
    assert (anonymous.tenant, first.tenant) == ("anonymous", "key-" + hash_key("sk-one")[:16])
    assert other.tenant != first.tenant
    assert not (anonymous.keyed or first.keyed or other.keyed)
    assert "sk-one" not in repr(ring._callers)  # digests only, never the token in clear


async def test_a_keys_caller_is_made_again_for_a_new_record(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = hash_key("sk-alice")
    ring = KeyRing(load_settings(overrides={"keys": [{"key_sha256": digest, "tenant": "alice"}]}, environ={}))
    alice = await ring.authenticate(_request("sk-alice"))
    assert alice is await ring.authenticate(_request("sk-alice"))
    assert (alice.tenant, alice.key_sha256, alice.limits.rpm) == ("alice", digest, None)
    # A key read again (from the store, with new limits) is a new record: its caller says so.
    ring._keys[digest] = KeyConfig(key_sha256=digest, tenant="alice", rpm=5)
    again = await ring.authenticate(_request("sk-alice"))
    assert again is not alice and again.limits.rpm == 5
    # Bounded: past CALLERS_KEPT the kept callers start over.
    monkeypatch.setattr(auth, "CALLERS_KEPT", 2)
    open_ring = KeyRing(load_settings(environ={}))
    for token in ("sk-a", "sk-b", "sk-c"):
        await open_ring.authenticate(_request(token))
    assert len(open_ring._callers) <= 2
