"""The chat page at `/` in headless Chromium (Debian's, driven by Playwright): it loads
the JS SDK from /sdk, streams an answer (with a visible streaming indicator), stops it
mid-stream, regenerates, warms the next turn while typing, renders markdown without
letting HTML through; fits a phone; keeps conversations in localStorage (reload, New
chat, the list); shows the true connection state and reconnects by itself, resuming a
stream in flight, when the server goes away and comes back; has a favicon. Screenshots
are saved under tests/artifacts/."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from engine import EngineConfig
from service.config import ServiceConfig
from tests.servers import apoll, http_get, run_server, uvicorn_logs_to

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
COUNT = "Count from 1 to 300, one number per line."
ANSWER = ".msg.assistant .body"
DESKTOP = {"width": 1000, "height": 760}
# the page's longer paths (reload, the key in the fragment, reconnect with backoff, a
# second phone size, the HTTP fallback) run in `make page` and plain `pytest` with
# TIDEWIRE_PAGE_FULL=1; `make test` keeps streaming, stop, regenerate, warm, one phone
FULL = os.environ.get("TIDEWIRE_PAGE_FULL", "") not in ("", "0")
full_only = pytest.mark.skipif(not FULL, reason="runs in `make page` (TIDEWIRE_PAGE_FULL=1)")


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = ServiceConfig(engine=EngineConfig(model="smollm2-135m", dtype="bfloat16"))
    with run_server(config) as s:
        yield s


@contextlib.asynccontextmanager
async def browser():
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: run `make install`"
    ARTIFACTS.mkdir(exist_ok=True)
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            await b.close()


class Page:
    """A fresh page (its own context, so its own localStorage) that records page errors
    and failed HTTP responses."""

    def __init__(self, page) -> None:  # noqa: ANN001 - playwright Page
        self.page = page
        self.errors: list[str] = []
        self.failed: list[str] = []
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.status} {r.url}"))

    @classmethod
    async def open(cls, b, url: str, viewport: dict | None = None) -> tuple[Page, object]:  # noqa: ANN001
        page = await b.new_page(viewport=viewport or DESKTOP)
        p = cls(page)
        await page.goto(f"{url}/")
        await page.wait_for_selector("#status[data-ready='1']", timeout=30_000)
        return p, page

    def check(self) -> None:
        assert not self.errors, self.errors
        assert not self.failed, self.failed


async def wait_text_longer(page, than: int, timeout: int = 60_000) -> None:  # noqa: ANN001
    await page.wait_for_function(
        f"(document.querySelector('{ANSWER}')?.textContent.length ?? 0) > {than}", timeout=timeout)


async def answer_len(page) -> int:  # noqa: ANN001
    return len(await page.text_content(ANSWER) or "")


async def engine_idle(server) -> None:  # noqa: ANN001
    eng = server.engine
    deadline = time.monotonic() + 10
    while eng.has_unfinished() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.num_blocks


async def test_chat_page_streams_stops_regenerates_and_warms(server) -> None:
    async with browser() as b:
        p, page = await Page.open(b, server.url)

        # markdown is rendered, HTML is not
        html = await page.evaluate("renderMarkdown('<img src=x onerror=alert(1)> **bold** `c`')")
        assert "<img" not in html and "&lt;img" in html
        assert "<strong>bold</strong>" in html and "<code>c</code>" in html

        status = await page.text_content("#status") or ""
        assert "connected" in status and "smollm2" in status
        assert not await page.is_visible("#streaming")  # the indicator shows only while streaming

        await page.fill("#temperature", "0")
        await page.fill("#max-tokens", "400")
        await page.fill("#input", COUNT)
        await page.press("#input", "Enter")
        await wait_text_longer(page, 5)
        first = await answer_len(page)
        await wait_text_longer(page, first + 5)  # it streams: the text keeps growing
        assert await page.is_enabled("#stop") and not await page.is_enabled("#send")
        # the streaming indicator: a visible bar, a class on <body>, a caret on the answer
        assert await page.is_visible("#streaming")
        assert "Generating" in (await page.text_content("#streaming") or "")
        assert await page.evaluate("document.body.classList.contains('streaming')")
        assert await page.locator(".msg.assistant.streaming").count() == 1
        await page.screenshot(path=str(ARTIFACTS / "chat-streaming.png"))
        await page.click("#stop")
        await page.wait_for_selector(".msg.assistant[data-state='cancelled']", timeout=30_000)
        stats = await page.text_content(".msg.assistant .stats") or ""
        assert "stopped" in stats and "TTFT" in stats and "tok/s" in stats
        assert "cached prompt tokens" in stats
        assert not await page.is_visible("#streaming")
        assert not await page.evaluate("document.body.classList.contains('streaming')")
        assert await page.locator(".msg.streaming").count() == 0
        stopped_len = await answer_len(page)
        await asyncio.sleep(0.5)
        assert await answer_len(page) == stopped_len  # nothing after Stop
        await engine_idle(server)

        await page.fill("#max-tokens", "6")
        await page.click("#regenerate")
        await page.wait_for_selector("#streaming", state="visible", timeout=30_000)
        await page.wait_for_selector(".msg.assistant[data-state='completed']", timeout=60_000)
        assert await page.locator(".msg.assistant").count() == 1  # replaced, not appended
        assert not await page.is_visible("#streaming")

        await page.type("#input", "And now in French?")  # warms the next turn's prefix
        await page.wait_for_selector("#status[data-warmed]", timeout=30_000)
        assert int(await page.get_attribute("#status", "data-warmed") or 0) >= 16
        await page.screenshot(path=str(ARTIFACTS / "chat-page.png"), full_page=True)
        # the favicon the page links is served (and every other request succeeded)
        icon = await page.evaluate(
            "fetch(document.querySelector('link[rel=icon]').href).then(r => r.status)")
        assert icon == 200
        p.check()
    assert (ARTIFACTS / "chat-page.png").stat().st_size > 10_000


def unauthorized_count(server) -> float:  # noqa: ANN001
    status, body = http_get(server.url + "/metrics")
    assert status == 200
    m = re.search(rb'^tidewire_errors_total\{code="unauthorized"\} (\S+)$', body, re.M)
    return float(m.group(1)) if m else 0.0


@full_only
async def test_the_key_comes_from_the_fragment_and_leaves_the_address_bar(tiny_chat_model,
                                                                          caplog) -> None:
    """On a keyed server: /#key=K connects (a fragment never reaches the server) and K
    is gone from location.href at once; a reload keeps the tab's key (sessionStorage);
    an old /?key=K2 link works too, leaves the bar with its other parameters kept, and
    shows in the access log as key=***. A tab without a key is refused. Neither key is
    in any log line."""
    key, old_key = "sk-fragment-5b21e9", "sk-query-0c77d3"
    config = ServiceConfig(engine=EngineConfig(model=str(tiny_chat_model), dtype="float32"),
                           model_name="tiny", api_keys={key: "a", old_key: "b"})
    with run_server(config, log_level="info") as s, uvicorn_logs_to(caplog.handler):
        async with browser() as b:
            async def opened(path: str, state: str = "connected"):  # noqa: ANN202
                page = await b.new_page(viewport=DESKTOP)  # its own context and storage
                p = Page(page)
                await page.goto(s.url + path)
                await page.wait_for_selector(f"#status[data-conn='{state}']", timeout=30_000)
                return p, page

            p, page = await opened(f"/#key={key}")
            assert await page.get_attribute("#status", "data-ready") == "1"
            assert "tiny" in (await page.text_content("#status") or "")
            assert await page.evaluate("location.href") == s.url + "/"
            await page.reload()  # the same tab: the key is still there, still not in the URL
            await page.wait_for_selector("#status[data-conn='connected']", timeout=30_000)
            assert await page.evaluate("location.href") == s.url + "/"
            p.check()

            p, page = await opened(f"/?key={old_key}&x=1#top")
            assert await page.evaluate("location.href") == s.url + "/?x=1#top"
            p.check()

            # a new tab, no key: the server refuses its socket (a browser cannot tell
            # that 403 from a network failure, so the page keeps retrying)
            refused = unauthorized_count(s)
            _, page = await opened("/", state="connecting")
            await apoll(lambda: unauthorized_count(s) > refused, 30, "a refused handshake",
                        every=0.05)
            assert await page.get_attribute("#status", "data-ready") is None
    logged = [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]
    assert any('"GET / HTTP/1.1" 200' in line for line in logged), logged
    assert any('"GET /?key=***&x=1 HTTP/1.1" 200' in line for line in logged), logged
    assert key not in caplog.text and old_key not in caplog.text


def test_favicon_is_served(server) -> None:
    """/favicon.ico (a real ICO) and /favicon.svg come from service/static."""
    status, ico = http_get(server.url + "/favicon.ico")
    assert status == 200 and ico[:4] == b"\x00\x00\x01\x00" and len(ico) < 4096
    status, svg = http_get(server.url + "/favicon.svg")
    assert status == 200 and svg.startswith(b"<svg") and len(svg) < 2048
    status, page = http_get(server.url + "/")
    assert status == 200 and b'rel="icon" href="/favicon.svg"' in page


# What must fit on a phone: every visible control and block inside the viewport (those
# in the scrolling log and list only horizontally), no horizontal scrolling, and no
# message wider than its box (long code scrolls inside its <pre>).
FITS = """() => {
  const W = innerWidth, H = innerHeight, bad = [];
  const root = document.documentElement;
  if (root.scrollWidth > W) bad.push(`document scrollWidth ${root.scrollWidth} > ${W}`);
  if (document.body.scrollWidth > W) bad.push(`body scrollWidth ${document.body.scrollWidth} > ${W}`);
  const sel = "button, input, textarea, label, h1, #status, #status-text, #streaming, #notice, " +
              "header, form, #settings, .msg, #chats li";
  for (const el of document.querySelectorAll(sel)) {
    const r = el.getBoundingClientRect();
    if (!r.width || !r.height || getComputedStyle(el).visibility === "hidden") continue;
    const scrolls = el.closest("#log, #chats");
    if (r.left < -0.5 || r.right > W + 0.5 || (!scrolls && (r.top < -0.5 || r.bottom > H + 0.5)))
      bad.push(`${el.id || el.className || el.tagName}: ${r.left},${r.top} .. ${r.right},${r.bottom}`);
  }
  for (const m of document.querySelectorAll(".msg"))
    if (m.scrollWidth > m.clientWidth + 1) bad.push(`message overflows: ${m.scrollWidth} > ${m.clientWidth}`);
  return bad;
}"""

SEEDED = {
    "id": "seeded", "created": 1, "updated": 2, "system": "",
    "messages": [
        {"role": "user", "content": "A long word: " + "supercalifragilistic" * 12},
        {"role": "assistant", "state": "completed", "stats": "TTFT 12 ms · 40.0 tok/s · 99 tokens",
         "content": "Here is code:\n\n```python\nprint('" + "x" * 240 + "')\n```\n\n"
                    "- a list item with `inline code`\n- and **bold** text\n\nhttps://example.com/"
                    + "a/very/long/path" * 10},
    ],
}


@pytest.mark.parametrize("width,height", [pytest.param(390, 844, marks=full_only), (360, 740)])
async def test_chat_page_fits_a_phone(server, width: int, height: int) -> None:
    async with browser() as b:
        p, page = await Page.open(b, server.url, {"width": width, "height": height})
        await page.evaluate(f"""() => {{
            localStorage.setItem('tidewire.chats.v1', JSON.stringify([{json.dumps(SEEDED)}]));
            localStorage.setItem('tidewire.current.v1', '"seeded"'); }}""")
        await page.reload()
        await page.wait_for_selector("#status[data-ready='1']", timeout=30_000)
        assert await page.locator(".msg").count() == 2
        assert await page.evaluate(FITS) == []
        assert await page.evaluate("innerWidth") == width
        box = await page.locator("#input").bounding_box()
        assert box and box["width"] >= 0.6 * width, box
        for control in ("#send", "#stop", "#regenerate", "#new-chat", "#toggle-settings",
                        "#toggle-sidebar", "#status"):
            assert await page.is_visible(control), control
        if width == 390:
            await page.screenshot(path=str(ARTIFACTS / "chat-phone.png"))

        # the settings row opens below the header, and fits
        assert not await page.is_visible("#system")
        await page.click("#toggle-settings")
        assert await page.is_visible("#system")
        assert await page.evaluate(FITS) == []
        sys_box = await page.locator("#system").bounding_box()
        assert sys_box and sys_box["width"] >= 0.5 * width, sys_box
        await page.fill("#temperature", "0")
        await page.fill("#max-tokens", "400")
        if width == 390:
            await page.screenshot(path=str(ARTIFACTS / "chat-phone-settings.png"))
        await page.click("#toggle-settings")

        # the list of conversations is a drawer
        assert not await page.is_visible("#chats")
        await page.click("#toggle-sidebar")
        await page.wait_for_selector("#chats li.active", state="visible")
        assert await page.evaluate(FITS) == []
        if width == 390:
            await page.screenshot(path=str(ARTIFACTS / "chat-phone-list.png"))
        await page.click("#close-sidebar")
        assert not await page.is_visible("#chats")

        # while an answer streams (indicator shown) it still fits
        await page.click("#new-chat")
        assert await page.locator(".msg").count() == 0
        await page.fill("#input", COUNT)
        await page.press("#input", "Enter")
        await wait_text_longer(page, 0)
        assert await page.is_visible("#streaming")
        assert await page.evaluate(FITS) == []
        if width == 390:
            await page.screenshot(path=str(ARTIFACTS / "chat-phone-streaming.png"))
        await page.click("#stop")
        await page.wait_for_selector(".msg.assistant[data-state='cancelled']", timeout=30_000)
        p.check()


@full_only
async def test_conversations_survive_reload_and_new_chat_starts_empty(server) -> None:
    async with browser() as b:
        p, page = await Page.open(b, server.url)
        assert await page.locator(".msg").count() == 0
        await page.fill("#system", "Answer in one short sentence.")
        await page.fill("#temperature", "0")
        await page.fill("#max-tokens", "8")
        await page.fill("#input", "Say hello.")
        await page.press("#input", "Enter")
        await page.wait_for_selector(".msg.assistant[data-state='completed']", timeout=60_000)
        before = await page.locator(".msg").all_inner_texts()
        assert len(before) == 2 and "Say hello." in before[0]

        # every socket names the open conversation as its routing key (a load balancer
        # keeps a conversation on one replica by it)
        sockets: list[str] = []
        page.on("websocket", lambda ws: sockets.append(ws.url))

        async def routed_by_current() -> None:
            cid = await page.evaluate("JSON.parse(localStorage.getItem('tidewire.current.v1'))")
            await apoll(lambda: sockets and f"affinity={cid}" in sockets[-1], 30,
                        "a socket routed by the open conversation", every=0.05)

        await page.reload()  # the conversation and the settings are still there
        await page.wait_for_selector("#status[data-ready='1']", timeout=30_000)
        await routed_by_current()
        assert await page.locator(".msg").all_inner_texts() == before
        assert await page.locator(".msg.assistant[data-state='completed']").count() == 1
        assert await page.input_value("#system") == "Answer in one short sentence."
        assert await page.input_value("#max-tokens") == "8"
        assert await page.locator("#chats li").count() == 1
        assert "Say hello." in (await page.text_content("#chats li.active") or "")
        # ...and it is the model's history too: Regenerate replaces the restored answer
        restored = await page.query_selector(".msg.assistant")
        assert restored is not None
        await page.click("#regenerate")
        # (the new answer can finish before a check for its streaming state runs: what
        # shows it is new is that the restored element is gone)
        await restored.wait_for_element_state("hidden", timeout=30_000)
        await page.wait_for_selector(".msg.assistant[data-state='completed']", timeout=60_000)
        assert await page.locator(".msg").count() == 2

        await page.click("#new-chat")  # an empty conversation; the old one is in the list
        await routed_by_current()  # the idle socket reopened under the new one's key
        assert await page.locator(".msg").count() == 0
        assert await page.locator("#chats li").count() == 2
        assert "New chat" in (await page.text_content("#chats li.active") or "")
        await page.reload()
        await page.wait_for_selector("#status[data-ready='1']", timeout=30_000)
        assert await page.locator(".msg").count() == 0  # still the new, empty one
        old = page.locator("#chats li", has_text="Say hello.")
        await old.locator(".open").click()  # back to the old one
        assert await page.locator(".msg").count() == 2
        assert "Say hello." in (await page.text_content(".msg.user") or "")

        # an answer that streams when the page goes away is kept, marked interrupted
        await page.click("#new-chat")
        await page.fill("#system", "")  # no "one short sentence": count all the way
        await page.fill("#temperature", "0")  # greedy counting runs its 400 tokens
        await page.fill("#max-tokens", "400")
        await page.fill("#input", COUNT)
        await page.press("#input", "Enter")
        await wait_text_longer(page, 2)
        # (stored is the raw text: "1\n2\n" renders as "12", so wait for a few numbers)
        await page.wait_for_function("""() => JSON.parse(localStorage.getItem('tidewire.chats.v1'))
            .some(c => c.messages.some(m => m.state === 'streaming' && m.content.length > 8))""",
                                     timeout=30_000)
        await page.reload()
        await page.wait_for_selector("#status[data-ready='1']", timeout=30_000)
        await page.wait_for_selector(".msg.assistant[data-state='interrupted']")
        # the kept text is the stored one (a numbered list renders without its numbers:
        # "1. 1\n2. 2\n" shows as "12")
        kept = await page.evaluate("""(ask) => JSON.parse(localStorage.getItem('tidewire.chats.v1'))
            .find(c => c.messages[0].content === ask).messages[1].content""", COUNT)
        assert len(kept) > 8 and await answer_len(page) >= 2, kept
        assert "interrupted" in (await page.text_content(".msg.assistant .stats") or "")
        assert await page.locator("#chats li").count() == 2

        # deleting a conversation removes it from the list (and from storage)
        await page.locator("#chats li", has_text="Say hello.").locator(".delete").click()
        assert await page.locator("#chats li").count() == 1
        stored = await page.evaluate("JSON.parse(localStorage.getItem('tidewire.chats.v1'))")
        assert [c["messages"][0]["content"] for c in stored] == [COUNT]
        await page.screenshot(path=str(ARTIFACTS / "chat-conversations.png"))
        p.check()


class FlakyProxy:
    """A TCP proxy in front of the server, in this test's event loop. cut(): the server
    goes away for the browser: every connection is reset, and new ones are accepted and
    reset at once (counted, with their times, in `refused`); restore(): it is back, on
    the same address. The server sees its sockets drop as after a network failure, so it
    parks their streams for a resume. cut_at_delta(n): cut when the n-th delta frame
    comes from the server (before passing it on), so a stream is surely mid-way, however
    fast the model runs."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.down = False
        self.cut_at: int | None = None
        self.deltas = 0
        self.refused: list[float] = []
        self.conns: set = set()

    async def start(self) -> FlakyProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            self.refused.append(time.monotonic())
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self.conns.add(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer),
                                 self._pipe(up_reader, writer, downstream=True))
        finally:
            self.conns.discard(pair)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    downstream: bool = False) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if downstream and self.cut_at is not None:
                    self.deltas += data.count(b'"type":"delta"')
                    if self.deltas >= self.cut_at:
                        self.cut()
                        break
                writer.write(data)
                await writer.drain()
        writer.close()

    def cut_at_delta(self, n: int) -> None:
        self.cut_at, self.deltas = n, 0

    def cut(self) -> None:
        self.down, self.cut_at = True, None
        self.refused.clear()
        for pair in list(self.conns):
            for w in pair:
                w.transport.abort()

    def restore(self) -> None:
        self.down = False

    async def close(self) -> None:
        self.cut()
        self.server.close()
        await self.server.wait_closed()

    async def wait_refused(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.refused) < n:
            assert time.monotonic() < deadline, f"only {len(self.refused)} reconnect attempts"
            await asyncio.sleep(0.05)


def resumed_count(server) -> float:  # noqa: ANN001
    status, body = http_get(server.url + "/metrics")
    assert status == 200
    m = re.search(rb'^tidewire_websocket_resumable_requests_total\{outcome="resumed"\} (\S+)$',
                  body, re.M)
    return float(m.group(1)) if m else 0.0


async def wait_offline(page) -> None:  # noqa: ANN001
    await page.wait_for_selector("#status[data-conn='reconnecting']", timeout=30_000)
    assert await page.get_attribute("#status", "data-ready") is None
    status = (await page.text_content("#status") or "").lower()
    assert "connected" not in status and "reconnecting" in status, status


@full_only
async def test_connection_status_reconnect_and_resume(server) -> None:
    proxy = await FlakyProxy(int(server.url.rsplit(":", 1)[1])).start()
    try:
        async with browser() as b:
            p, page = await Page.open(b, proxy.url)
            await page.fill("#temperature", "0")
            await page.fill("#max-tokens", "300")

            # 1. The server goes away while idle: the header says so at once; a send gives
            # a readable notice and keeps the message; the page retries with backoff.
            proxy.cut()
            await wait_offline(page)
            await page.fill("#input", "Hello?")
            await page.press("#input", "Enter")
            await page.wait_for_selector("#notice", state="visible", timeout=10_000)
            notice = await page.text_content("#notice") or ""
            assert "Not connected" in notice and "still in the box" in notice, notice
            assert await page.input_value("#input") == "Hello?"
            assert await page.locator(".msg").count() == 0
            text = await page.inner_text("body")
            assert "socket error" not in text and "APIConnectionError" not in text
            await proxy.wait_refused(4)
            gaps = [b - a for a, b in zip(proxy.refused, proxy.refused[1:])]
            assert gaps[-1] > gaps[0] * 1.5, gaps  # backoff: the waits grow
            await page.screenshot(path=str(ARTIFACTS / "chat-offline.png"))
            proxy.restore()  # back: it reconnects by itself, and the notice goes
            await page.wait_for_selector("#status[data-conn='connected'][data-ready='1']",
                                         timeout=30_000)
            assert "connected" in (await page.text_content("#status") or "")
            await page.wait_for_selector("#notice", state="hidden", timeout=5_000)

            # 2. The server goes away mid-stream: the stream is resumed where it stopped
            # once the server is back, and completes.
            await page.fill("#max-tokens", "24")
            resumed = resumed_count(server)
            proxy.cut_at_delta(4)
            await page.fill("#input", COUNT)
            await page.press("#input", "Enter")
            await wait_offline(page)
            at_cut = await page.text_content(ANSWER) or ""
            assert await page.is_visible("#streaming")
            assert "Connection lost" in (await page.text_content("#streaming") or "")
            await proxy.wait_refused(3)
            assert await page.get_attribute(".msg.assistant", "data-state") == "streaming"
            assert await page.text_content(ANSWER) == at_cut  # nothing arrives meanwhile
            proxy.restore()
            await page.wait_for_selector("#status[data-conn='connected']", timeout=30_000)
            await page.wait_for_selector(".msg.assistant[data-state='completed']", timeout=120_000)
            final = await page.text_content(ANSWER) or ""
            assert final.startswith(at_cut) and len(final) > len(at_cut)
            assert resumed_count(server) == resumed + 1
            stats = await page.text_content(".msg.assistant .stats") or ""
            assert "TTFT" in stats and "tokens" in stats
            assert await page.locator(".msg.assistant").count() == 1
            assert not await page.is_visible("#streaming")

            # 3. Stop while the server is away: the answer ends at once, marked stopped.
            await page.fill("#max-tokens", "300")
            proxy.cut_at_delta(2)
            await page.fill("#input", "Now count from 300 down to 1.")
            await page.press("#input", "Enter")
            await wait_offline(page)
            assert await page.locator(".msg.assistant").nth(1).get_attribute("data-state") == "streaming"
            await page.click("#stop")
            await page.wait_for_function(
                "document.querySelectorAll('.msg.assistant')[1].dataset.state === 'cancelled'",
                timeout=10_000)
            assert "stopped" in (await page.locator(".msg.assistant .stats").nth(1).text_content() or "")
            assert not await page.is_visible("#streaming") and await page.is_enabled("#send")
            proxy.restore()
            await page.wait_for_selector("#status[data-conn='connected']", timeout=30_000)
            p.check()
    finally:
        await proxy.close()


@full_only
async def test_where_websockets_are_blocked_the_page_answers_over_http(server) -> None:
    """A network that lets HTTP through but not the WebSocket upgrade: after the socket
    fails three times the page says "connected over HTTP" and answers stream over
    resumable SSE (the SDK's streamChat: X-Tidewire-Resume, picked up by Last-Event-ID)."""
    async with browser() as b:
        page = await b.new_page(viewport=DESKTOP)
        p = Page(page)
        refused = []

        async def refuse(ws) -> None:  # noqa: ANN001 - a playwright WebSocketRoute
            refused.append(ws.url)
            await ws.close(code=4000)
        await page.route_web_socket(re.compile(r"/v1/ws(\?|$)"), refuse)
        posts = []
        page.on("request", lambda r: posts.append(r.headers) if r.method == "POST"
                and r.url.endswith("/v1/chat/completions") else None)
        await page.goto(f"{server.url}/")
        await page.wait_for_selector("#status[data-conn='http']", timeout=30_000)
        assert "over HTTP" in (await page.text_content("#status") or "")
        assert len(refused) >= 3
        await page.fill("#temperature", "0")
        await page.fill("#max-tokens", "12")
        await page.fill("#input", "Hello!")
        await page.press("#input", "Enter")
        await page.wait_for_selector(".msg.assistant[data-state='completed']", timeout=30_000)
        answer = await page.text_content(ANSWER) or ""
        stats = await page.text_content(".msg.assistant .stats") or ""
        assert answer.strip() and re.fullmatch(r"\d+ tokens · over HTTP", stats), (answer, stats)
        assert posts and posts[-1].get("x-tidewire-resume") == "1"
        assert not p.errors, p.errors
