"""The web page in a real headless browser: Debian's chromium driven by playwright, on a real 3-node ring of
SmolLM2 behind `prima-ctl serve --token`: the page asks for the token, shows three nodes, streams "Paris",
keeps the history, and stops an answer; it speaks to a household (what each device does, the speed in words a
second, the numbers one click away) and fits a phone 390 px wide.

CI installs the browser with `apt-get install -y chromium`; playwright (a test extra) only drives it.
$PRIMA_CHROMIUM names another chromium binary; $PRIMA_SCREENSHOTS a folder for the phone-width screenshot
(docs/page-phone.png is made so: PRIMA_SCREENSHOTS=docs)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prima_rpc.app import ring
from prima_rpc.app.local_ring import free_ports

CHROMIUM = os.environ.get("PRIMA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install -y chromium)")]
SECRET = "browser-s3cret"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def page_url(rings):
    local = rings(3, [10, 10, 10])
    (port,) = free_ports(1)
    server = subprocess.Popen([sys.executable, "-m", "prima_rpc.app.cli", "--node", local.addresses[0],
                               "serve", "--port", str(port)], env={**os.environ, "PRIMA_TOKEN": SECRET},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "serving" in server.stdout.readline()
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.terminate()
        server.communicate(timeout=15)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # CI runs as root, where chromium's sandbox cannot start, in containers with a small /dev/shm.
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


@pytest.fixture(params=[{"width": 1280, "height": 900}])
def page(browser, page_url, request):
    context = browser.new_context(viewport=request.param)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(page_url)
    page.locator("#token-form").wait_for(state="visible", timeout=10_000)  # the API has a token: the page asks
    page.fill("#token", SECRET)
    page.click("#token-form button")
    yield page
    context.close()
    assert not errors, errors  # no script error on the page


def chat_requests(page) -> list[dict]:
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    return bodies


def test_asks_for_the_token_shows_three_nodes_and_streams_paris(page, rings):
    from playwright.sync_api import expect

    nodes = page.locator("#nodes > li")
    expect(nodes).to_have_count(3, timeout=10_000)
    expect(page.locator("#token-form")).to_be_hidden()
    addresses = rings(3).addresses
    for i, does in enumerate(["answers questions", "helps with part of the model", "helps with part of the model"]):
        expect(nodes.nth(i).locator(".does")).to_have_text(does)  # in words; the numbers are hidden
        expect(nodes.nth(i).locator(".stats")).to_be_hidden()
    expect(page.locator("#plan")).to_be_hidden()
    page.click("#tech-toggle")  # the technical view, one click away
    for i, (address, role) in enumerate(zip(addresses, ["head", "worker", "worker"])):
        expect(nodes.nth(i).locator(".address")).to_have_text(address)
        expect(nodes.nth(i).locator(".role")).to_have_text(role)
        expect(nodes.nth(i).locator(".stats")).to_contain_text("stall")
    expect(nodes.nth(0).locator(".windows")).to_have_text("layers [20,30)")
    expect(page.locator("#plan")).to_be_visible()
    page.click("#tech-toggle")
    expect(nodes.nth(0).locator(".windows")).to_be_hidden()

    # Every change of the answer's text, as the browser renders it: a streamed answer has many.
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const t = document.querySelector('.msg.assistant .text');
            if (t && t.textContent !== window.seen.at(-1)) window.seen.push(t.textContent);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    sent = chat_requests(page)
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant .text")
    expect(answer).to_contain_text("Paris", timeout=60_000)
    expect(page.locator(".msg.assistant .note")).to_contain_text("tokens in", timeout=60_000)  # finished
    expect(page.locator(".msg.assistant .note")).to_contain_text("words a second")
    expect(page.locator("#speed")).to_contain_text("Answers come at about", timeout=10_000)
    expect(page.locator("#speed")).to_contain_text("words a second")
    seen = page.evaluate("window.seen")
    assert len(seen) >= 3 and seen[-1] == answer.text_content(), seen  # it grew token by token
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), seen
    assert sent == [{"messages": [{"role": "user", "content": QUESTION}], "stream": True,
                     "stream_options": {"include_usage": True}, "max_tokens": 256}]


def test_history_goes_with_the_next_question_and_stop_ends_an_answer(page, rings):
    from playwright.sync_api import expect

    sent = chat_requests(page)
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    expect(page.locator(".msg.assistant .note")).to_contain_text("tokens in", timeout=60_000)
    first = page.locator(".msg.assistant .text").first.text_content()

    page.fill("#prompt", "Write a long story about a dragon who learns to cook.")
    page.click("#send")
    second = page.locator(".msg.assistant").nth(1)
    expect(second.locator(".text")).not_to_have_text("", timeout=60_000)  # it has begun
    head = rings(3).addresses[0]
    assert ring.walk(head)[0][1].stats.active_requests == 1  # 256 tokens: seconds to go
    page.click("#stop")
    expect(second.locator(".note")).to_have_text("stopped", timeout=10_000)
    expect(page.locator("#send")).to_be_visible()
    kept = second.locator(".text").text_content()
    deadline = time.monotonic() + 5  # far less than the rest of the answer would take
    while ring.walk(head)[0][1].stats.active_requests and time.monotonic() < deadline:  # the ring let it go
        time.sleep(0.2)
    assert ring.walk(head)[0][1].stats.active_requests == 0

    page.fill("#prompt", "Thanks!")
    page.click("#send")
    expect(page.locator(".msg.assistant")).to_have_count(3)
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible(timeout=10_000)
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert sent[1]["messages"][1]["content"] == first
    assert [m["content"] for m in sent[2]["messages"]][2:] == [sent[1]["messages"][2]["content"], kept, "Thanks!"]


PHONE = {"width": 390, "height": 844}


@pytest.mark.parametrize("page", [PHONE], indirect=True)
def test_a_phone_sees_the_whole_placeholder_and_no_sideways_scrolling(page, tmp_path):
    from playwright.sync_api import expect

    expect(page.locator("#nodes > li")).to_have_count(3, timeout=10_000)
    fits = page.evaluate("""() => {
        const box = document.getElementById('prompt');
        const style = getComputedStyle(box);
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = `${style.fontSize} ${style.fontFamily}`;
        const room = box.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
        return {text: ctx.measureText(box.placeholder).width, room};
    }""")
    assert 0 < fits["text"] <= fits["room"], fits  # the placeholder is not cut off
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]  # nothing sticks out
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    expect(page.locator(".msg.assistant .note")).to_contain_text("tokens in", timeout=60_000)
    expect(page.locator("#speed")).to_contain_text("words a second", timeout=10_000)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    folder = Path(os.environ.get("PRIMA_SCREENSHOTS") or tmp_path)
    page.screenshot(path=str(folder / "page-phone.png"), full_page=True)
    assert (folder / "page-phone.png").stat().st_size > 10_000
