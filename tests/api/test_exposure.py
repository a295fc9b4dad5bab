"""Open mode (no keys) only where nobody else can reach it: every spelling of "all interfaces" is
refused like 0.0.0.0 unless --insecure-open."""

from __future__ import annotations

import pytest

from sluice.config import ConfigError, load_settings
from sluice.roles.http import check_exposure, is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"])
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["", " ", "0.0.0.0", "::", "[::]", "10.0.0.1", "example.com"])
def test_addresses_others_may_reach(host: str) -> None:
    # "" is what the socket layer reads as INADDR_ANY: every interface, not loopback.
    assert not is_loopback(host)


def test_an_empty_host_from_the_environment_is_refused_in_open_mode() -> None:
    settings = load_settings(environ={"SLUICE_HOST": ""})
    assert settings.host == ""
    with pytest.raises(ConfigError, match="no API keys"):
        check_exposure(settings)
    check_exposure(load_settings(environ={"SLUICE_HOST": "", "SLUICE_INSECURE_OPEN": "1"}))
