"""The parts of a request's path that the gateway's fifth round (docs/benchmarks/overhead.md)
changed, timed alone in the tree this runs in: the headers a chat request reads, the caller's
authentication in open mode, and a whole answer made and sent. Copied into an older tree, it times
that tree's way of doing the same (found by what the tree has), so that two trees compare.

Each figure is the best of ``--repeat`` runs of ``--number`` calls, in µs a call, for the bench's
request (three headers) and for an OpenAI SDK's (17 headers, a bearer token).

Usage: python -m sluice.bench.overhead_parts [--number 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import timeit
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.requests import Request
from starlette.types import Message

from sluice.api import auth, gateway, relay
from sluice.config import load_settings
from sluice.core.job import Endpoint, Job, JobState

BENCH = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"), (b"content-length", b"96")]
SDK = [
    (b"host", b"127.0.0.1:8000"),
    (b"accept-encoding", b"gzip, deflate"),
    (b"connection", b"keep-alive"),
    (b"accept", b"application/json"),
    (b"content-type", b"application/json"),
    (b"user-agent", b"AsyncOpenAI/Python 1.99.0"),
    (b"x-stainless-lang", b"python"),
    (b"x-stainless-package-version", b"1.99.0"),
    (b"x-stainless-os", b"Linux"),
    (b"x-stainless-arch", b"x64"),
    (b"x-stainless-runtime", b"CPython"),
    (b"x-stainless-runtime-version", b"3.11.7"),
    (b"authorization", b"Bearer sk-local"),
    (b"x-stainless-async", b"async:asyncio"),
    (b"x-stainless-retry-count", b"0"),
    (b"x-stainless-read-timeout", b"600"),
    (b"content-length", b"96"),
]
RESULT = {
    "id": "chatcmpl-abc",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "sim",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": " tok0 tok1 tok2 tok3 tok4 tok5 tok6 tok7",
                "refusal": None,
            },
            "logprobs": None,
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18},
}
ANSWER_HEADERS = {"x-sluice-job-id": "job_abc", "x-request-id": "job_abc"}


def _header_reader() -> Callable[[Request, str], str | None]:
    """How the tree reads one header where build_job reads it: ``api.headers.header`` where it has
    one, starlette's ``request.headers.get`` before."""
    if importlib.util.find_spec("sluice.api.headers") is not None:
        header = importlib.import_module("sluice.api.headers").header
        return lambda request, name: header(request, name.encode())
    return lambda request, name: request.headers.get(name)


def _drive(coro: Coroutine[Any, Any, Any]) -> None:
    """Run a coroutine that never waits (its every await returns at once)."""
    try:
        coro.send(None)
    except StopIteration:
        return
    raise RuntimeError("the coroutine waited")


async def _dropped(message: Message) -> None:
    return None


async def _no_message() -> Message:
    raise RuntimeError("a whole answer reads nothing")


def parts() -> dict[str, Callable[[], None]]:
    """The steps, each a call that does what one request does there."""
    read = _header_reader()
    job_headers = getattr(gateway, "_JOB_HEADERS", None)
    scan = None if job_headers is None else importlib.import_module("sluice.api.headers").headers
    client_timeout: Any = getattr(gateway, "client_timeout", None)  # an older tree's, before the scan

    def headers(request: Request) -> None:
        # build_job's own five (one scan of api.headers.headers in a tree that has it, else three
        # reads and client_timeout's two), then what client_retry and bearer read.
        if scan is not None:
            scan(request, job_headers)
        else:
            read(request, "x-priority")
            read(request, "x-request-timeout")
            read(request, "idempotency-key")
            client_timeout(request)
        gateway.client_retry(request)
        auth.bearer(request)

    ring = auth.KeyRing(load_settings(environ={}))
    job = Job(
        id="job_abc",
        model="sim",
        endpoint=Endpoint.CHAT,
        body={},
        tenant="anonymous",
        priority="normal",
        prompt_tokens=10,
        max_tokens=8,
        created_at=1.0,
        deadline=100.0,
    )
    job.state, job.result = JobState.SUCCEEDED, RESULT
    takes_headers = "headers" in inspect.signature(relay.answer).parameters

    def whole() -> None:
        if takes_headers:
            response = relay.answer(job, ANSWER_HEADERS)
        else:
            response = relay.answer(job)
            response.headers.update(ANSWER_HEADERS)
        _drive(response({"type": "http"}, _no_message, _dropped))

    steps: dict[str, Callable[[], None]] = {}
    for name, raw in (("bench", BENCH), ("sdk", SDK)):
        request = Request({"type": "http", "headers": raw})
        steps[f"seven header reads, {name} request"] = lambda r=request: headers(r)  # type: ignore[misc]
        steps[f"authenticate (open mode), {name} request"] = lambda r=request: _drive(ring.authenticate(r))  # type: ignore[misc]
    steps["a whole answer made and sent"] = whole
    return steps


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.overhead_parts", description=__doc__)
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"load average: {os.getloadavg()[0]:.1f}")
    found = {}
    for name, step in parts().items():
        best = min(timeit.repeat(step, number=args.number, repeat=args.repeat)) / args.number
        found[name] = round(best * 1e6, 2)
        print(f"{name}: {found[name]:.2f} µs")
    print(json.dumps(found))
    return found


if __name__ == "__main__":
    main()
