"""Engines that speak the OpenAI API: vLLM, llama-server, TGI, Ollama, and the simulator."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from sluice import protocol
from sluice.backends.base import Backend, BackendError
from sluice.backends.engine_load import EngineKind, EngineLoadReader
from sluice.backends.http import TRANSPORT_ERRORS, EngineHTTP, EngineUnreachable, unreachable
from sluice.core.concurrency import EngineLoad
from sluice.core.job import Job
from sluice.core.model_info import ModelInfo
from sluice.protocol import loads

# Errors the engine may recover from, or that another engine may not have.
RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
MAX_ERROR_BODY = 4096
MALFORMED_CHUNK = "the engine sent a malformed stream chunk"
# Reading an answer's body: a RuntimeError is aiohttp's word for a read after the connection
# closed (aclose), before the connection's own error is set: a lost connection all the same.
_READ_ERRORS: tuple[type[BaseException], ...] = (*TRANSPORT_ERRORS, RuntimeError)


class OpenAIBackend(Backend):
    """An OpenAI-compatible engine at ``url`` (with or without a trailing ``/v1``).

    A job whose tokens someone reads as they come (``job.stream_tokens``) is sent with
    ``stream: true`` and ``stream_options.include_usage``, whatever stream options the client gave:
    streaming gives the time of the first token and relays tokens as they come. Any other job (a
    synchronous request that does not stream) is sent with ``stream: false``, and :meth:`stream`
    yields its whole answer as one chunk in the shape of a stream chunk. Either way an abort
    (closing the stream, or cancelling the task that waits on it) closes the connection, which vLLM
    and llama-server treat as "stop generating".

    ``priority_map`` (class -> number), when set, puts ``"priority": priority_map[job.priority]`` in
    every request body: vLLM's field for ``--scheduling-policy priority`` (lower runs sooner). A
    class the map does not name is sent without one. :meth:`engine_load` reads the engine's
    ``/metrics`` or ``/slots`` (:mod:`sluice.backends.engine_load`). The connections are
    :class:`~sluice.backends.http.EngineHTTP`'s, opened when first needed, closed by :meth:`aclose`.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str | None = None,
        max_concurrency: int = 8,
        max_inflight_tokens: int | None = None,
        models: list[str] | None = None,
        api_key: str | None = None,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 120.0,
        priority_map: Mapping[str, int] | None = None,
    ) -> None:
        base = url.rstrip("/").removesuffix("/v1")
        super().__init__(
            name or base,
            max_concurrency=max_concurrency,
            max_inflight_tokens=max_inflight_tokens,
            models=models,
        )
        self.url = base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = EngineHTTP(
            base, headers=headers, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s
        )
        self.priority_map: dict[str, int] | None = dict(priority_map) if priority_map is not None else None
        self._load_reader = EngineLoadReader(self._http.get)

    @property
    def engine_kind(self) -> EngineKind | None:
        """What the engine's report was found to be (None until first read)."""
        return self._load_reader.kind

    async def engine_load(self) -> EngineLoad | None:
        return await self._load_reader.read()

    def _body(self, job: Job, *, stream: bool) -> dict[str, Any]:
        """The job's body as the engine gets it: streamed with its usage or whole, with its
        priority where a map gives one."""
        body = dict(job.body)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        else:
            body.pop("stream_options", None)
            body["stream"] = False
        if self.priority_map is not None and job.priority in self.priority_map:
            body["priority"] = self.priority_map[job.priority]
        return body

    async def discover_models(self) -> list[str]:
        try:
            status, raw = await self._http.get("/v1/models", 5.0)
            if not 200 <= status < 300:
                raise ValueError(f"HTTP {status}")
            data = json.loads(raw).get("data", [])
            listed = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except EngineUnreachable as exc:
            raise BackendError(
                "cannot list the engine's models", retryable=True, detail=f"cannot list models: {exc.detail}"
            ) from exc
        except (ValueError, AttributeError, TypeError) as exc:
            raise BackendError(
                "cannot list the engine's models", retryable=True, detail=f"cannot list models: {exc}"
            ) from exc
        now = int(time.time())
        info = {m["id"]: _model_info(m, self.model_info.get(m["id"]), now) for m in listed}
        if len(info) == 1:
            # llama-server serves one model, and says its context per slot in /props only (or in
            # its model list's meta, in newer builds).
            (name, one), entry = next(iter(info.items())), listed[0]
            if _positive(entry.get("max_model_len")) is None and _meta(entry, "n_ctx") is None:
                window = await self._props_context()
                if window is not None:
                    info[name] = ModelInfo(one.created, window)
        self.model_info = info
        return list(info)

    async def _props_context(self) -> int | None:
        """llama-server's context per slot, from ``/props``; None where the engine has no such page."""
        with contextlib.suppress(EngineUnreachable, ValueError, AttributeError, TypeError):
            status, raw = await self._http.get("/props", 2.0)
            if status == 200:
                props = json.loads(raw)
                settings = props.get("default_generation_settings")
                found = settings.get("n_ctx") if isinstance(settings, dict) else None
                return _positive(found) or _positive(props.get("n_ctx"))
        return None

    async def healthy(self) -> bool:
        try:
            status, _ = await self._http.get("/v1/models", 2.0)
        except EngineUnreachable:
            return False
        return status == 200

    whole_answers = True

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        if not job.stream_tokens:
            yield await self.whole(job)
            return
        content = _encode(self._body(job, stream=True))
        response = await self._send(job, content)
        # Released (back to the pool) once the answer was read to its end; closed otherwise (an
        # abort: the generator closed or its task cancelled, an error), which ends the generation.
        complete = False
        try:
            if response.status != 200:
                raise _status_error(response.status, await _bounded(response))
            pending = b""
            read = response.content.readany
            while True:
                try:
                    piece = await read()
                except RuntimeError as exc:  # see _READ_ERRORS
                    raise _transport_error(unreachable(exc)) from exc
                if not piece:
                    break
                lines = (pending + piece).splitlines() if pending else piece.splitlines()
                # The last line is whole only when a line break ends the piece (\r\n split across
                # two pieces gives an empty line, which is skipped as any line but data's). The
                # tests below are slices and the last byte's number, not ``endswith``,
                # ``startswith`` and ``strip``: the same answers without a C call each, on every
                # line of every token (``piece[-1:] in b"\n\r"`` would make and drop a TypeError).
                pending = b"" if piece[-1] in _LINE_ENDS else lines.pop() if lines else b""
                for line in lines:
                    if line[:5] != b"data:":
                        continue
                    # "data: {...}", as every engine writes a chunk, is already stripped past its
                    # space; anything else is stripped of its whitespace.
                    payload = line[6:] if line[5:7] == b" {" and line[-1:] == b"}" else line[5:].strip()
                    if payload == b"[DONE]":
                        complete = True
                        return
                    # _chunk's, inline: this runs for every token
                    try:
                        data = loads(payload)  # as json.loads, without its guess of the encoding
                    except ValueError as exc:
                        raise BackendError(MALFORMED_CHUNK, retryable=True) from exc
                    if type(data) is dict:  # loads gives plain dicts; anything else is skipped
                        if "error" in data:
                            raise BackendError(_message(data), retryable=False)
                        yield data
            complete = True
        except TRANSPORT_ERRORS as exc:
            raise _transport_error(unreachable(exc)) from exc
        finally:
            _end(response, complete)

    async def _send(self, job: Job, content: bytes) -> aiohttp.ClientResponse:
        try:
            return await self._http.post(job.endpoint.path, content, _JSON)
        except EngineUnreachable as exc:
            raise _transport_error(exc) from exc

    async def whole(self, job: Job) -> dict[str, Any]:
        """One request for the whole answer, returned as a single chunk holding all of it (what
        :meth:`stream` yields, alone, for a job that does not stream).

        Closing the connection still aborts the generation: vLLM and llama-server watch for it.
        """
        response = await self._send(job, _encode(self._body(job, stream=False)))
        complete = False
        try:
            if response.status != 200:
                raise _status_error(response.status, await _bounded(response))
            raw = await response.read()
            complete = True
        except _READ_ERRORS as exc:
            raise _transport_error(unreachable(exc)) from exc
        finally:
            _end(response, complete)
        try:
            data = protocol.loads(raw)
            # Every field the engine sent travels on (system_fingerprint, service_tier, its own):
            # the assembler passes a whole answer through as it came, in the job's identity.
            data["choices"] = [_as_delta(c) for c in data.get("choices") or []]
        except (ValueError, AttributeError, TypeError) as exc:
            raise BackendError("the engine sent a malformed answer", retryable=True) from exc
        return data  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self._http.aclose()


async def _bounded(response: aiohttp.ClientResponse) -> bytes:
    """The start of an error answer's body (an engine's error page may be large, or endless)."""
    raw = b""
    while len(raw) <= MAX_ERROR_BODY:
        try:
            piece = await response.content.read(MAX_ERROR_BODY + 1 - len(raw))
        except RuntimeError as exc:  # see _READ_ERRORS; the caller maps the connection's error
            raise aiohttp.ClientConnectionError(str(exc)) from exc
        if not piece:
            break
        raw += piece
    return raw[:MAX_ERROR_BODY]


def _transport_error(exc: EngineUnreachable) -> BackendError:
    # aiohttp's own text may carry the URL or the address it tried: only the operator's log gets it.
    return BackendError(
        f"the engine did not answer ({exc.kind})", retryable=True, detail=exc.detail, reached=exc.reached
    )


def _as_delta(choice: dict[str, Any]) -> dict[str, Any]:
    """A whole answer's choice in the shape of a stream chunk's, so one assembler handles both
    (in place: the decoded answer is this call's own)."""
    if not isinstance(choice, dict):
        raise TypeError("a choice is not an object")
    if "message" in choice:
        choice["delta"] = choice.pop("message")
    return choice


def _message(data: Any) -> str:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if isinstance(err, str):
        return err
    return "the engine reported an error"


def _status_error(status: int, raw: bytes) -> BackendError:
    param = None
    try:
        data = json.loads(raw)
        message = _message(data)
        param = _param(data)
    except ValueError:
        message = raw.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    # The engine's own text may quote the prompt: the client hears it, the operator's log only the
    # status (logs never hold a prompt or an answer).
    logged = f"engine answered {status}" + (f" (param {param})" if param else "")
    if status in RETRYABLE_STATUS or status >= 500:
        return BackendError(
            f"engine answered {status}: {message}", retryable=True, status=status, detail=logged
        )
    # The engine refused the request itself (context too long, bad parameter): the client's fault.
    return BackendError(
        message,
        retryable=False,
        status=status,
        type="invalid_request_error",
        code="engine_rejected",
        param=param,
        detail=logged,
    )


def _param(data: Any) -> str | None:
    """The parameter an engine's error names (OpenAI's ``error.param``), if it names one."""
    err = data.get("error") if isinstance(data, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    return param if isinstance(param, str) and param else None


def _positive(value: Any) -> int | None:
    """A count an engine reports: a positive integer, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _meta(entry: dict[str, Any], name: str) -> int | None:
    """A count from llama-server's ``meta`` of a model list entry."""
    meta = entry.get("meta")
    return _positive(meta.get(name)) if isinstance(meta, dict) else None


def _model_info(entry: dict[str, Any], known: ModelInfo | None, now: int) -> ModelInfo:
    """What a ``/v1/models`` entry says of its model. The context window is vLLM's
    ``max_model_len``, else llama-server's context per slot (``meta.n_ctx``), else the context it
    was trained for (``meta.n_ctx_train``). The creation time is the one first seen: engines
    (vLLM, llama-server) answer the time of the call, so a later listing would move it."""
    first_seen = known.created if known is not None else 0
    return ModelInfo(
        created=first_seen or _positive(entry.get("created")) or now,
        context_window=(
            _positive(entry.get("max_model_len")) or _meta(entry, "n_ctx") or _meta(entry, "n_ctx_train")
        ),
    )


_JSON = {"Content-Type": "application/json"}
#: LF and CR, as the numbers a byte of ``bytes`` reads as
_LINE_ENDS = (ord("\n"), ord("\r"))


def _end(response: aiohttp.ClientResponse, complete: bool) -> None:
    """An answer read to its end goes back to the pool (aiohttp closes it instead if any of its
    body is unread); any other end (an abort, an error) closes the connection, which is what makes
    the engine stop generating."""
    if complete:
        response.release()
    else:
        response.close()


def _encode(body: dict[str, Any]) -> bytes:
    """The request body as JSON, compact, UTF-8. A body that has no JSON form (a lone
    surrogate, NaN, nesting past the recursion limit; the gateway refuses these, so only a job
    queued by another build can hold one) fails its job as the client's error: the exception, whose
    message holds the text it choked on, goes nowhere."""
    try:
        return protocol.compact_json(body)
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        pass
    raise BackendError(
        "The request has no JSON form an engine can read (text that is not valid Unicode, or a "
        "number that is not finite).",
        retryable=False,
        type="invalid_request_error",
        code="invalid_value",
    )
