"""Every HTTP answer carries ``x-request-id``, as OpenAI's do: the SDKs read it (``request_id`` of a
response or an error), and a client quoting it names what it asked.

It is the job's id where the request made one (the answer's ``x-sluice-job-id``), so that the id a
client logs finds the job in Sluice's own log lines; else a fresh id. :class:`sluice.api.limits.Guard`
adds it to the framework's answers, the lean routes (:mod:`sluice.api.lean`) to their own.
"""

from __future__ import annotations

import os

HEADER = "x-request-id"
JOB_HEADER = "x-sluice-job-id"


def new_request_id() -> str:
    """An id for an answer that belongs to no job (every refusal's): what ``secrets.token_hex(16)``
    writes, from the same source, without its two Python calls on the way to it."""
    return "req_" + os.urandom(16).hex()
