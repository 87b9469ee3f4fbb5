"""The chat page at GET / in a real headless Chromium (Debian's `chromium`, driven by
Playwright with the system browser): it streams a reply, its stop button cancels the
server's request, and it makes no request outside the server."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.serve.conftest import Server
from tests.serve.test_faults import metrics, wait_for
from tests.serve.test_http import call

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000
LONG_REPLY = 200  # tokens: the tiny model's chat replies run their whole budget (greedy, no eos)


def test_get_slash_is_the_page_and_no_web_page_turns_it_off(launch: Callable[..., Server], tiny_artifact: Path) -> None:
    server = launch(tiny_artifact)
    status, headers, payload = call(server.url, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in headers["content-security-policy"]
    assert b"/v1/chat/completions" in payload
    assert b"http://" not in payload and b"https://" not in payload and b"//" + b"cdn" not in payload
    plain = launch(tiny_artifact, "--no-web-page")
    assert call(plain.url, "GET", "/")[0] == 404


def test_the_page_streams_a_reply_and_its_stop_button_cancels_the_request(
    launch: Callable[..., Server], tiny_artifact: Path, slow_steps: None
) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium at /usr/bin/chromium (.ci/install installs Debian's chromium package)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    server = launch(tiny_artifact, "--max-num-seqs", "2")
    requested: list[str] = []
    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(  # a fresh --user-data-dir
            profile, executable_path=CHROMIUM, args=FLAGS, headless=True
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("request", lambda request: requested.append(request.url))
            page.goto(server.url + "/")
            expect = sync_api.expect
            expect(page.locator("#model")).to_have_text("out", timeout=TIMEOUT_MS)
            page.fill("#system", "You answer briefly.")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "12")
            page.fill("#prompt", "hello")
            page.press("#prompt", "Enter")
            page.wait_for_selector("#send:not([hidden])")  # the reply has ended
            first = page.locator(".message.assistant .text").last.text_content() or ""
            assert first.strip(), "the page showed no streamed text"
            assert "context left" in page.text_content("#status")

            page.click("#clear")  # a new conversation, no system prompt: the long reply fits the context
            page.fill("#system", "")
            page.fill("#max_tokens", str(LONG_REPLY))
            page.fill("#prompt", "Tell me about the sea.")
            page.press("#prompt", "Enter")
            reply = page.locator(".message.assistant .text").last
            expect(reply).not_to_be_empty(timeout=TIMEOUT_MS)  # streamed text is showing
            page.click("#stop-generating")
            page.wait_for_selector("#send:not([hidden])")
            assert "stopped" in page.text_content("#status")
            shown = reply.text_content() or ""
        finally:
            browser.close()
    after = wait_for(server, lambda m: m["request_aborted_total"] == 1 and m["num_requests_running"] == 0, "aborted")
    assert after["request_success_total:length"] == 1  # the first reply; the stopped one did not finish
    assert after["generation_tokens_total"] < 12 + LONG_REPLY
    assert shown.strip()
    assert requested and all(url.startswith(server.url + "/") for url in requested), requested
    assert metrics(server)["num_requests_waiting"] == 0
