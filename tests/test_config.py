from __future__ import annotations

from pathlib import Path

import pytest

from sluice.cli import build_parser, main
from sluice.config import ConfigError, load_settings
from sluice.core.policy import CoDelPolicy
from sluice.roles.flags import ALL_GROUPS, settings_from_args
from sluice.roles.serve import with_local_engine


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "sluice.toml"
    path.write_text(
        'port = 7000\nhost = "127.0.0.2"\nmax_queued_jobs = 5\n[[backends]]\nurl = "http://a:1"\n'
    )
    s = load_settings(
        path, environ={"SLUICE_PORT": "7100", "SLUICE_MAX_QUEUED_JOBS": "6"}, overrides={"port": 7200}
    )
    assert s.port == 7200 and s.max_queued_jobs == 6 and s.host == "127.0.0.2"
    assert [b.url for b in s.backends] == ["http://a:1"]


def test_env_backends_list() -> None:
    s = load_settings(environ={"SLUICE_BACKENDS": "http://a:1, http://b:2"})
    assert [b.url for b in s.backends] == ["http://a:1", "http://b:2"]


def test_flags_reach_settings(tmp_path: Path) -> None:
    args = build_parser("serve").parse_args(
        [
            "serve",
            "--backend",
            "http://e:1",
            "--backend",
            "http://f:2",
            "--max-concurrency",
            "16",
            "--port",
            "0",
        ]
    )
    s = settings_from_args(args)
    assert s.max_concurrency == 16 and s.port == 0 and len(s.backends) == 2


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("port = 'eighty'", "port"),
        ("default_priority = 'vip'", "default_priority"),
        ("unknown_setting = 1", "unknown_setting"),
        ("classes = []", "classes"),
        ("default_max_tokens = 10\nmax_tokens_cap = 5", "default_max_tokens"),
        ("[[backends]]\nmax_concurrency = 0\nurl='http://x'", "max_concurrency"),
        ("this is not toml", "TOML"),
        ("queue_policy = 'lifo'", "queue_policy"),
        ("queue_half_life_s = 0", "queue_half_life_s"),
        ("queue_interval_s = 0.1\nqueue_early_s = 1", "queue_interval_s"),
        ("prefix_load_factor = 0.9", "prefix_load_factor"),
        ("prefix_remember = -1", "prefix_remember"),
    ],
)
def test_invalid_config_is_a_clear_error(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_settings(path, environ={})


def test_queue_policy_from_settings() -> None:
    from sluice.core.policy import CapPolicy, CoDelPolicy, FifoPolicy

    assert load_settings(environ={}).policy() == CoDelPolicy()
    custom = load_settings(environ={"SLUICE_QUEUE_POLICY": "codel", "SLUICE_QUEUE_TARGET_S": "0.2"})
    assert custom.policy() == CoDelPolicy(target_s=0.2)
    assert load_settings(environ={"SLUICE_QUEUE_POLICY": "fifo", "SLUICE_FIFO_MAX_QUEUED": "7"}).policy() == (
        FifoPolicy(7)
    )
    assert isinstance(load_settings(overrides={"queue_policy": "cap"}, environ={}).policy(), CapPolicy)


def test_the_local_engine_is_the_one_backend_and_the_queue_settings_are_everyone_s(tmp_path: Path) -> None:
    # No special case for the local engine: the drain rate learns how its sequences slow as the
    # batch fills, so codel's defaults hold in front of it as in front of any engine.
    parser = build_parser()
    plain = settings_from_args(parser.parse_args(["serve"]))
    local = with_local_engine(plain, "http://127.0.0.1:9", "smollm2", 4)
    assert local.queue_burst_rise == plain.queue_burst_rise == CoDelPolicy().burst_rise
    assert local.policy() == plain.policy()
    (backend,) = local.backends
    assert (backend.url, backend.models, backend.max_concurrency) == ("http://127.0.0.1:9", ["smollm2"], 4)
    chosen = settings_from_args(parser.parse_args(["serve", "--queue-burst-rise", "3"]))
    assert with_local_engine(chosen, "http://127.0.0.1:9", "smollm2", 4).queue_burst_rise == 3
    config = tmp_path / "sluice.toml"
    config.write_text("queue_burst_rise = 2.0\n")
    from_file = settings_from_args(parser.parse_args(["serve", "--config", str(config)]))
    assert with_local_engine(from_file, "http://127.0.0.1:9", "smollm2", 4).queue_burst_rise == 2.0


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "absent.toml", environ={})


def test_unset_default_follows_lowered_cap() -> None:
    s = load_settings(overrides={"max_tokens_cap": 64, "max_timeout_s": 10}, environ={})
    assert s.default_timeout_s == 10
    # default_max_tokens is unset by default: such a request has no limit, whatever the cap.
    assert s.default_max_tokens is None
    assert (
        load_settings(
            overrides={"max_tokens_cap": 64, "default_max_tokens": 32}, environ={}
        ).default_max_tokens
        == 32
    )


def test_serve_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in [*(f.name for g in ALL_GROUPS for f in g), "--config", "--backend", "--max-inflight-tokens"]:
        assert flag in out


def test_serve_rejects_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("port = -1")
    assert main(["serve", "--config", str(path)]) == 2
    assert "port" in capsys.readouterr().err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_unset_settings_are_the_core_and_broker_defaults() -> None:
    """A server configured with nothing runs as the core and the broker do by default: the defaults
    live there, once, and configuration reads them (it once said 600 s of results, the broker 3600)."""
    import dataclasses

    from sluice.broker.base import BrokerSettings
    from sluice.core.admission import QueueLimits
    from sluice.core.capacity import DrainRate
    from sluice.core.job import Job
    from sluice.core.policy import CoDelPolicy, FifoPolicy
    from sluice.core.scheduler import DEFAULT_CLASSES

    s = load_settings(environ={})
    broker = BrokerSettings()
    assert s.class_specs() == list(DEFAULT_CLASSES) == list(broker.classes)
    assert s.policy() == CoDelPolicy() == broker.policy
    assert s.model_copy(update={"queue_policy": "fifo"}).policy() == FifoPolicy()
    assert s.limits() == ({}, QueueLimits()) and QueueLimits() == broker.default_limits
    assert (s.lease_s, s.result_ttl_s, s.drain_prior_per_slot) == (
        broker.lease_s,
        broker.result_ttl_s,
        broker.drain_prior_per_slot,
    )
    assert broker.drain_prior_per_slot == DrainRate().prior_per_slot
    assert s.result_ttl_s == 600.0  # the documented value (docs/configuration.md)
    job_defaults = {f.name: f.default for f in dataclasses.fields(Job)}
    assert s.max_attempts == job_defaults["max_attempts"]


def test_prefix_routing_settings_reach_the_router(tmp_path: Path) -> None:
    """``prefix_load_factor`` and ``prefix_remember`` (file, environment, flags) are what the
    router is built with; unset, they are the router's own defaults."""
    from sluice.core.routing import Router

    default = load_settings(environ={}).router()
    bare = Router()
    assert (default.affinity, default.load_factor, default.remember) == (
        bare.affinity,
        bare.load_factor,
        bare.remember,
    )
    path = tmp_path / "sluice.toml"
    path.write_text("prefix_load_factor = 1.5\nprefix_remember = 10\nprefix_affinity = false\n")
    router = load_settings(path, environ={"SLUICE_PREFIX_REMEMBER": "0"}).router()
    assert (router.affinity, router.load_factor, router.remember) == (False, 1.5, 0)
    args = build_parser("serve").parse_args(["serve", "--prefix-load-factor", "2", "--prefix-remember", "7"])
    s = settings_from_args(args)
    assert (s.router().load_factor, s.router().remember) == (2.0, 7)
