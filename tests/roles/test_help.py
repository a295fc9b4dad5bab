"""Each role's help lists the flags it uses, and only those."""

from __future__ import annotations

import pytest

from sluice.cli import main

HTTP_ONLY = ["--port", "--host", "--insecure-open", "--max-body-bytes"]
DISPATCH_ONLY = ["--backend", "--max-concurrency", "--max-inflight-tokens"]
ADMISSION_ONLY = ["--queue-policy", "--max-queued-jobs", "--default-timeout", "--max-tokens-cap"]


def help_of(role: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main([role, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_worker_help_has_no_http_or_admission_flags(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_of("worker", capsys)
    for flag in [*DISPATCH_ONLY, "--broker", "--config", "--log-level"]:
        assert flag in out
    for flag in [*HTTP_ONLY, *ADMISSION_ONLY]:
        assert flag not in out


def test_gateway_help_has_no_dispatch_flags(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_of("gateway", capsys)
    for flag in [*HTTP_ONLY, *ADMISSION_ONLY, "--broker"]:
        assert flag in out
    for flag in DISPATCH_ONLY:
        assert flag not in out


def test_serve_help_has_every_group(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_of("serve", capsys)
    for flag in [*HTTP_ONLY, *DISPATCH_ONLY, *ADMISSION_ONLY]:
        assert flag in out


@pytest.mark.parametrize("role", ["gateway", "worker"])
def test_scaled_out_roles_need_redis(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([role, "--broker", "memory"]) == 2
    assert "redis://" in capsys.readouterr().err


def test_a_worker_needs_a_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--broker", "redis://127.0.0.1:9"]) == 2
    assert "--backend" in capsys.readouterr().err


def test_local_engine_flags_reach_the_settings() -> None:
    from sluice.cli import build_parser
    from sluice.roles.flags import settings_from_args

    args = build_parser("serve").parse_args(
        ["serve", "--engine-port", "8011", "--engine-slots", "2", "--engine-ctx", "4096"]
    )
    settings = settings_from_args(args)
    assert (settings.engine_port, settings.engine_slots, settings.engine_ctx_per_slot) == (8011, 2, 4096)


def test_help_shows_the_defaults_the_settings_have(capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.config import Settings

    out = " ".join(help_of("serve", capsys).split())
    defaults = Settings()
    assert f"kept (seconds) (default: {defaults.result_ttl_s})" in out
    assert f"(default: {defaults.max_queued_jobs})" in out
    assert "429 queue_full, for models not listed in models; unset: unbounded" in out
