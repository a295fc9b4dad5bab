"""OpenAI's Files API, for the Batch API's input and output files.

``POST /v1/files`` (multipart: ``file`` and ``purpose=batch``) reads the upload as it streams in,
counting its bytes: a file over ``max_file_bytes`` is a 413 as soon as it is, before anything is
stored (the app's body limit does not apply to this route: this one does). ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content`` and ``DELETE /v1/files/{id}``: only the
tenant that uploaded a file (or whose batch wrote it) sees it; another tenant's reads as unknown.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from python_multipart.multipart import MultipartParser, parse_options_header

from sluice.api.auth import Caller, Who
from sluice.api.batch_records import BatchRunning
from sluice.api.errors import APIError
from sluice.api.gateway import gateway
from sluice.api.openapi import KEYED, errors
from sluice.filestore.base import BatchStore, FileMeta, new_file_id

router = APIRouter(tags=["files"])

#: the route whose body the app-wide size limit leaves alone (it counts its own)
UPLOAD_PATH = "/v1/files"
#: what a multipart body may carry besides the file (boundaries, headers, the purpose field)
MULTIPART_OVERHEAD = 64 * 1024
#: purposes a file may be uploaded with: Sluice keeps files for the Batch API only
PURPOSES = ("batch",)


def batch_store(request: Request) -> BatchStore:
    """The app's store, or 503 when this process cannot use it (another owns its directory)."""
    runner: BatchRunning = request.app.state.batches
    if runner.store.unavailable is not None:
        raise APIError(503, f"The Batch API is off here: {runner.store.unavailable}.", "batches_unavailable")
    return runner.store


def file_object(meta: FileMeta) -> dict[str, Any]:
    """OpenAI's File object."""
    return {
        "id": meta.id,
        "object": "file",
        "bytes": meta.bytes,
        "created_at": int(meta.created_at),
        "filename": meta.filename,
        "purpose": meta.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


#: The longest file id looked up, in UTF-8 bytes: the store's ids are far shorter (``file-`` and 24
#: characters), and a name past the file system's limit (255 bytes) would be an OSError, not a
#: missing file.
MAX_FILE_ID = 128


def _not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", "file_not_found", param="file_id")


async def caller_file(store: BatchStore, caller: Caller, file_id: str) -> FileMeta:
    """The caller's own file, or 404 (another tenant's file is indistinguishable from none)."""
    if len(file_id.encode("utf-8", "surrogatepass")) > MAX_FILE_ID:
        raise _not_found(file_id)  # none is this long; and a store on disk cannot even look it up
    meta = await store.get_file(file_id)
    if meta is None or meta.tenant != caller.tenant:
        raise _not_found(file_id)
    return meta


class _Upload:
    """A multipart body read part by part: the ``file`` part's bytes (at most ``cap``) and its name,
    and the small text fields (``purpose``)."""

    def __init__(self, boundary: bytes, cap: int) -> None:
        self.cap = cap
        self.fields: dict[str, str] = {}
        self.file = bytearray()
        self.filename: str | None = None
        self.too_large = False
        self._name: str | None = None
        self._header_field = b""
        self._header_value = b""
        self._disposition: dict[bytes, bytes] = {}
        self._text = bytearray()
        self.parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._on_header_field,
                "on_header_value": self._on_header_value,
                "on_header_end": self._header_end,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
            },
        )

    def _part_begin(self) -> None:
        self._disposition = {}
        self._name = None
        self._text = bytearray()

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_field.lower() == b"content-disposition":
            _, self._disposition = parse_options_header(self._header_value)
            self._name = self._disposition.get(b"name", b"").decode("utf-8", "replace")
            if self._name == "file":
                self.filename = self._disposition.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")
        self._header_field = b""
        self._header_value = b""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "file":
            self.file += data[start:end]
            if len(self.file) > self.cap:
                self.too_large = True
        elif len(self._text) < 4096:
            self._text += data[start:end]

    def _part_end(self) -> None:
        if self._name and self._name != "file":
            self.fields[self._name] = self._text.decode("utf-8", "replace")


def _too_large(cap: int) -> APIError:
    return APIError(413, f"The file exceeds {cap} bytes, the most this server takes.", "file_too_large")


@router.post("/v1/files", responses=errors(*KEYED, 400, 413))
async def upload(request: Request, who: Who) -> JSONResponse:
    """Upload a file (``multipart/form-data`` with ``file`` and ``purpose=batch``)."""
    cap = gateway(request).settings.max_file_bytes
    media, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if media != b"multipart/form-data" or not boundary:
        raise APIError(400, "Send the file as multipart/form-data.", "invalid_request", param="file")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap + MULTIPART_OVERHEAD:
        raise _too_large(cap)
    form = _Upload(boundary, cap)
    async for chunk in request.stream():
        form.parser.write(chunk)
        if form.too_large:
            raise _too_large(cap)
    form.parser.finalize()
    purpose = form.fields.get("purpose")
    if purpose is None:
        raise APIError(
            400, "Missing required parameter: 'purpose'.", "missing_required_parameter", param="purpose"
        )
    if purpose not in PURPOSES:
        raise APIError(
            400,
            f"Invalid purpose '{purpose}': this server keeps files for the Batch API only ('batch').",
            "invalid_value",
            param="purpose",
        )
    if form.filename is None:
        raise APIError(400, "Missing required parameter: 'file'.", "missing_required_parameter", param="file")
    meta = FileMeta(new_file_id(), who.tenant, form.filename, purpose, len(form.file), time.time())
    await batch_store(request).put_file(meta, bytes(form.file))
    return JSONResponse(file_object(meta))


@router.get("/v1/files", responses=errors(*KEYED, 400))
async def list_files(
    request: Request,
    who: Who,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    """The caller's files, newest first (``order=asc``: oldest first)."""
    page = await batch_store(request).list_files(
        who.tenant, purpose=purpose, limit=limit, after=after, ascending=order == "asc"
    )
    data = [file_object(FileMeta.from_dict(item)) for item in page.items]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    )


@router.get("/v1/files/{file_id}", responses=errors(*KEYED, 404))
async def retrieve(request: Request, file_id: str, who: Who) -> JSONResponse:
    return JSONResponse(file_object(await caller_file(batch_store(request), who, file_id)))


@router.get(
    "/v1/files/{file_id}/content",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}, **errors(*KEYED, 404)},
)
async def content(request: Request, file_id: str, who: Who) -> Response:
    store = batch_store(request)
    await caller_file(store, who, file_id)
    data = await store.file_content(file_id)
    if data is None:
        raise _not_found(file_id)
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", responses=errors(*KEYED, 404))
async def delete(request: Request, file_id: str, who: Who) -> JSONResponse:
    store = batch_store(request)
    await caller_file(store, who, file_id)
    await store.delete_file(file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})
