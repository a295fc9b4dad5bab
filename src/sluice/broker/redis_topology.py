"""What a Redis broker URL says: one Redis, a primary that Sentinel watches, or a Redis Cluster; and
how durable an acknowledged write must be there (docs/redis.md).

    redis://[[user]:password@]host[:port][/db]          one Redis (``rediss://`` for TLS)
    unix://[[user]:password@]/path/to/redis.sock[?db=N]  one Redis on a Unix socket
    redis+sentinel://[[user]:password@]host:port[,host:port...]/master_name[/db][?options]
    redis+cluster://[[user]:password@]host:port[,host:port...][?spread=models|none]

A Sentinel URL lists sentinels (not Redis servers) and names the master they watch; its user and
password are the data nodes', and its options are ``db``, ``password``, ``username`` (the same
again, as query parameters) and ``sentinel_password`` / ``sentinel_username`` (the sentinels' own
ACL, when they have one). A Cluster URL lists any few nodes of the cluster (the rest are found from
them); a cluster has only database 0. Its ``spread`` option says whether each model's queue gets a
hash tag of its own, so that models spread over the masters (``models``, the default), or the whole
queue keeps one tag and one master (``none``: a tenant's limits then span its models atomically).

This module only reads URLs and holds the durability rule; it does no I/O and does not import the
Redis client (``redis_pipe`` builds the connections), so that the settings can name its defaults.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qsl, unquote

#: How long ``WAIT`` may take for the replicas to confirm a write, by default (milliseconds): a
#: replica on the same network confirms within a millisecond, so this is only ever reached when one
#: is gone or far behind, and then the write is answered 503 rather than late.
DEFAULT_WAIT_TIMEOUT_MS: Final = 1000
#: Replicas that must confirm an admission when the setting is left unset: with Sentinel or Cluster,
#: where a replica takes over from a lost primary, one; with a single Redis, none.
REPLICATED_MIN_REPLICAS: Final = 1

SENTINEL_PORT: Final = 26379
REDIS_PORT: Final = 6379

#: The URL schemes the Redis broker takes, for the settings' checks.
SCHEMES: Final = ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://")

_SENTINEL_OPTIONS = frozenset({"db", "password", "username", "sentinel_password", "sentinel_username"})
_CLUSTER_OPTIONS = frozenset({"password", "username", "spread"})
#: The values of a Cluster URL's ``spread`` option: a hash tag per model, or one for the whole queue.
SPREAD_VALUES: Final = ("models", "none")


class Kind(enum.Enum):
    """How the broker finds the Redis it writes to."""

    #: one server, at the URL's address
    SINGLE = "single"
    #: the primary that the sentinels name, asked again after every lost connection
    SENTINEL = "sentinel"
    #: the master of the queue's hash slot, found from the cluster's nodes
    CLUSTER = "cluster"


@dataclass(frozen=True)
class Topology:
    """A parsed broker URL.

    Attributes:
        kind: one Redis, Sentinel or Cluster.
        url: the URL as given; a single Redis's is read again by the Redis client itself.
        nodes: the sentinels (``SENTINEL``) or the cluster's seed nodes (``CLUSTER``) as (host,
            port); empty for a single Redis.
        service: the master's name the sentinels know it by (``SENTINEL`` only).
        db: the database number (0 on a cluster).
        username: the data nodes' ACL user, if any.
        password: the data nodes' password, if any.
        sentinel_username: the sentinels' own ACL user, if any.
        sentinel_password: the sentinels' own password, if any.
        spread: whether the queue's models are spread over the cluster's masters, a hash tag per
            model (``redis_shards``); False on one Redis and with Sentinel (one primary).
    """

    kind: Kind
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    spread: bool = False

    @property
    def replicated(self) -> bool:
        """Whether a replica takes over when the primary is lost (Sentinel, Cluster)."""
        return self.kind is not Kind.SINGLE

    def describe(self) -> str:
        """Where the broker is, for logs: addresses and names, never a password."""
        if self.kind is Kind.SINGLE:
            return "one Redis"
        nodes = ",".join(f"{h}:{p}" for h, p in self.nodes)
        if self.kind is Kind.SENTINEL:
            return f"master {self.service!r} of the sentinels {nodes}"
        return f"the Redis Cluster of {nodes}"


@dataclass(frozen=True)
class Durability:
    """When a write the broker makes durable (an admission, a settlement, a cancel) is answered.

    Attributes:
        replicas: how many replicas must confirm the write (``WAIT``) before it is answered; 0:
            answered once the primary has it (and its AOF, as configured).
        timeout_ms: how long ``WAIT`` waits for them; when fewer confirm in time, the caller gets
            :class:`~sluice.broker.base.BrokerUnavailable` (an HTTP 503 with Retry-After).
    """

    replicas: int = 0
    timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be 0 or more, not {self.replicas}")
        if self.timeout_ms < 1:  # WAIT 0 would wait for ever
            raise ValueError(f"the WAIT timeout must be at least 1 ms, not {self.timeout_ms}")

    @property
    def on(self) -> bool:
        return self.replicas > 0

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000


def durability_for(topology: Topology, min_replicas: int | None, timeout_ms: int) -> Durability:
    """The durability asked for: ``min_replicas`` when set, else one replica where one takes over
    from a lost primary (Sentinel, Cluster) and none on a single Redis."""
    if min_replicas is None:
        min_replicas = REPLICATED_MIN_REPLICAS if topology.replicated else 0
    return Durability(min_replicas, timeout_ms)


def parse_broker_url(url: str) -> Topology:
    """The topology a broker URL names; :class:`ValueError` says what is wrong with one."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a Redis URL: {url!r}")
    scheme = scheme.lower()
    if scheme in ("redis", "rediss", "unix"):
        return Topology(Kind.SINGLE, url)
    if scheme in ("rediss+sentinel", "rediss+cluster"):
        raise ValueError(f"{scheme}:// (TLS) is not supported yet: use redis+sentinel:// or redis+cluster://")
    if scheme not in ("redis+sentinel", "redis+cluster"):
        raise ValueError(f"unknown Redis URL scheme {scheme!r}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    if scheme == "redis+sentinel":
        allowed, default_port = _SENTINEL_OPTIONS, SENTINEL_PORT
    else:
        allowed, default_port = _CLUSTER_OPTIONS, REDIS_PORT
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} in a {scheme}:// URL")
    nodes = _nodes(hosts, default_port)
    username = options.get("username", username) or None
    password = options.get("password", password) or None
    if scheme == "redis+cluster":
        if path.strip("/") not in ("", "0"):
            raise ValueError("a Redis Cluster has only database 0: give redis+cluster://HOST:PORT[,...]")
        spread = options.get("spread", "models")
        if spread not in SPREAD_VALUES:
            raise ValueError(f"spread= takes {' or '.join(SPREAD_VALUES)}, not {spread!r}")
        return Topology(
            Kind.CLUSTER, url, nodes, username=username, password=password, spread=spread == "models"
        )
    service, _, db_part = path.partition("/")
    service = unquote(service)
    if not service:
        raise ValueError("a redis+sentinel:// URL names the master: redis+sentinel://HOST:PORT[,...]/NAME")
    db_text = options.get("db", db_part.strip("/") or "0")
    if not db_text.isdigit():
        raise ValueError(f"the database must be a number, not {db_text!r}")
    return Topology(
        Kind.SENTINEL,
        url,
        nodes,
        service=service,
        db=int(db_text),
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username") or None,
        sentinel_password=options.get("sentinel_password") or None,
    )


def _nodes(hosts: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """``host:port,host:port`` (``[v6]:port`` for IPv6) as (host, port) pairs."""
    nodes = []
    for item in hosts.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("["):  # [::1]:26379
            host, close, tail = item[1:].partition("]")
            if not close or (tail and not tail.startswith(":")):
                raise ValueError(f"bad address {item!r}")
            port_text = tail[1:]
        else:
            host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        if not host:
            raise ValueError(f"bad address {item!r}")
        if port_text and not port_text.isdigit():
            raise ValueError(f"bad port in {item!r}")
        port = int(port_text) if port_text else default_port
        if not 0 < port < 65536:
            raise ValueError(f"bad port in {item!r}")
        nodes.append((host, port))
    if not nodes:
        raise ValueError("the URL lists no host:port")
    return tuple(nodes)
