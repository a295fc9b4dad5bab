from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.logs import JsonFormatter, TextFormatter
from tests.api.sluice_server import logging_as_sluice, serve_as_sluice
from tests.servers import run_gateway

SECRET = "the prompt text must never reach the logs"


async def test_one_structured_line_per_outcome(
    sim_url: str, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice")
    async with run_gateway([sim_url], max_tokens_cap=50) as gw:
        ok = await http.post(
            gw.url + "/v1/chat/completions",
            json={"model": "sim", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 3},
        )
        assert ok.status_code == 200
    finished = [r for r in caplog.records if r.getMessage() == "job finished"]
    assert len(finished) == 1
    line = json.loads(JsonFormatter().format(finished[0]))
    assert line["status"] == "succeeded" and line["model"] == "sim" and line["completion_tokens"] == 3
    assert line["queue_s"] >= 0 and line["total_s"] >= line["queue_s"]
    assert all(
        SECRET not in r.getMessage() and SECRET not in str(getattr(r, "fields", "")) for r in caplog.records
    )


def test_json_formatter_keeps_fields_and_exceptions() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord(
            "sluice.x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info()
        )
    record.fields = {"job": "job_1"}
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "failed here" and line["job"] == "job_1" and "ValueError" in line["exc"]


MARKER = "MARKER-91c2-request-data"


def _record(exc: BaseException, name: str = "sluice.x", msg: str = "failed") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, (), (type(exc), exc, exc.__traceback__))


def _raised(make: Any) -> BaseException:
    try:
        make()
    except BaseException as exc:
        return exc
    raise AssertionError("nothing was raised")


def _encode_prompt() -> None:
    f"a prompt \ud800 {MARKER}".encode()


def _chained() -> None:
    try:
        _encode_prompt()
    except UnicodeEncodeError as exc:
        raise ValueError(f"cannot send {MARKER}") from exc


def _during() -> None:
    try:
        {}[MARKER]
    except KeyError:
        raise RuntimeError(MARKER)  # noqa: B904 (the implicit context is the point)


@pytest.mark.parametrize("make", [_encode_prompt, _chained, _during, lambda: {}[MARKER]])
@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter("%(message)s")])
def test_an_exception_is_logged_by_type_and_frames_never_its_message(
    make: Any, formatter: logging.Formatter
) -> None:
    exc = _raised(make)
    record = _record(exc)
    record.exc_text = "a traceback another handler cached, " + MARKER  # never reused
    line = formatter.format(record)
    assert MARKER not in line
    assert type(exc).__name__ in line and "test_logs.py:" in line  # what failed, and where


def test_an_os_error_keeps_the_systems_words() -> None:
    line = json.loads(
        JsonFormatter().format(_record(_raised(lambda: Path(f"/nonexistent/{MARKER}").read_text())))
    )
    assert "FileNotFoundError: [Errno 2] No such file or directory" in line["exc"]
    assert MARKER not in line["exc"]


def test_asyncio_keeps_only_its_first_line() -> None:
    """asyncio's own lines carry reprs of tasks on the lines after the first (their arguments, and
    the exception's message)."""
    record = logging.LogRecord(
        "asyncio",
        logging.ERROR,
        __file__,
        1,
        "Task exception was never retrieved\nfuture: <Task %s>",
        (MARKER,),
        None,
    )
    assert json.loads(JsonFormatter().format(record))["msg"] == "Task exception was never retrieved"
    assert MARKER not in TextFormatter("%(message)s").format(record)


async def test_a_failing_request_is_one_json_line_without_its_data(
    sim_url: str, http: httpx.AsyncClient, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug on a request's path: answered 500 in OpenAI's shape and logged once, as one JSON object,
    without the request's text; uvicorn's own "Exception in ASGI application" is not a second,
    raw copy of it."""
    with logging_as_sluice():
        async with serve_as_sluice([sim_url], max_tokens_cap=50) as served:
            broker = served.app.state.gateway.broker

            async def broken_admit(job: Any, limits: Any = None) -> Any:
                raise RuntimeError(f"corrupt state near {job.body['messages'][0]['content']}")

            broker.admit = broken_admit
            body = {"model": "sim", "messages": [{"role": "user", "content": MARKER}], "max_tokens": 3}
            r = await http.post(served.url + "/v1/chat/completions", json=body)
            assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
            assert r.headers["content-type"] == "application/json"
            # The server goes on answering.
            assert (await http.get(served.url + "/healthz")).status_code == 200
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines]  # every line is one JSON object
    assert [p["msg"] for p in parsed].count("unexpected error") == 1, err
    assert not [p for p in parsed if p["logger"].startswith("uvicorn")], err
    (failure,) = [p for p in parsed if p["msg"] == "unexpected error"]
    assert "RuntimeError" in failure["exc"] and failure["path"] == "/v1/chat/completions"
    assert MARKER not in err
