"""Who is calling: API keys (kept as SHA-256 hashes) mapped to tenants and their limits."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.requests import HTTPConnection

from sluice.api.errors import APIError
from sluice.api.headers import header
from sluice.broker.base import Broker
from sluice.config import Settings
from sluice.config_tables import KeyConfig
from sluice.core.ratelimit import TenantLimits


@dataclass(frozen=True)
class Caller:
    """The authenticated caller of one request."""

    limits: TenantLimits
    admin: bool = False
    webhook_secret: str | None = None
    max_connections: int | None = None
    #: False in open mode: with no keys there is nobody to hold to a per-key connection cap
    keyed: bool = True
    #: SHA-256 of the key that authenticated the call (None in open mode); its jobs carry it, so
    #: that their webhooks are signed with this key's secret and no other
    key_sha256: str | None = None

    @property
    def tenant(self) -> str:
        return self.limits.tenant


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(request: HTTPConnection) -> str | None:
    auth = header(request, b"authorization") or ""
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


# A key deleted from the store stops working within this many seconds on every gateway.
STORED_KEY_CACHE_S = 5.0
# The most callers kept made (see KeyRing._callers): a flood of distinct tokens cannot grow it.
CALLERS_KEPT = 10_000


class KeyRing:
    """The keys of the config file, and those stored in the broker when ``key_store`` is on.

    With neither, the gateway runs in open mode.
    """

    def __init__(self, settings: Settings, broker: Broker | None = None) -> None:
        self.settings = settings
        self.broker = broker
        self._keys: dict[str, KeyConfig] = {k.key_sha256: k for k in settings.keys}
        self._stored: dict[str, tuple[float, KeyConfig | None]] = {}
        #: the Caller made for each key's digest (in open mode, each token's), beside the KeyConfig
        #: it was made from (None in open mode), so that a request does not make two new records
        #: (the Caller, its TenantLimits) that are the same every time; neither changes once made,
        #: and a key read again from the store is a new KeyConfig, which makes a new Caller
        self._callers: dict[str, tuple[KeyConfig | None, Caller]] = {}
        self._anonymous = Caller(TenantLimits("anonymous"), keyed=False)

    @property
    def open(self) -> bool:
        return not self._keys and not self.settings.key_store

    async def _lookup(self, digest: str, *, fresh: bool = False) -> KeyConfig | None:
        key = self._keys.get(digest)
        if key is not None or self.broker is None or not self.settings.key_store:
            return key
        now = time.monotonic()
        hit = self._stored.get(digest)
        if hit is not None and hit[0] > now and not fresh:
            return hit[1]
        record = await self.broker.get_key(digest)
        found = KeyConfig.model_validate({**record, "key_sha256": digest}) if record else None
        if len(self._stored) > 10_000:
            self._stored.clear()  # bounded: a flood of wrong keys cannot grow it
        self._stored[digest] = (now + STORED_KEY_CACHE_S, found)
        return found

    def _caller(self, key: KeyConfig) -> Caller:
        made = self._callers.get(key.key_sha256)
        if made is not None and made[0] is key:
            return made[1]
        limits = TenantLimits(
            tenant=key.tenant,
            max_priority=key.max_priority,
            weight=key.weight,
            rpm=key.rpm,
            tpm=key.tpm,
            max_concurrent=key.max_concurrent,
            max_queued=key.max_queued,
            # The key's buckets are its own, named by its hash: a tenant's other keys cannot reset
            # them, and a change of this key's limits keeps their levels (docs/security.md).
            key=key.key_sha256,
        )
        found = Caller(limits, key.admin, key.webhook_secret, key.max_connections, key_sha256=key.key_sha256)
        self._keep(key.key_sha256, key, found)
        return found

    def _open_caller(self, token: str | None) -> Caller:
        """Open mode's caller: told apart by its bearer token, never kept in clear."""
        if not token:
            return self._anonymous
        digest = hash_key(token)
        made = self._callers.get(digest)
        if made is not None:
            return made[1]
        found = Caller(TenantLimits("key-" + digest[:16]), keyed=False)
        self._keep(digest, None, found)
        return found

    def _keep(self, digest: str, key: KeyConfig | None, made: Caller) -> None:
        if len(self._callers) >= CALLERS_KEPT:
            self._callers.clear()
        self._callers[digest] = (key, made)

    async def lookup(self, key_sha256: str) -> KeyConfig | None:
        """The key whose SHA-256 this is, configured or stored (read as requests read it); None if
        there is none."""
        return await self._lookup(key_sha256)

    async def still_valid(self, caller: Caller) -> bool:
        """Whether the caller's key still exists, asked of the store itself rather than the cache: an
        open stream asks every STORED_KEY_CACHE_S, so a revoked key's streams end within that time."""
        if not caller.keyed or caller.key_sha256 is None:
            return True
        return await self._lookup(caller.key_sha256, fresh=True) is not None

    async def authenticate(self, request: HTTPConnection) -> Caller:
        token = bearer(request)
        if self.open:
            return self._open_caller(token)
        if token is None:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                "missing_api_key",
                type="invalid_request_error",
            )
        key = await self._lookup(hash_key(token))
        if key is None:
            raise APIError(
                401, "Incorrect API key provided.", "invalid_api_key", type="invalid_request_error"
            )
        return self._caller(key)


async def caller(request: Request) -> Caller:
    """FastAPI dependency: the authenticated caller (401 otherwise)."""
    keyring: KeyRing = request.app.state.keyring
    found = await keyring.authenticate(request)
    request.state.caller = found
    return found


async def admin(request: Request) -> Caller:
    """FastAPI dependency for /admin: an admin key, and 404 for anyone else (the surface stays hidden)."""
    keyring: KeyRing = request.app.state.keyring
    found = await keyring.authenticate(request)
    if keyring.open or not found.admin:
        raise APIError(404, "Not Found", "not_found")
    return found


#: A route parameter of this type receives the authenticated caller.
Who = Annotated[Caller, Depends(caller)]
