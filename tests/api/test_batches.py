"""The Batch API with the official SDK's ``client.files`` and ``client.batches``, against a gateway on
the simulator: object shapes, the status lifecycle, output and error files one line per custom_id,
what fails a line alone and what fails a batch, the upload cap, pagination and cancelling."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types import Batch, FileObject

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import Gateway, run_gateway

TERMINAL = {"completed", "failed", "expired", "cancelled"}


def chat_line(custom_id: str, content: str = "hi", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": 5, **body},
    }


def jsonl(lines: list[Any]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


@pytest.fixture
async def gateway(sim_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    async with run_gateway([sim_url], files_dir=str(tmp_path / "files"), max_file_bytes=64 * 1024) as gw:
        yield gw


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0) as c:
        yield c


async def finished(client: AsyncOpenAI, batch_id: str, timeout: float = 30) -> Batch:
    async def done() -> bool:
        return (await client.batches.retrieve(batch_id)).status in TERMINAL

    await wait_until(done, timeout=timeout)
    return await client.batches.retrieve(batch_id)


async def lines_of(client: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    content = await client.files.content(file_id)
    return [json.loads(x) for x in content.text.splitlines()]


async def test_a_batch_runs_to_completed_with_one_output_line_per_custom_id(client: AsyncOpenAI) -> None:
    uploaded = await client.files.create(
        file=("input.jsonl", jsonl([chat_line(f"req-{i}", f"question {i}") for i in range(5)])),
        purpose="batch",
    )
    assert isinstance(uploaded, FileObject)
    assert uploaded.purpose == "batch" and uploaded.filename == "input.jsonl" and uploaded.bytes > 0
    assert (await client.files.retrieve(uploaded.id)).id == uploaded.id

    batch = await client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"run": "nightly"}
    assert batch.expires_at == batch.created_at + 24 * 3600
    done = await finished(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 5, 0)
    assert (
        done.in_progress_at is not None and done.finalizing_at is not None and done.completed_at is not None
    )
    assert done.error_file_id is None and done.model == "sim"
    assert done.usage is not None and done.usage.output_tokens == 25
    out = await lines_of(client, done.output_file_id)
    assert [line["custom_id"] for line in out] == [f"req-{i}" for i in range(5)]
    for line in out:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion"
        assert line["response"]["request_id"].startswith("job_")
    meta = await client.files.retrieve(done.output_file_id or "")
    assert meta.purpose == "batch_output"


async def test_bad_lines_fail_alone_into_the_error_file(client: AsyncOpenAI) -> None:
    lines = [
        chat_line("good-1"),
        chat_line("good-1"),  # a duplicate custom_id
        chat_line("unknown-model", model="no-such-model"),
        {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"},
        {"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
        chat_line("too-long", max_tokens=10**9),
        chat_line("good-2"),
    ]
    uploaded = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await finished(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 2, 5)
    assert [line["custom_id"] for line in await lines_of(client, done.output_file_id)] == ["good-1", "good-2"]
    errors = await lines_of(client, done.error_file_id)
    by_id = {(e["custom_id"], i): e for i, e in enumerate(errors)}
    assert [e["custom_id"] for e in errors] == ["good-1", "unknown-model", "no-body", "wrong-url", "too-long"]
    duplicate = by_id[("good-1", 0)]
    assert duplicate["response"] is None and duplicate["error"]["code"] == "duplicate_custom_id"
    unknown = by_id[("unknown-model", 1)]
    assert unknown["response"]["status_code"] == 404
    assert unknown["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id[("no-body", 2)]["error"]["code"] == "invalid_body"
    assert by_id[("wrong-url", 3)]["error"]["code"] == "invalid_url"
    assert by_id[("too-long", 4)]["response"]["status_code"] == 400


async def test_a_file_that_is_not_jsonl_fails_the_batch_in_validating(client: AsyncOpenAI) -> None:
    content = jsonl([chat_line("a"), "{not json", chat_line("b"), "[1, 2]"])
    uploaded = await client.files.create(file=("bad.jsonl", content), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await finished(client, batch.id)
    assert done.status == "failed" and done.failed_at is not None
    assert done.in_progress_at is None and done.output_file_id is None
    assert done.errors is not None and done.errors.data is not None
    assert [(e.code, e.line) for e in done.errors.data] == [
        ("invalid_json_line", 2),
        ("invalid_json_line", 4),
    ]


async def test_a_file_over_the_cap_is_413_and_is_not_stored(client: AsyncOpenAI, gateway: Gateway) -> None:
    big = jsonl([chat_line(f"r{i}", "x" * 1000) for i in range(80)])  # over 64 KiB
    with pytest.raises(openai.APIStatusError) as raised:
        await client.files.create(file=("big.jsonl", big), purpose="batch")
    assert raised.value.status_code == 413
    assert (await client.files.list()).data == []

    # Streamed without a Content-Length, it is cut off as soon as it passes the cap.
    async def body() -> AsyncIterator[bytes]:
        yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
        for _ in range(100):
            yield b"x" * 1024
        yield b"\r\n--b--\r\n"

    async with httpx.AsyncClient() as http:
        r = await http.post(
            gateway.url + "/v1/files",
            content=body(),
            headers={"content-type": "multipart/form-data; boundary=b"},
        )
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    assert (await client.files.list()).data == []


async def test_files_list_delete_and_purpose(client: AsyncOpenAI) -> None:
    ids = [
        (await client.files.create(file=(f"f{i}.jsonl", jsonl([chat_line("a")])), purpose="batch")).id
        for i in range(3)
    ]
    listed = await client.files.list()
    assert [f.id for f in listed.data] == ids[::-1]
    page = await client.files.list(limit=2)
    assert [f.id for f in page.data] == ids[:0:-1] and page.has_more
    assert [f.id async for f in client.files.list(limit=1)] == ids[::-1]
    deleted = await client.files.delete(ids[0])
    assert deleted.deleted and deleted.id == ids[0]
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        await client.files.content(ids[0])
    with pytest.raises(openai.BadRequestError):
        await client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")


async def test_another_tenants_files_and_batches_are_unknown(gateway: Gateway) -> None:
    async with (
        AsyncOpenAI(base_url=gateway.url + "/v1", api_key="alice", max_retries=0) as alice,
        AsyncOpenAI(base_url=gateway.url + "/v1", api_key="bob", max_retries=0) as bob,
    ):
        uploaded = await alice.files.create(file=("a.jsonl", jsonl([chat_line("a")])), purpose="batch")
        with pytest.raises(openai.NotFoundError):
            await bob.files.retrieve(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            await bob.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        batch = await alice.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with pytest.raises(openai.NotFoundError):
            await bob.batches.retrieve(batch.id)
        assert (await bob.batches.list()).data == []


async def test_batches_list_is_paginated_newest_first(client: AsyncOpenAI) -> None:
    uploaded = await client.files.create(file=("a.jsonl", jsonl([chat_line("a")])), purpose="batch")
    ids = [
        (
            await client.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        ).id
        for _ in range(3)
    ]
    first = await client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:0:-1] and first.has_more
    assert [b.id async for b in client.batches.list(limit=2)] == ids[::-1]


async def test_create_refuses_what_openai_refuses(client: AsyncOpenAI) -> None:
    uploaded = await client.files.create(file=("a.jsonl", jsonl([chat_line("a")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as raised:
        await client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
        )
    assert raised.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        await client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError):
        await client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )


async def test_cancel_stops_dispatching_and_keeps_what_finished(tmp_path: Path) -> None:
    # A slow engine with 2 slots: the batch runs 2 lines at a time, so most are still to come.
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.05)) as sim,
        run_gateway([sim], files_dir=str(tmp_path / "files"), max_concurrency=2) as gw,
        AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        lines = [chat_line(f"r{i}", max_tokens=4) for i in range(40)]
        uploaded = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def some_done() -> bool:
            b = await client.batches.retrieve(batch.id)
            return b.request_counts is not None and b.request_counts.completed >= 2

        await wait_until(some_done, timeout=30)
        cancelled = await client.batches.cancel(batch.id)
        assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
        done = await finished(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        assert done.request_counts is not None
        completed = done.request_counts.completed
        assert 2 <= completed < 40
        out = await lines_of(client, done.output_file_id)
        assert len(out) == completed == len({line["custom_id"] for line in out})
        with pytest.raises(openai.ConflictError):
            await client.batches.cancel(batch.id)


async def test_a_batch_past_its_window_expires_with_batch_expired_lines(tmp_path: Path) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.05)) as sim,
        run_gateway(
            [sim], files_dir=str(tmp_path / "files"), max_concurrency=1, batch_completion_windows=["2s"]
        ) as gw,
        AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        lines = [chat_line(f"r{i}", max_tokens=10) for i in range(30)]
        uploaded = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="2s",  # type: ignore[arg-type]
        )
        done = await finished(client, batch.id)
        assert done.status == "expired" and done.expired_at is not None
        assert done.request_counts is not None
        assert done.request_counts.completed + done.request_counts.failed == 30
        errors = await lines_of(client, done.error_file_id)
        assert errors and all(e["error"]["code"] == "batch_expired" for e in errors)
        answered = await lines_of(client, done.output_file_id) if done.output_file_id else []
        assert {line["custom_id"] for line in answered} | {e["custom_id"] for e in errors} == {
            f"r{i}" for i in range(30)
        }


async def test_lines_run_in_the_batch_class_that_requests_cannot_name(
    client: AsyncOpenAI, gateway: Gateway
) -> None:
    uploaded = await client.files.create(file=("in.jsonl", jsonl([chat_line("a")])), purpose="batch")
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await finished(client, batch.id)
    (line,) = await lines_of(client, done.output_file_id)
    async with httpx.AsyncClient(headers={"authorization": "Bearer k"}) as http:  # the same caller
        job = (await http.get(f"{gateway.url}/v1/jobs/{line['response']['request_id']}")).json()
        assert job["priority"] == "batch"
        assert job["timings"]["deadline"] == pytest.approx(done.expires_at, abs=1)  # the batch's own
        r = await http.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "sim", "messages": [{"role": "user", "content": "x"}], "priority": "batch"},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


async def test_the_queue_never_holds_a_batch_backlog(tmp_path: Path) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.02)) as sim,
        run_gateway([sim], files_dir=str(tmp_path / "files"), max_concurrency=2) as gw,
        AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        lines = [chat_line(f"r{i}", max_tokens=4) for i in range(30)]
        uploaded = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        most = 0

        async def done() -> bool:
            nonlocal most
            stats = (await gw.broker.stats()).get("sim")
            if stats is not None:
                most = max(most, stats.queued_jobs + stats.running_jobs)
            return (await client.batches.retrieve(batch.id)).status in TERMINAL

        await wait_until(done, timeout=60)
        # the engine's two slots were kept busy, and nothing more waited in the queue
        assert most == 2
        assert (await client.batches.retrieve(batch.id)).status == "completed"


async def test_the_batch_whose_deadline_comes_first_runs_first(tmp_path: Path) -> None:
    # One slot: a batch created later with a shorter window takes it from the one already running.
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.02)) as sim,
        run_gateway(
            [sim],
            files_dir=str(tmp_path / "files"),
            max_concurrency=1,
            batch_completion_windows=["24h", "1h"],
        ) as gw,
        AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
    ):
        late = await client.files.create(
            file=("late.jsonl", jsonl([chat_line(f"l{i}", max_tokens=4) for i in range(20)])), purpose="batch"
        )
        soon = await client.files.create(
            file=("soon.jsonl", jsonl([chat_line(f"s{i}", max_tokens=4) for i in range(5)])), purpose="batch"
        )
        first = await client.batches.create(
            input_file_id=late.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        async def started() -> bool:
            b = await client.batches.retrieve(first.id)
            return b.status == "in_progress"

        await wait_until(started, timeout=30)
        second = await client.batches.create(
            input_file_id=soon.id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
        done = await finished(client, second.id, timeout=60)
        assert done.status == "completed"
        behind = await client.batches.retrieve(first.id)
        assert behind.status == "in_progress" and behind.request_counts is not None
        assert behind.request_counts.completed < 20  # it waited while the sooner deadline ran
        assert (await finished(client, first.id, timeout=60)).status == "completed"
