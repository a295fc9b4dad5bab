"""Webhooks: URL checks against SSRF, signatures, and deliveries to a real receiver on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import random
import shutil
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice import __version__
from sluice.core.job import JobError, JobState
from sluice.views import job_view
from sluice.webhooks import (
    CallbackRefused,
    CallbackUnresolvable,
    DeliveryAttempt,
    WebhookSender,
    blocked_reason,
    check_callback_url,
    default_resolver,
    sign,
    verify,
)
from tests.helpers import FakeClock, free_port, make_job

SECRET = "whsec_test"
PUBLIC_V4 = "93.184.216.34"
PUBLIC_V6 = "2606:2800:220:1:248:1893:25c8:1946"


def _is_ip(host: object) -> bool:
    try:
        ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host))
    except ValueError:
        return False
    return True


@pytest.fixture(autouse=True)
def no_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any lookup that could leave the machine: only IP literals and localhost (/etc/hosts) pass."""
    real = socket.getaddrinfo

    def guarded(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in (None, "localhost", b"localhost") and not _is_ip(host):
            raise AssertionError(f"a test tried to resolve {host!r} through the system resolver")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)


def static_resolver(table: dict[str, list[str]]) -> Callable[[str, int], Awaitable[list[str]]]:
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    return resolve


class SequenceResolver:
    """Answers one list per call (the last one repeats): a name whose DNS answer changes."""

    def __init__(self, *answers: list[str] | Exception) -> None:
        self.answers = answers
        self.calls = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


async def must_not_resolve(host: str, port: int) -> list[str]:
    raise AssertionError(f"the resolver was asked for {host!r}")


class Sleeps:
    """An injected sleep that records the backoff delays and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def finished_view(state: JobState = JobState.SUCCEEDED) -> dict[str, Any]:
    job = make_job()
    job.state = state
    job.attempts = 1
    job.finished_at = job.created_at + 1.5
    if state is JobState.SUCCEEDED:
        job.result = {"object": "chat.completion", "choices": [{"message": {"content": "héllo"}}]}
    else:
        job.error = JobError(f"the job {state.value}", type="server_error")
    return job_view(job)


# --- a receiver: HTTP/1.1 on loopback, scripted answers, every request recorded ------------------------


@dataclass
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    #: never answer (the sender must time out)
    hang: bool = False
    #: send a chunked body that never ends (the sender must stop reading)
    endless: bool = False


@dataclass
class Received:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.requests: list[Received] = []
        self.sni: list[str | None] = []
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def url(self, path: str = "/hook", host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, target, _ = head[0].split(" ", 2)
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name:
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.requests.append(Received(method, target, headers, body))
            answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
            if answer.hang:
                await asyncio.Event().wait()
            extra = "".join(f"{k}: {v}\r\n" for k, v in answer.headers.items())
            if answer.endless:
                writer.write(
                    f"HTTP/1.1 {answer.status} X\r\nTransfer-Encoding: chunked\r\n{extra}\r\n".encode()
                )
                chunk = b"x" * 65536
                while True:  # until the client hangs up
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
            writer.write(
                f"HTTP/1.1 {answer.status} X\r\nContent-Length: {len(answer.body)}\r\n"
                f"Connection: close\r\n{extra}\r\n".encode()
                + answer.body
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def cancel_handlers(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def receiver(*answers: Answer, tls: ssl.SSLContext | None = None) -> AsyncIterator[Receiver]:
    rec = Receiver(list(answers) or [Answer()])
    if tls is not None:

        def remember_sni(sock: Any, name: str | None, ctx: ssl.SSLContext) -> None:
            rec.sni.append(name)

        tls.sni_callback = remember_sni
    server = await asyncio.start_server(rec.handle, "127.0.0.1", 0, ssl=tls)
    rec.port = server.sockets[0].getsockname()[1]
    try:
        yield rec
    finally:
        server.close()
        await rec.cancel_handlers()
        await server.wait_closed()


def make_sender(**overrides: Any) -> WebhookSender:
    options: dict[str, Any] = {
        "allow_private": True,
        "backoff_base": 0.001,
        "backoff_cap": 0.01,
        "connect_timeout": 2.0,
        "timeout": 5.0,
        "sleep": Sleeps(),
        "clock": FakeClock(),
        "rng": random.Random(7),
    }
    options.update(overrides)
    return WebhookSender(**options)


# --- URL checks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://hooks.example/x", "http:// or https://"),
        ("javascript:alert(1)", "http:// or https://"),
        ("hooks.example/x", "http:// or https://"),
        ("http:///x", "no host"),
        ("http://", "no host"),
        ("https://user:pw@hooks.example/", "credentials"),
        ("https://user@hooks.example/", "credentials"),
        ("http://hooks.example:0/", "port 0"),
        ("http://hooks.example:65536/", "port 65536"),
        ("http://a b/", "not a valid host name"),
        ("http://hooks..example/", "not a valid host name"),
        ("http://999.1.1.1/", "(?i)invalid ipv4"),
        ("http://1.2.3.4.5/", "not a valid IPv4"),
        ("http://0x/", "not a valid IPv4"),
        ("http://08.0.0.1/", "(?i)invalid ipv4"),
        ("http://hooks.example/" + "a" * 3000, "longer than"),
    ],
)
async def test_malformed_urls_are_refused_before_any_lookup(url: str, message: str) -> None:
    with pytest.raises(CallbackRefused, match=message):
        await check_callback_url(url, resolver=must_not_resolve)
    with pytest.raises(CallbackRefused, match=message):
        await check_callback_url(url, allow_private=True, resolver=must_not_resolve)


LOOPBACK_URLS = [
    "http://localhost/",
    "http://localhost./",
    "http://LOCALHOST:8080/x",
    "http://api.localhost/",
    "http://127.0.0.1/",
    "http://127.0.0.1./",
    "http://127.1/",
    "http://2130706433/",
    "http://0x7f.1/",
    "http://0x7f000001/",
    "http://0177.1/",
    "http://017700000001/",
    "http://0x7f.0.0.0x1/",
    "http://[::1]:8080/",
    "http://[0:0:0:0:0:0:0:1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:7f00:1]/",
    "http://[2002:7f00:1::]/",
    "http://[64:ff9b::7f00:1]/",
]


@pytest.mark.parametrize("url", LOOPBACK_URLS)
async def test_loopback_in_every_notation_is_refused_with_the_default_resolver(url: str) -> None:
    with pytest.raises(CallbackRefused, match="loopback"):
        await check_callback_url(url)


async def test_four_part_octal_is_refused_outright_since_httpx_cannot_send_it() -> None:
    # ipaddress and httpx refuse leading zeros in dotted quads, where inet_aton reads octal.
    for allow_private in (False, True):
        with pytest.raises(CallbackRefused, match=r"(?i)invalid ipv4"):
            await check_callback_url(
                "http://0177.0.0.1/", allow_private=allow_private, resolver=must_not_resolve
            )


@pytest.mark.parametrize("url", LOOPBACK_URLS)
async def test_loopback_in_every_notation_is_allowed_for_local_development(url: str) -> None:
    addresses = await check_callback_url(url, allow_private=True)
    assert addresses
    assert all("loopback" in (blocked_reason(ip) or "") for ip in addresses)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://2130706433/", "127.0.0.1"),
        ("http://0x7f.1/", "127.0.0.1"),
        ("http://0300.0250.1/", "192.168.0.1"),
    ],
)
async def test_numeric_ipv4_forms_are_read_as_inet_aton_does(url: str, expected: str) -> None:
    assert await check_callback_url(url, allow_private=True, resolver=must_not_resolve) == [
        ipaddress.ip_address(expected)
    ]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[::ffff:169.254.169.254]/", "metadata"),
        ("http://[64:ff9b::a9fe:a9fe]/", "metadata"),
        ("http://169.254.1.1/", "link-local"),
        ("http://[fe80::1]/", "link-local"),
        ("http://10.0.0.1/", "private"),
        ("http://172.16.0.1/", "private"),
        ("http://172.31.255.255/", "private"),
        ("http://192.168.1.1/", "private"),
        ("http://[fd00::1]/", "private"),
        ("http://[fc00::1]/", "private"),
        ("http://100.64.0.1/", "carrier-grade"),
        ("http://100.127.255.254/", "carrier-grade"),
        ("http://0.0.0.0/", "unspecified"),
        ("http://0/", "unspecified"),
        ("http://[::]/", "unspecified"),
        ("http://224.0.0.1/", "multicast"),
        ("http://[ff02::1]/", "multicast"),
        ("http://[ff0e::1]/", "multicast"),
        ("http://240.0.0.1/", "reserved"),
        ("http://255.255.255.255/", "reserved"),
        ("http://192.0.2.1/", "private"),
        ("http://[64:ff9b:1::a00:1]/", "NAT64"),
    ],
)
async def test_non_public_literals_are_refused_with_the_reason(url: str, reason: str) -> None:
    with pytest.raises(CallbackRefused, match=reason):
        await check_callback_url(url, resolver=must_not_resolve)


@pytest.mark.parametrize(
    "url", [f"https://{PUBLIC_V4}/hook", f"http://[{PUBLIC_V6}]:8443/", f"https://[::ffff:{PUBLIC_V4}]/"]
)
async def test_public_literals_are_accepted_without_a_lookup(url: str) -> None:
    (ip,) = await check_callback_url(url, resolver=must_not_resolve)
    assert blocked_reason(ip) is None


async def test_international_names_are_resolved_and_sent_in_idna_form() -> None:
    resolver = SequenceResolver(["127.0.0.1"])
    names: list[str] = []

    async def recording(host: str, port: int) -> list[str]:
        names.append(host)
        return await resolver(host, port)

    assert await check_callback_url("https://bücher.example/", resolver=recording, allow_private=True)
    async with receiver() as rec, make_sender(resolver=recording) as sender:
        attempts = await sender.deliver(finished_view(), rec.url(host="bücher.example"), SECRET)
    assert [a.status for a in attempts] == [200]
    assert names == ["xn--bcher-kva.example"] * 2
    assert rec.requests[0].headers["host"] == f"xn--bcher-kva.example:{rec.port}"


async def test_the_default_resolver_resolves_localhost_to_loopback() -> None:
    addresses = await default_resolver("localhost", 80)
    assert addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses)


async def test_localhost_names_are_loopback_whatever_the_resolver_says() -> None:
    lying = static_resolver({"localhost": [PUBLIC_V4], "localhost.": [PUBLIC_V4], "a.localhost": [PUBLIC_V4]})
    for url in ("http://localhost/", "http://localhost./", "http://a.localhost/"):
        with pytest.raises(CallbackRefused, match="loopback"):
            await check_callback_url(url, resolver=lying)


RESOLVER_TABLE = {
    "hooks.example": [PUBLIC_V4, PUBLIC_V6],
    "evil.example": ["10.0.0.5"],
    "metadata.example": ["169.254.169.254"],
    "cgnat.example": ["100.64.1.1"],
    "mapped.example": ["::ffff:10.0.0.1"],
    "ula.example": ["fd12:3456::1"],
    "mixed.example": [PUBLIC_V4, "192.168.0.10"],
    "mixed6.example": [PUBLIC_V6, "::1"],
    "empty.example": [],
    "garbage.example": ["not-an-address"],
}
RESOLVER = static_resolver(RESOLVER_TABLE)


async def test_a_public_name_is_accepted_and_its_addresses_returned() -> None:
    addresses = await check_callback_url("https://hooks.example/hook", resolver=RESOLVER)
    assert addresses == [ipaddress.ip_address(PUBLIC_V4), ipaddress.ip_address(PUBLIC_V6)]


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("evil.example", "resolves to a private address$"),
        ("metadata.example", "metadata"),
        ("cgnat.example", "carrier-grade"),
        ("mapped.example", "resolves to a private address$"),
        ("ula.example", "private"),
        ("mixed.example", "resolves to a private address$"),
        ("mixed6.example", "loopback"),
        ("unknown.example", "does not resolve"),
        ("empty.example", "does not resolve"),
        ("garbage.example", "non-address"),
    ],
)
async def test_names_resolving_to_any_non_public_address_are_refused(host: str, reason: str) -> None:
    with pytest.raises(CallbackRefused, match=reason) as info:
        await check_callback_url(f"https://{host}/hook", resolver=RESOLVER)
    assert "callback" in str(info.value)


@pytest.mark.parametrize("host", [h for h in RESOLVER_TABLE if h != "hooks.example"] + ["unknown.example"])
async def test_a_refusal_never_names_what_a_name_resolves_to(host: str) -> None:
    """No DNS oracle: whoever submits a callback URL learns that it is refused and the kind of
    address (private, loopback...), never the address itself nor the resolver's answer."""
    with pytest.raises(CallbackRefused) as info:
        await check_callback_url(f"https://{host}/hook", resolver=RESOLVER)
    message = str(info.value)
    for answer in RESOLVER_TABLE.get(host, []):
        assert answer not in message
    for form in ("10.0.0.1", "a00:1", "embedded"):  # mapped.example's address, in any form
        assert form not in message


async def test_allow_private_still_refuses_what_does_not_resolve() -> None:
    assert await check_callback_url("http://evil.example/", allow_private=True, resolver=RESOLVER) == [
        ipaddress.ip_address("10.0.0.5")
    ]
    with pytest.raises(CallbackUnresolvable):
        await check_callback_url("http://unknown.example/", allow_private=True, resolver=RESOLVER)


def test_callback_refused_is_a_value_error() -> None:
    assert issubclass(CallbackRefused, ValueError)
    assert issubclass(CallbackUnresolvable, CallbackRefused)


NON_PUBLIC = [
    "127.0.0.0/8",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "169.254.0.0/16",
    "100.64.0.0/10",
    "0.0.0.0/8",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "::1/128",
    "fc00::/7",
    "fe80::/10",
    "ff00::/8",
]


@st.composite
def non_public_addresses(draw: st.DrawFn) -> str:
    network = ipaddress.ip_network(draw(st.sampled_from(NON_PUBLIC)))
    ip = network[draw(st.integers(0, network.num_addresses - 1))]
    if isinstance(ip, ipaddress.IPv4Address) and draw(st.booleans()):
        return f"::ffff:{ip}"
    return str(ip)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(address=non_public_addresses(), also_public=st.booleans())
def test_any_address_in_a_non_public_network_is_refused(address: str, also_public: bool) -> None:
    answers = [PUBLIC_V4, address] if also_public else [address]
    resolver = static_resolver({"target.example": answers})
    with pytest.raises(CallbackRefused, match="resolves to"):
        asyncio.run(check_callback_url("https://target.example/", resolver=resolver))
    literal = f"[{address}]" if ":" in address else address
    with pytest.raises(CallbackRefused, match=" is "):
        asyncio.run(check_callback_url(f"https://{literal}/", resolver=must_not_resolve))


# --- signatures ---------------------------------------------------------------------------------------


def test_sign_is_hmac_sha256_of_timestamp_dot_body() -> None:
    body = b'{"type":"job.succeeded"}'
    expected = hmac.new(b"whsec_test", b"1767225600." + body, hashlib.sha256).hexdigest()
    assert sign(SECRET, 1767225600, body) == f"t=1767225600,v1={expected}"


@settings(max_examples=200, deadline=None)
@given(
    secret=st.text(min_size=1), timestamp=st.integers(0, 2**33), body=st.binary(), tolerance=st.floats(1, 1e4)
)
def test_verify_accepts_what_sign_makes_and_nothing_else(
    secret: str, timestamp: int, body: bytes, tolerance: float
) -> None:
    header = sign(secret, timestamp, body)
    assert verify(secret, header, body, now=timestamp, tolerance_s=tolerance)
    assert verify(secret, header, body, now=timestamp + tolerance / 2, tolerance_s=tolerance)
    assert verify(secret, header, body, now=timestamp - tolerance / 2, tolerance_s=tolerance)
    assert not verify(secret, header, body + b"x", now=timestamp, tolerance_s=tolerance)
    assert not verify(secret + "x", header, body, now=timestamp, tolerance_s=tolerance)
    assert not verify(secret, header, body, now=timestamp + tolerance + 1, tolerance_s=tolerance)
    assert not verify(secret, header, body, now=timestamp - tolerance - 1, tolerance_s=tolerance)


def test_verify_rejects_malformed_headers_without_raising() -> None:
    body = b"{}"
    good = sign(SECRET, 1000, body)
    digest = good.split("v1=")[1]
    for header in [
        "",
        "garbage",
        f"v1={digest}",
        "t=1000",
        f"t=abc,v1={digest}",
        f"t=-1000,v1={digest}",
        f"t=1000,t=1000,v1={digest}",
        "t=1000,v1=é",
        f"t=1000,v1={digest.upper()}x",
        f"t=1000,v1={digest}," + "x" * 5000,
    ]:
        assert verify(SECRET, header, body, now=1000) is False, header


def test_verify_accepts_any_matching_v1_for_secret_rotation() -> None:
    body = b"{}"
    new = sign(SECRET, 1000, body).split("v1=")[1]
    old = sign("old secret", 1000, body).split("v1=")[1]
    assert verify(SECRET, f"t=1000,v1={old},v1={new}", body, now=1000)
    assert verify("old secret", f"t=1000, v1={old}, v1={new}", body, now=1000)
    assert not verify("third", f"t=1000,v1={old},v1={new}", body, now=1000)


# --- deliveries ---------------------------------------------------------------------------------------


async def test_a_signed_delivery_reaches_the_receiver_and_verifies() -> None:
    view = finished_view()
    clock = FakeClock()
    async with receiver(Answer(200)) as rec, make_sender(clock=clock) as sender:
        attempts = await sender.deliver(view, rec.url("/hook?tenant=t1"), SECRET)
    assert [(a.attempt, a.status, a.error) for a in attempts] == [(1, 200, None)]
    assert attempts[0].ok and attempts[0].at == clock() and attempts[0].duration_ms >= 0
    (req,) = rec.requests
    assert (req.method, req.target) == ("POST", "/hook?tenant=t1")
    assert req.headers["content-type"] == "application/json"
    assert req.headers["user-agent"] == f"sluice-webhooks/{__version__}"
    assert req.headers["sluice-event"] == "job.succeeded"
    assert req.headers["sluice-delivery"].startswith("dlv_")
    assert req.headers["host"] == f"127.0.0.1:{rec.port}"
    assert json.loads(req.body) == {"type": "job.succeeded", "created": int(clock()), "data": view}
    signature = req.headers["sluice-signature"]
    assert signature.startswith(f"t={int(clock())},v1=")
    assert verify(SECRET, signature, req.body, now=clock())
    assert not verify(SECRET, signature, req.body.replace(b"succeeded", b"failed!!!"), now=clock())
    assert not verify("another secret", signature, req.body, now=clock())


@pytest.mark.parametrize("secret", [None, ""])
async def test_without_a_secret_the_delivery_is_unsigned(secret: str | None) -> None:
    async with receiver(Answer(204, body=b"")) as rec, make_sender() as sender:
        attempts = await sender.deliver(finished_view(), rec.url(), secret)
    assert [a.status for a in attempts] == [204]
    assert "sluice-signature" not in rec.requests[0].headers


@pytest.mark.parametrize("state", [JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED])
async def test_the_event_names_the_terminal_state(state: JobState) -> None:
    async with receiver() as rec, make_sender() as sender:
        await sender.deliver(finished_view(state), rec.url(), SECRET)
    (req,) = rec.requests
    assert req.headers["sluice-event"] == f"job.{state.value}"
    assert json.loads(req.body)["type"] == f"job.{state.value}"
    assert json.loads(req.body)["data"]["error"]["message"] == f"the job {state.value}"


async def test_server_errors_are_retried_with_jittered_backoff_until_success() -> None:
    sleeps = Sleeps()
    clock = FakeClock()
    logged: list[tuple[DeliveryAttempt, int]] = []
    answers = [Answer(500, body=b"boom"), Answer(503, body=b""), Answer(200)]
    async with receiver(*answers) as rec, make_sender(sleep=sleeps, clock=clock) as sender:

        async def on_attempt(attempt: DeliveryAttempt) -> None:
            logged.append((attempt, len(rec.requests)))
            clock.advance(30)  # so that each retry is signed with its own timestamp

        attempts = await sender.deliver(finished_view(), rec.url(), SECRET, on_attempt=on_attempt)
    assert [(a.attempt, a.status) for a in attempts] == [(1, 500), (2, 503), (3, 200)]
    assert [a.error for a in attempts] == ["HTTP 500: boom", "HTTP 503", None]
    # The log sees each attempt as it happens, before the next request goes out.
    assert logged == [(a, a.attempt) for a in attempts]
    assert len({r.headers["sluice-delivery"] for r in rec.requests}) == 1
    stamps = [r.headers["sluice-signature"].split(",")[0] for r in rec.requests]
    assert len(set(stamps)) == 3
    for req, attempt in zip(rec.requests, attempts, strict=True):
        assert verify(SECRET, req.headers["sluice-signature"], req.body, now=attempt.at)
    assert len(rec.requests) == 3 and rec.requests[0].body == rec.requests[2].body
    assert len(sleeps.delays) == 2
    assert 0 <= sleeps.delays[0] <= 0.001 and 0 <= sleeps.delays[1] <= 0.002


async def test_delivery_gives_up_after_max_attempts() -> None:
    sleeps = Sleeps()
    async with receiver(Answer(502)) as rec, make_sender(max_attempts=3, sleep=sleeps) as sender:
        attempts = await sender.deliver(finished_view(), rec.url(), SECRET)
    assert [a.status for a in attempts] == [502, 502, 502]
    assert not any(a.ok for a in attempts)
    assert len(rec.requests) == 3 and len(sleeps.delays) == 2


@pytest.mark.parametrize("status", [400, 401, 404, 410, 422])
async def test_client_errors_are_not_retried(status: int) -> None:
    sleeps = Sleeps()
    answers = [Answer(status, body=b'{"error": "bad\nsignature"}'), Answer(200)]
    async with receiver(*answers) as rec, make_sender(sleep=sleeps) as sender:
        attempts = await sender.deliver(finished_view(), rec.url(), SECRET)
    assert [(a.status, a.error) for a in attempts] == [
        (status, f'HTTP {status}: {{"error": "bad signature"}}')
    ]
    assert len(rec.requests) == 1 and sleeps.delays == []


async def test_429_waits_for_retry_after_but_no_longer_than_the_cap() -> None:
    sleeps = Sleeps()
    answers = [Answer(429, {"Retry-After": "2"}), Answer(429, {"Retry-After": "3600"}), Answer(200)]
    async with receiver(*answers) as rec, make_sender(sleep=sleeps, backoff_cap=5.0) as sender:
        attempts = await sender.deliver(finished_view(), rec.url(), SECRET)
    assert [a.status for a in attempts] == [429, 429, 200]
    assert sleeps.delays == [2.0, 5.0]


async def test_redirects_are_failures_and_not_followed() -> None:
    sleeps = Sleeps()
    answers = [Answer(302, {"Location": "/elsewhere"}), Answer(200)]
    async with receiver(*answers) as rec, make_sender(sleep=sleeps) as sender:
        attempts = await sender.deliver(finished_view(), rec.url(), SECRET)
    assert [(a.status, a.ok) for a in attempts] == [(302, False)]
    assert attempts[0].error == "HTTP 302: redirect to '/elsewhere' not followed"
    assert [r.target for r in rec.requests] == ["/hook"]
    assert sleeps.delays == []


async def test_connection_errors_are_retried() -> None:
    url = f"http://127.0.0.1:{free_port()}/hook"
    sleeps = Sleeps()
    async with make_sender(max_attempts=3, sleep=sleeps) as sender:
        attempts = await sender.deliver(finished_view(), url, SECRET)
    assert [a.status for a in attempts] == [None, None, None]
    assert all(a.error is not None and a.error.startswith("ConnectError") for a in attempts)
    assert len(sleeps.delays) == 2


async def test_a_receiver_that_never_answers_times_out_and_is_retried() -> None:
    async with receiver(Answer(hang=True)) as rec, make_sender(max_attempts=2, timeout=0.3) as sender:
        async with asyncio.timeout(5):
            attempts = await sender.deliver(finished_view(), rec.url(), SECRET)
    assert [(a.status, a.error) for a in attempts] == [(None, "timed out after 0.3 s")] * 2
    assert len(rec.requests) == 2
    assert all(250 <= a.duration_ms < 2000 for a in attempts)


async def test_the_response_body_is_read_only_up_to_the_limit() -> None:
    sender = make_sender(max_attempts=1, timeout=3.0, max_response_bytes=1000)
    async with receiver(Answer(500, endless=True)) as rec, sender:
        attempts = await sender.deliver(finished_view(), rec.url(), SECRET)
    (attempt,) = attempts
    # Reading the endless body to the end would have ended in a timeout instead.
    assert attempt.status == 500
    assert attempt.error is not None and attempt.error.startswith("HTTP 500: ")
    assert len(attempt.error) <= len("HTTP 500: ") + 200


async def test_a_loopback_receiver_is_refused_without_allow_private() -> None:
    sleeps = Sleeps()
    async with receiver() as rec, make_sender(allow_private=False, sleep=sleeps) as sender:
        for url in (rec.url(), rec.url(host="localhost"), rec.url(host="[::1]"), rec.url(host="0x7f.1")):
            attempts = await sender.deliver(finished_view(), url, SECRET)
            assert [a.status for a in attempts] == [None]
            assert attempts[0].error is not None and attempts[0].error.startswith("refused: ")
            assert "loopback" in attempts[0].error
    assert rec.requests == [] and sleeps.delays == []


@pytest.mark.parametrize("host", ["localhost", "2130706433", "0x7f.1", "127.1"])
async def test_a_loopback_receiver_is_reached_with_allow_private(host: str) -> None:
    async with receiver() as rec, make_sender(allow_private=True) as sender:
        attempts = await sender.deliver(finished_view(), rec.url(host=host), SECRET)
    assert [a.status for a in attempts] == [200]
    assert rec.requests[0].headers["host"] == f"{host}:{rec.port}"


async def test_dns_rebinding_between_check_and_delivery_is_refused() -> None:
    resolver = SequenceResolver([PUBLIC_V4], ["127.0.0.1"])
    async with receiver() as rec:
        url = rec.url(host="rebind.example")
        assert await check_callback_url(url, resolver=resolver) == [ipaddress.ip_address(PUBLIC_V4)]
        async with make_sender(allow_private=False, resolver=resolver) as sender:
            attempts = await sender.deliver(finished_view(), url, SECRET)
    assert [a.status for a in attempts] == [None]
    assert attempts[0].error == "refused: the callback host 'rebind.example' resolves to a loopback address"
    assert rec.requests == [] and resolver.calls == 2


async def test_every_attempt_resolves_again_and_connects_to_the_checked_address() -> None:
    resolver = SequenceResolver(["127.0.0.1"])
    async with receiver(Answer(500), Answer(200)) as rec, make_sender(resolver=resolver) as sender:
        # The name exists only in the injected resolver (and the no_dns guard fails any system lookup):
        # reaching the receiver proves the connection went to the address, with the name in Host.
        attempts = await sender.deliver(finished_view(), rec.url(host="hooks.example"), SECRET)
    assert [a.status for a in attempts] == [500, 200]
    assert resolver.calls == 2
    assert [r.headers["host"] for r in rec.requests] == [f"hooks.example:{rec.port}"] * 2


async def test_the_next_address_is_tried_when_one_refuses_the_connection() -> None:
    # Linux routes all of 127/8 to loopback; the receiver listens on 127.0.0.1 only.
    resolver = SequenceResolver(["127.0.0.2", "127.0.0.1"])
    async with receiver() as rec, make_sender(resolver=resolver) as sender:
        attempts = await sender.deliver(finished_view(), rec.url(host="hooks.example"), SECRET)
    assert [a.status for a in attempts] == [200]
    assert len(rec.requests) == 1


async def test_a_name_that_stops_resolving_is_retried() -> None:
    resolver = SequenceResolver(socket.gaierror(socket.EAI_AGAIN, "Temporary failure"), ["127.0.0.1"])
    async with receiver() as rec, make_sender(resolver=resolver) as sender:
        attempts = await sender.deliver(finished_view(), rec.url(host="hooks.example"), SECRET)
    assert [a.status for a in attempts] == [None, 200]
    assert attempts[0].error is not None and "does not resolve" in attempts[0].error
    assert len(rec.requests) == 1


async def test_on_attempt_failures_do_not_stop_the_delivery() -> None:
    async def broken_log(attempt: DeliveryAttempt) -> None:
        raise RuntimeError("the log is down")

    async with receiver(Answer(500), Answer(200)) as rec, make_sender() as sender:
        attempts = await sender.deliver(finished_view(), rec.url(), SECRET, on_attempt=broken_log)
    assert [a.status for a in attempts] == [500, 200]


async def test_each_delivery_has_its_own_id_unless_one_is_given() -> None:
    async with receiver() as rec, make_sender() as sender:
        await sender.deliver(finished_view(), rec.url(), SECRET)
        await sender.deliver(finished_view(), rec.url(), SECRET)
        await sender.deliver(finished_view(), rec.url(), SECRET, delivery_id="dlv_fixed")
    ids = [r.headers["sluice-delivery"] for r in rec.requests]
    assert ids[0] != ids[1] and ids[2] == "dlv_fixed"


async def test_deliver_needs_an_open_sender_and_a_finished_job() -> None:
    sender = make_sender()
    with pytest.raises(RuntimeError, match="async context manager"):
        await sender.deliver(finished_view(), "https://hooks.example/", SECRET)
    async with sender:
        with pytest.raises(ValueError, match="not a terminal state"):
            await sender.deliver(job_view(make_job()), "https://hooks.example/", SECRET)


def test_delivery_attempts_serialize_for_the_job_log() -> None:
    attempt = DeliveryAttempt(attempt=2, at=1767225600.5, status=503, error="HTTP 503", duration_ms=12.5)
    assert json.loads(json.dumps(attempt.to_dict())) == {
        "attempt": 2,
        "at": 1767225600.5,
        "status": 503,
        "error": "HTTP 503",
        "duration_ms": 12.5,
    }
    assert not attempt.ok and DeliveryAttempt(1, 0.0, 200, None, 1.0).ok


@settings(max_examples=200, deadline=None)
@given(attempt=st.integers(1, 40), seed=st.integers(0, 2**32))
def test_backoff_is_full_jitter_under_the_exponential_ceiling_and_the_cap(attempt: int, seed: int) -> None:
    sender = WebhookSender(backoff_base=1.0, backoff_factor=2.0, backoff_cap=60.0, rng=random.Random(seed))
    delay = sender.backoff(attempt)
    assert 0 <= delay <= min(60.0, 2.0 ** (attempt - 1))
    assert sender.backoff(attempt, retry_after=7200) == 60.0


def test_defaults() -> None:
    sender = WebhookSender()
    assert (sender.max_attempts, sender.backoff_base, sender.backoff_factor, sender.backoff_cap) == (
        6,
        1,
        2,
        60,
    )
    assert sender.timeout == 10.0 and not sender.allow_private
    with pytest.raises(ValueError):
        WebhookSender(max_attempts=0)


# --- TLS: the connection goes to the address, the certificate is checked against the name ------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    (d / "ext.cnf").write_text(
        "subjectAltName=DNS:hooks.example\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    commands = [
        f"openssl req -x509 {ec} -keyout ca.key -out ca.pem -days 2 -subj /CN=SluiceTestCA"
        " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign",
        f"openssl req {ec} -keyout leaf.key -out leaf.csr -subj /CN=hooks.example",
        "openssl x509 -req -in leaf.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out leaf.pem -days 2"
        " -extfile ext.cnf",
    ]
    for command in commands:
        subprocess.run(command.split(), cwd=d, check=True, capture_output=True, timeout=30)
    yield d


def tls_pair(d: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "leaf.pem", d / "leaf.key")
    client = ssl.create_default_context(cafile=str(d / "ca.pem"))
    return server, client


async def test_https_connects_to_the_address_but_verifies_the_name(certificates: Path) -> None:
    server_tls, client_tls = tls_pair(certificates)
    resolver = static_resolver({"hooks.example": ["127.0.0.1"]})
    async with (
        receiver(tls=server_tls) as rec,
        make_sender(resolver=resolver, ssl_context=client_tls) as sender,
    ):
        attempts = await sender.deliver(
            finished_view(), rec.url(host="hooks.example", scheme="https"), SECRET
        )
    assert [a.status for a in attempts] == [200]
    assert rec.sni == ["hooks.example"]
    assert rec.requests[0].headers["host"] == f"hooks.example:{rec.port}"
    assert verify(
        SECRET, rec.requests[0].headers["sluice-signature"], rec.requests[0].body, now=FakeClock()()
    )


async def test_https_to_a_name_the_certificate_does_not_cover_fails(certificates: Path) -> None:
    server_tls, client_tls = tls_pair(certificates)
    resolver = static_resolver({"other.example": ["127.0.0.1"]})
    sender = make_sender(resolver=resolver, ssl_context=client_tls, max_attempts=1)
    async with receiver(tls=server_tls) as rec, sender:
        attempts = await sender.deliver(
            finished_view(), rec.url(host="other.example", scheme="https"), SECRET
        )
    (attempt,) = attempts
    assert attempt.status is None
    assert attempt.error is not None and "CERTIFICATE_VERIFY_FAILED" in attempt.error
    assert rec.sni == ["other.example"] and rec.requests == []
