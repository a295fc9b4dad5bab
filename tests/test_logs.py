from __future__ import annotations

import json
import logging

import httpx
import pytest

from sluice.logs import JsonFormatter
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
