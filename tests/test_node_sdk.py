"""The official OpenAI Node SDK (``openai`` from npm, pinned in tests/node/package-lock.json)
against the gateway: tests/node/sdk.test.mjs, run with ``node --test``.

Skipped where node is missing or its packages are not installed (``npm ci --prefix tests/node``,
which .ci/run does).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sluice.api.auth import hash_key
from tests.live import gateway_thread

NODE_DIR = Path(__file__).parent / "node"
TESTS = NODE_DIR / "sdk.test.mjs"
KEY = "sk-node"
LIMITED_KEY = "sk-node-limited"
RUN_S = 90

node = shutil.which("node")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(node is None, reason="node is not installed"),
    pytest.mark.skipif(
        not (NODE_DIR / "node_modules" / "openai" / "package.json").is_file(),
        reason="the Node SDK is not installed (npm ci --prefix tests/node)",
    ),
]


def _count(name: str, output: str) -> int:
    """A count from the closing lines of node's test runner ("# pass 8")."""
    found = re.search(rf"^# {name} (\d+)$", output, re.MULTILINE)
    assert found, output
    return int(found.group(1))


def test_the_node_sdk_against_the_gateway() -> None:
    keys = [
        {"key_sha256": hash_key(KEY), "tenant": "node"},
        {"key_sha256": hash_key(LIMITED_KEY), "tenant": "node-limited", "rpm": 60},
    ]
    with gateway_thread(keys=keys, max_tokens_cap=64) as url:
        env = {
            **os.environ,
            "SLUICE_URL": url,
            "SLUICE_KEY": KEY,
            "SLUICE_LIMITED_KEY": LIMITED_KEY,
            "SLUICE_MODEL": "sim",
            "NO_COLOR": "1",
        }
        assert node is not None
        done = subprocess.run(
            [node, "--test", "--test-reporter=tap", TESTS.name],
            cwd=NODE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_S,
            check=False,
        )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    tests = len(re.findall(r"^test\(", TESTS.read_text(), re.MULTILINE))
    assert tests >= 8
    assert (_count("pass", output), _count("fail", output), _count("skipped", output)) == (tests, 0, 0)
