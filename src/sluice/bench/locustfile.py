"""The article's load test for locust users, pointed at an engine or at Sluice's OpenAI API.

    pip install locust
    locust -f src/sluice/bench/locustfile.py --host http://127.0.0.1:8000 --headless -u 50 -r 10 -t 60s

Environment: ``BENCH_CLIENT_TIMEOUT`` (seconds a user waits, 15), ``BENCH_MAX_TOKENS`` (128),
``BENCH_MODEL`` (omitted by default: Sluice and the simulator pick their only model).

Caveat, and the reason ``sluice bench`` exists: locust is closed-loop. Each of its ``-u`` users sends
one request and waits for the answer before sending the next, so when the target slows down the
users send less: 50 users against 15 s answers offer about 3 req/s, not the 10 req/s the test was
meant to apply. The overload measures itself away (coordinated omission), and latency percentiles
leave out the requests that were never sent. ``sluice bench`` is open-loop (Poisson arrivals that do
not wait for answers); use it for numbers you publish, and this file for a quick look.

Nothing in the package imports this file, and locust is not a dependency of Sluice; run as a module
(``python -m sluice.bench.locustfile``), it prints this text.
"""

from __future__ import annotations

import contextlib
import os
import sys

if __name__ == "__main__":  # a locust file, not a program: say how to run it
    print(__doc__)
    sys.exit(0)

from locust import HttpUser, constant_throughput, task

CLIENT_TIMEOUT = float(os.environ.get("BENCH_CLIENT_TIMEOUT", "15"))
MAX_TOKENS = int(os.environ.get("BENCH_MAX_TOKENS", "128"))
MODEL = os.environ.get("BENCH_MODEL")
# 100 characters: 32 prompt tokens by the simulator's estimate, like sluice bench's prompt.
PROMPT = (
    "Explain how the Transformer architecture works, in simple terms, for a new engineer on our own team."
)


class ChatUser(HttpUser):
    # One request every 5 s per user at most: 50 users offer the article's 10 req/s only while every
    # answer takes under 5 s, which is exactly what stops being true under overload.
    wait_time = constant_throughput(0.2)

    @task
    def chat(self) -> None:
        body: dict[str, object] = {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
        }
        if MODEL:
            body["model"] = MODEL
        # Sluice reads the deadline from this header; an engine ignores it.
        headers = {"X-Request-Timeout": f"{CLIENT_TIMEOUT:g}"}
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=headers,
            timeout=CLIENT_TIMEOUT,
            catch_response=True,
            name="chat",
        ) as response:
            if response.status_code in (429, 503):
                # A fast, honest refusal is the system working as designed; count it apart from
                # failures so the report does not hide it among them.
                code = ""
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    code = response.json()["error"]["code"]
                response.failure(f"refused {response.status_code} {code}".strip())
            elif response.status_code != 200:
                response.failure(f"HTTP {response.status_code}")
            else:
                response.success()
