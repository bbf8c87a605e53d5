"""The chat page at `/` in headless Chromium (Debian's, driven by Playwright): it loads
the JS SDK from /sdk, streams an answer, stops it mid-stream, regenerates, warms the next
turn while typing, renders markdown without letting HTML through. Screenshots are saved
under tests/artifacts/."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from engine import EngineConfig
from service.config import ServiceConfig
from tests.servers import run_server

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = ServiceConfig(engine=EngineConfig(model="smollm2-135m", dtype="bfloat16"))
    with run_server(config) as s:
        yield s


async def test_chat_page_streams_stops_regenerates_and_warms(server) -> None:
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: run `make install`"
    ARTIFACTS.mkdir(exist_ok=True)
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium,
                                          args=["--no-sandbox", "--disable-gpu"])
        page = await browser.new_page(viewport={"width": 1000, "height": 760})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        await page.goto(f"{server.url}/")
        await page.wait_for_selector("#status[data-ready='1']", timeout=30_000)

        # markdown is rendered, HTML is not
        html = await page.evaluate("renderMarkdown('<img src=x onerror=alert(1)> **bold** `c`')")
        assert "<img" not in html and "&lt;img" in html
        assert "<strong>bold</strong>" in html and "<code>c</code>" in html

        await page.fill("#temperature", "0")
        await page.fill("#max-tokens", "400")
        await page.fill("#input", "Count from 1 to 300, one number per line.")
        await page.press("#input", "Enter")
        body = ".msg.assistant .body"
        await page.wait_for_function(
            f"document.querySelector('{body}')?.textContent.length > 5", timeout=60_000)
        first = len(await page.text_content(body) or "")
        await page.wait_for_function(  # it streams: the text keeps growing
            f"document.querySelector('{body}').textContent.length > {first + 5}", timeout=60_000)
        assert await page.is_enabled("#stop") and not await page.is_enabled("#send")
        await page.screenshot(path=str(ARTIFACTS / "chat-streaming.png"))
        await page.click("#stop")
        await page.wait_for_selector(".msg.assistant[data-state='cancelled']", timeout=30_000)
        stats = await page.text_content(".msg.assistant .stats") or ""
        assert "stopped" in stats and "TTFT" in stats and "tok/s" in stats
        assert "cached prompt tokens" in stats
        stopped_len = len(await page.text_content(body) or "")
        await asyncio.sleep(0.5)
        assert len(await page.text_content(body) or "") == stopped_len  # nothing after Stop
        eng = server.engine
        for _ in range(200):
            if not eng.has_unfinished():
                break
            await asyncio.sleep(0.05)
        assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks

        await page.fill("#max-tokens", "6")
        await page.click("#regenerate")
        await page.wait_for_selector(".msg.assistant[data-state='completed']", timeout=60_000)
        assert await page.locator(".msg.assistant").count() == 1  # replaced, not appended

        await page.type("#input", "And now in French?")  # warms the next turn's prefix
        await page.wait_for_selector("#status[data-warmed]", timeout=30_000)
        assert int(await page.get_attribute("#status", "data-warmed") or 0) >= 16
        await page.screenshot(path=str(ARTIFACTS / "chat-page.png"), full_page=True)
        await browser.close()
    assert not errors, errors
    assert (ARTIFACTS / "chat-page.png").stat().st_size > 10_000
