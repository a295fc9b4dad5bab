"""The dashboard in a real browser: Debian's chromium, headless, driven by Playwright's Python package
(never ``playwright install``: the system's /usr/bin/chromium is used through ``executable_path``).

The page loads without a console error, its numbers change while ``sluice bench`` runs against the
gateway, a refused burst shows in the refusal counts, an ejected engine (a backend nobody listens
on) shows its failures, and a key opens a session cookie that keeps the key out of the address.
With ``SLUICE_DASHBOARD_SCREENSHOT=1`` the page under load is saved as docs/img/dashboard.png (the
README's picture). Skipped where chromium or Playwright is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from sluice.api.auth import hash_key
from sluice.api.dashboard import COOKIE
from sluice.config import load_settings
from sluice.runtime import build_app
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import free_port, wait_until
from tests.servers import run_app

playwright_api = pytest.importorskip("playwright.async_api", reason="Playwright's Python package is missing")

CHROMIUM = os.environ.get("SLUICE_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium (Debian's package) is not installed"),
    pytest.mark.timeout(180),
]
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "img" / "dashboard.png"
MSG = [{"role": "user", "content": "hi"}]


@contextlib.asynccontextmanager
async def browser_page(profile: Path) -> AsyncIterator[tuple[Any, list[str]]]:
    """A page of a headless chromium on a fresh profile, and the console errors it logs."""
    async with playwright_api.async_playwright() as p:
        context = await p.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1400, "height": 900},
        )
        errors: list[str] = []
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            yield page, errors
        finally:
            await context.close()


@contextlib.asynccontextmanager
async def gateway(**overrides: Any) -> AsyncIterator[tuple[str, FastAPI]]:
    """``sluice serve`` in front of a simulator of 4 slots (about 2 answers a second) and of an
    engine nobody listens on, with a queue of 8 jobs: a burst is refused, the dead engine ejected."""
    engine = preset("article", model="sim", max_num_seqs=4)
    dead = f"http://127.0.0.1:{free_port()}"
    async with serve_in_background(engine) as sim:
        settings = load_settings(
            overrides={
                "backends": [
                    {"url": dead, "name": "gpu-dead", "models": ["sim"], "max_concurrency": 4},
                    {"url": sim, "name": "gpu-sim", "max_concurrency": 4},
                ],
                "max_queued_jobs": 8,
                "queue_policy": "cap",
                "log_level": "error",
                **overrides,
            },
            environ={},
        )
        app = build_app(settings, dispatch=True)
        async with run_app(app) as url:
            await wait_until(app.state.gateway.broker.served_models)
            yield url, app


async def text(page: Any, selector: str) -> str:
    value: str = await page.locator(selector).first.inner_text()
    return value.strip()


async def seq(page: Any) -> int:
    return int(await page.evaluate("document.body.dataset.seq || '0'"))


async def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    await wait_until(predicate, timeout=timeout)


def bench(url: str, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sluice.cli",
        "bench",
        "--target",
        url,
        "--mode",
        "sync",
        "--model",
        "sim",
        "--rate",
        "8",
        "--duration",
        "8",
        "--max-tokens",
        "48",
        "--no-progress",
        "--no-plot",
        "--out",
        str(out),
    ]


async def test_live_under_bench_with_refusals_and_an_ejected_engine(tmp_path: Path) -> None:
    async with gateway() as (url, _), browser_page(tmp_path / "profile") as (page, errors):
        await page.goto(url + "/dashboard")
        await wait_for(lambda: _live(page))
        assert await text(page, "#live") == "live"
        before = {tile: await text(page, f"#tile-{tile}") for tile in ("admitted", "queued", "goodput")}

        proc = await asyncio.create_subprocess_exec(
            *bench(url, tmp_path / "bench"), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        try:
            seen: dict[str, set[str]] = {"admitted": set(), "queued": set(), "goodput": set()}

            async def moving() -> bool:
                for tile in seen:
                    seen[tile].add(await text(page, f"#tile-{tile}"))
                # every tile took a value other than its idle one, and changed more than once
                return all(len(v - {before[t]}) >= 2 for t, v in seen.items())

            await wait_for(moving, timeout=30)

            # A burst beyond the queue's 8: refused with queue_full, and counted on the page.
            async with httpx.AsyncClient(timeout=60) as http:
                burst = await asyncio.gather(
                    *(
                        http.post(
                            url + "/v1/chat/completions",
                            json={"model": "sim", "messages": MSG, "max_tokens": 48},
                        )
                        for _ in range(30)
                    ),
                    return_exceptions=True,
                )
            refused = sum(1 for r in burst if isinstance(r, httpx.Response) and r.status_code == 429)
            assert refused > 0

            async def refusals_shown() -> bool:
                rows = page.locator('#refusals tr[data-code="queue_full"]')
                if await rows.count() == 0:
                    return False
                in_window = int((await rows.first.locator("td").nth(2).inner_text()).replace(",", ""))
                return in_window >= refused

            await wait_for(refusals_shown)
            assert "refused: queue_full" in await text(page, "#legend-admissions")  # its own line
            assert "given" in await text(page, "#retry-after")

            # The engine nobody listens on: its failures and its state, beside the live one.
            dead = page.locator('#engines tr[data-engine="gpu-dead"]')

            async def ejected() -> bool:
                if await dead.count() == 0:
                    return False
                state = await dead.get_attribute("data-state")
                failures = int(await dead.locator("td").nth(6).inner_text())
                return state in ("ejected", "recovering") and failures >= 1

            await wait_for(ejected)
            assert (
                await page.locator('#engines tr[data-engine="gpu-sim"]').get_attribute("data-state") == "ok"
            )

            # The charts drew: each canvas has non-blank pixels.
            blank = await page.evaluate(
                """() => [...document.querySelectorAll('canvas')].filter(c => {
                    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                    for (let i = 3; i < d.length; i += 4) if (d[i]) return false;
                    return true; }).length"""
            )
            assert blank == 0

            shot = tmp_path / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("SLUICE_DASHBOARD_SCREENSHOT") == "1":
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, SCREENSHOT)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            _, stderr = await proc.communicate()
        assert proc.returncode in (0, -15), stderr.decode()[-2000:]
        await page.close()  # before the gateway stops: a feed cut by the server is not the page's error
        assert errors == []


async def _live(page: Any) -> bool:
    return await seq(page) >= 2


async def test_a_key_opens_a_session_and_leaves_the_address(tmp_path: Path) -> None:
    keys = [{"key_sha256": hash_key("sk-admin"), "tenant": "ops", "admin": True}]
    async with (
        gateway(keys=keys, dashboard_key_sha256=hash_key("sk-dash")) as (url, _),
        browser_page(tmp_path / "profile") as (page, errors),
    ):
        denied = await page.goto(url + "/dashboard")
        assert denied is not None and denied.status == 401
        await page.goto(url + "/dashboard?key=sk-dash")
        assert page.url == url + "/dashboard"  # redirected: the key is not in the address
        await wait_for(lambda: _live(page))
        (cookie,) = [c for c in await page.context.cookies() if c["name"] == COOKIE]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/dashboard"
        assert COOKIE not in await page.evaluate("document.cookie")  # out of the scripts' reach
        await page.reload()
        await wait_for(lambda: _live(page))
        await page.close()
        # The 401 page logged its status; nothing else.
        assert [e for e in errors if "401" not in e] == []
