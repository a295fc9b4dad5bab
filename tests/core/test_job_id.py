"""Job ids: what ``secrets.token_urlsafe(16)`` makes from the same 16 random bytes."""

from __future__ import annotations

import base64
import os

import pytest

from sluice.core import job as job_module
from sluice.core.job import new_job_id


@pytest.mark.parametrize("raw", [bytes(16), b"\xff" * 16, b"\xfb\xef\xbe" * 5 + b"\x01", os.urandom(16)])
def test_a_job_id_is_url_safe_base64_of_16_random_bytes(raw: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_module.os, "urandom", lambda n: raw[:n])
    # secrets.token_urlsafe(16): base64.urlsafe_b64encode(token_bytes(16)).rstrip(b"=").decode()
    assert new_job_id() == "job_" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def test_job_ids_differ() -> None:
    assert len({new_job_id() for _ in range(1_000)}) == 1_000
