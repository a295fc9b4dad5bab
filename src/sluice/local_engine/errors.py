"""What can go wrong while the local engine is provisioned or supervised: one base class, so that a
caller catches every such failure at once, and a subclass per cause."""

from __future__ import annotations

from collections.abc import Sequence

from sluice.local_engine.cache import ENV_LLAMA_SERVER

INSTALL_HINT = (
    "Install them with `sudo apt-get install build-essential cmake ninja-build` (Debian/Ubuntu), "
    "`sudo dnf install gcc-c++ make cmake ninja-build` (Fedora) or `brew install cmake ninja` (macOS)"
)


class EngineError(Exception):
    """Base class of every error raised while provisioning or supervising the local engine."""


class MissingToolError(EngineError):
    """A program needed to build llama-server is not on the PATH."""

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = list(missing)
        super().__init__(
            f"cannot build llama-server: missing {', '.join(self.missing)}. {INSTALL_HINT}; "
            f"or point ${ENV_LLAMA_SERVER} at an existing llama-server binary."
        )


class EngineBuildError(EngineError):
    """Downloading, configuring or compiling llama-server failed."""


class ModelUnavailableError(EngineError):
    """The model file could not be found or downloaded."""


# ----------------------------------------------------------------------------------------- locations
