"""The Batch API's stores, both of them through the same steps: files, batch records, progress (a
result is written once, the first write wins), leases; and what each keeps across a restart."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sluice.batches import parse_input
from sluice.filestore.base import BatchStore, FileMeta
from sluice.filestore.disk import DiskStore
from sluice.filestore.redis import RedisStore
from tests.redis_server import RedisServer


@pytest.fixture(params=["disk", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BatchStore]:
    if request.param == "disk":
        disk = DiskStore(tmp_path / "files")
        await disk.start()
        yield disk
        await disk.close()
        return
    with RedisServer() as server:
        redis = RedisStore(server.url)
        await redis.start()
        yield redis
        await redis.close()


def record(batch_id: str, tenant: str, created: float, status: str = "in_progress") -> dict[str, object]:
    return {
        "id": batch_id,
        "status": status,
        "created_at": int(created),
        "_sluice": {"tenant": tenant, "created": created},
    }


async def test_files_are_kept_listed_and_deleted(store: BatchStore) -> None:
    for i in range(3):
        await store.put_file(FileMeta(f"file-{i}", "t", f"f{i}.jsonl", "batch", 3, 100.0 + i), b"abc")
    await store.put_file(FileMeta("file-x", "other", "x.jsonl", "batch", 1, 99.0), b"x")
    assert (await store.get_file("file-1")) == FileMeta("file-1", "t", "f1.jsonl", "batch", 3, 101.0)
    assert await store.file_content("file-1") == b"abc"
    page = await store.list_files("t", purpose=None, limit=2, after=None, ascending=False)
    assert [f["id"] for f in page.items] == ["file-2", "file-1"] and page.has_more
    page = await store.list_files("t", purpose=None, limit=2, after="file-1", ascending=False)
    assert [f["id"] for f in page.items] == ["file-0"] and not page.has_more
    asc = await store.list_files("t", purpose="batch", limit=10, after=None, ascending=True)
    assert [f["id"] for f in asc.items] == ["file-0", "file-1", "file-2"]
    assert (
        await store.list_files("t", purpose="batch_output", limit=10, after=None, ascending=True)
    ).items == []
    assert await store.delete_file("file-1") and not await store.delete_file("file-1")
    assert await store.get_file("file-1") is None and await store.file_content("file-1") is None


async def test_an_id_no_file_can_have_is_not_found(store: BatchStore) -> None:
    # A client may send any id; one too long for a file name, or with a NUL or a path in it, is
    # simply not there (the disk store must not let the file system's OSError out).
    for bad in ["f" * 300, "é" * 150, "a\0b", "../file-1", ".hidden"]:
        assert await store.get_file(bad) is None
        assert await store.file_content(bad) is None
        assert not await store.delete_file(bad)
        assert await store.get_batch(bad) is None


async def test_batches_and_which_are_active(store: BatchStore) -> None:
    await store.put_batch(record("batch_a", "t", 10.5))
    await store.put_batch(record("batch_b", "t", 10.7))
    await store.put_batch(record("batch_c", "u", 11.0))
    assert sorted(await store.active_batches()) == ["batch_a", "batch_b", "batch_c"]
    await store.put_batch(record("batch_a", "t", 10.5, status="completed"))
    assert sorted(await store.active_batches()) == ["batch_b", "batch_c"]
    page = await store.list_batches("t", limit=1, after=None)
    assert [b["id"] for b in page.items] == ["batch_b"] and page.has_more  # newest first, to the ms
    assert [b["id"] for b in (await store.list_batches("t", limit=5, after="batch_b")).items] == ["batch_a"]
    assert (await store.get_batch("batch_a") or {})["status"] == "completed"
    assert await store.cancel_requested("batch_b") is None
    assert await store.request_cancel("batch_b", 5.0) == 5.0
    assert await store.request_cancel("batch_b", 9.0) == 5.0  # the first ask is kept
    assert await store.cancel_requested("batch_b") == 5.0


async def test_a_result_is_written_once(store: BatchStore) -> None:
    assert await store.add_result("batch_a", "x", True, '{"n": 1}')
    assert not await store.add_result("batch_a", "x", True, '{"n": 2}')  # a second run of the line
    assert not await store.add_result("batch_a", "x", False, '{"n": 3}')
    assert await store.add_result("batch_a", "y", False, '{"n": 4}')
    assert await store.results("batch_a") == {"x": (True, '{"n": 1}'), "y": (False, '{"n": 4}')}
    assert await store.result_counts("batch_a") == (1, 1)
    await store.set_job("batch_a", "x", "job_1")
    await store.set_job("batch_a", "z", "job_2")
    assert await store.jobs("batch_a") == {"x": "job_1", "z": "job_2"}


async def test_one_runner_holds_a_batch(store: BatchStore) -> None:
    assert await store.take_lease("batch_a", "one", 30)
    assert await store.take_lease("batch_a", "one", 30)  # renewed
    assert not await store.take_lease("batch_a", "two", 30)
    await store.release_lease("batch_a", "two")  # not its lease: nothing happens
    assert not await store.take_lease("batch_a", "two", 30)
    await store.release_lease("batch_a", "one")
    assert await store.take_lease("batch_a", "two", 30)


async def test_the_disk_store_keeps_everything_across_a_restart(tmp_path: Path) -> None:
    first = DiskStore(tmp_path)
    await first.start()
    second = DiskStore(tmp_path)
    await second.start()
    assert first.unavailable is None and second.unavailable is not None  # one process owns it
    await second.close()
    await first.put_file(FileMeta("file-1", "t", "in.jsonl", "batch", 2, 1.0), b"{}")
    await first.put_batch(record("batch_a", "t", 1.0))
    await first.set_job("batch_a", "x", "job_1")
    await first.add_result("batch_a", "x", True, "line-x")
    await first.close()
    # a crash mid-append leaves a torn last line: it is skipped, and the line's result is not lost
    log = tmp_path / "batches" / "batch_a.results"
    log.write_text(log.read_text() + '{"custom_id": "y", "ok": tr')
    again = DiskStore(tmp_path)
    await again.start()
    assert again.unavailable is None
    assert await again.file_content("file-1") == b"{}"
    assert await again.active_batches() == ["batch_a"]
    assert await again.jobs("batch_a") == {"x": "job_1"}
    assert await again.results("batch_a") == {"x": (True, "line-x")}
    assert not await again.add_result("batch_a", "x", True, "again")
    await again.close()


def test_parse_input_tells_a_bad_file_from_bad_lines() -> None:
    url = "/v1/chat/completions"
    good = {
        "custom_id": "a",
        "method": "POST",
        "url": url,
        "body": {"messages": [{"role": "user", "content": "x"}]},
    }
    parsed = parse_input(
        "\n".join(
            json.dumps(x)
            for x in [
                good,
                {**good, "custom_id": "b", "body": {"messages": []}},
                {**good, "method": "GET", "custom_id": "c"},
                {**good, "custom_id": None},
                good,
            ]
        ).encode(),
        url,
        10,
    )
    assert parsed.errors == []
    assert [(ln.number, ln.key, ln.error["code"] if ln.error else None) for ln in parsed.lines] == [
        (1, "a", None),
        (2, "b", "invalid_request"),
        (3, "c", "invalid_method"),
        (4, "#4", "missing_required_parameter"),
        (5, "#5", "duplicate_custom_id"),
    ]
    assert parse_input(b"\n\n", url, 10).errors[0]["code"] == "empty_file"
    assert parse_input(b"\xff", url, 10).errors[0]["code"] == "invalid_file"
    assert (
        parse_input(((json.dumps(good) + "\n") * 3).encode(), url, 2).errors[0]["code"] == "too_many_requests"
    )
    bad = parse_input(b'{"a": 1}\nnot json\n[]\n', url, 10)
    assert [(e["code"], e["line"]) for e in bad.errors] == [
        ("invalid_json_line", 2),
        ("invalid_json_line", 3),
    ]
