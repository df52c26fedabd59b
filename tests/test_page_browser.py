"""The page for people in a real browser: Debian's headless Chromium against a live server.

Driven by Selenium through Debian's ``chromium-driver``. Why Selenium: it speaks
WebDriver, a W3C standard, to the chromedriver Debian builds from the same
source package as its chromium, so browser and driver always match and
nothing is downloaded (Playwright pins its own browser builds and only
promises to drive those). Selenium is pure Python and maintained by the
WebDriver spec's authors. ``.ci/run`` installs both packages when missing.

Set ``TURBOSPARK_PAGE_SCREENSHOT=docs/page.png`` to write README's screenshot.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import CONTEXT, serving_with_disk

from turbospark import build_synthetic_install
from turbospark.generation.generate import GenerationConfig, generate
from turbospark.generation.runner import Runner
from turbospark.server import ThreadedServer
from turbospark.text import TextCodec, load_text

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "tiny-page"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
MAX_TOKENS = 12
FIRST = "Plan a two day walk along the coast, please."
SECOND = "Which town should we sleep in?"
OTHER = "Write a short note to my neighbour about the fence."


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The hybrid family: its sessions carry prompt-boundary checkpoints, so the panel shows them.
    path = tmp_path_factory.mktemp("page-qwen-gdn")
    build_synthetic_install("qwen_gdn", path, vocab_size=128, num_layers=4, model_id=MODEL)
    return path


@pytest.fixture(scope="module")
def codec(install: Path) -> TextCodec:
    return load_text(install)


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        why = f"{' and '.join(missing)} missing: apt-get install chromium chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(f"{why} (.ci/run installs them; CI must run the browser test)")
        pytest.skip(why)
    profile = tempfile.mkdtemp(prefix="turbospark-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [
        "--headless",
        "--no-sandbox",  # root in CI, where the sandbox cannot start
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",  # small /dev/shm in containers
        "--window-size=1500,950",
        f"--user-data-dir={profile}",
    ]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER)
    )
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def greedy(install: Path, codec: TextCodec, messages: list[dict[str, str]]) -> str:
    """What the server must stream for *messages* at temperature 0 (the Python API)."""
    runner = Runner.open(install, context_length=CONTEXT)
    prompt = codec.encode_chat(messages)
    return generate(runner, codec, prompt, GenerationConfig(max_tokens=MAX_TOKENS)).text


def wait(driver: webdriver.Chrome, what: str, condition, timeout: float = 30.0):
    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"the page never showed {what}") from None


# The page re-renders as it polls, so what a check reads is read in one script.
LAST_REPLY = """
const turns = document.querySelectorAll("#turns .turn.assistant");
const reply = turns[turns.length - 1], badge = reply.querySelector(".badge");
const error = reply.querySelector(".error");
return {text: reply.querySelector(".text").textContent, error: error && error.textContent,
        cached: badge && badge.dataset.cached, prompt: badge && badge.dataset.prompt,
        reason: badge && badge.dataset.reason, badge: badge && badge.textContent};
"""
PANEL = """
return [...document.querySelectorAll("#sessions tr.session:not(.gone)")]
    .map((row) => [row.dataset.where, row.dataset.conversation]);
"""


def say(driver: webdriver.Chrome, text: str) -> dict[str, str]:
    """Send *text* in the current conversation; the finished reply's text and badge."""
    before = len(driver.find_elements(By.CSS_SELECTOR, "#turns .turn.assistant"))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()
    wait(
        driver,
        "the reply finish streaming",
        lambda d: (
            len(d.find_elements(By.CSS_SELECTOR, "#turns .turn.assistant:not(.streaming)")) > before
        ),
    )
    reply = driver.execute_script(LAST_REPLY)
    assert reply["error"] is None, reply["error"]
    return reply


def test_two_conversations_in_a_real_browser(
    install: Path, codec: TextCodec, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    expected = greedy(install, codec, [{"role": "user", "content": FIRST}])
    with serving_with_disk(install, codec, tmp_path / "sessions", slots=4) as server:
        server: ThreadedServer
        browser.get(server.base_url + "/")
        wait(browser, "the model's name", lambda d: MODEL in d.find_element(By.ID, "model").text)
        for field, value in (("max-tokens", MAX_TOKENS), ("temperature", 0)):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(str(value))

        a1 = say(browser, FIRST)
        assert a1["text"] == expected  # streamed, in order, token for token
        assert int(a1["prompt"]) == len(codec.encode_chat([{"role": "user", "content": FIRST}]))
        a2 = say(browser, SECOND)
        assert int(a2["cached"]) > 0, a2  # the second turn continues the warm session
        assert a2["reason"] in {"extends", "rewound", "checkpoint"}, a2
        assert "TTFT" in a2["badge"] and "tok/s" in a2["badge"] and "batch" in a2["badge"]

        browser.find_element(By.ID, "new-conversation").click()
        assert len(browser.find_elements(By.CSS_SELECTOR, "#turns .turn")) == 0
        b1 = say(browser, OTHER)
        assert b1["text"]

        # A reply can finish streaming before the engine hands its row back, and
        # a poll taken in between lists that session as "active": wait for one
        # taken after, when no request holds a session.
        rows = wait(
            browser,
            "two idle sessions in the panel",
            lambda d: (
                r
                if len(r := d.execute_script(PANEL)) == 2 and all(w != "active" for w, _ in r)
                else None
            ),
        )
        assert sorted(where for where, _ in rows) == ["live", "parked"]
        # Both are on disk too (write-through), and the panel lists their files.
        wait(
            browser,
            "two session files",
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#disk tr.file")) == 2,
        )
        assert len({conversation for _, conversation in rows}) == 2

        # Back to the first conversation: its earlier turns are still on the page.
        browser.find_element(By.CSS_SELECTOR, '#conversations .conversation[data-id="1"]').click()
        assert len(browser.find_elements(By.CSS_SELECTOR, "#turns .turn")) == 4

        # Nothing refused by the page's Content-Security-Policy, no script error (read
        # while the server is up: the page keeps polling it).
        problems = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not problems, problems

        shot = tmp_path / "page.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        if target := os.environ.get("TURBOSPARK_PAGE_SCREENSHOT"):
            shutil.copyfile(shot, target)
