"""The dashboard in a real browser: Debian's headless chromium (through chromedriver) against a
uvicorn server. It logs in with the token, opens the Keys page, follows a key to its holder's
run, reads the re-add count and the dropped input's diff, presses Cancel, confirms, and sees the
run cancelled; it opens the pages of a run waiting out a retry backoff, a debounced run, a run
on a queue nobody consumes and a run whose compensation failed, and reads why each is not
moving; it follows the nav to the Flow page. With DURABLE_WEB_SCREENSHOTS=<dir> it also saves
the pages shown in the docs."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_celery.web import create_app

from .conftest import TOKEN, XSS, Scene, stuck_runs

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(180)]

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1000",
]


def _browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
    )
    if chromium and driver:
        return chromium, driver
    message = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
    if os.environ.get("DURABLE_REQUIRE_BROWSER"):
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server(scene: Scene) -> Iterator[str]:
    """A uvicorn server with the dashboard (token set) in a thread; yields its base URL."""
    import uvicorn

    port = _free_port()
    config = uvicorn.Config(
        create_app(scene.durable, token=TOKEN), host="127.0.0.1", port=port, log_level="warning"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, name="dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless chromium driven by Selenium, with a fresh profile."""
    chromium, driver_path = _browser_paths()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="durable-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _shot(driver: Any, name: str) -> None:
    folder = os.environ.get("DURABLE_WEB_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1400, min(max(int(height) + 160, 700), 2400))
        driver.save_screenshot(str(Path(folder) / name))
        driver.set_window_size(1400, 1000)


def _no_alert(driver: Any) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert  # noqa: B018 - a script from a key would have opened one


def test_keys_to_holder_to_cancel_in_chromium(scene: Scene, server: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 15)
    browser.get(f"{server}/login?next=/keys")
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "login").click()
    wait.until(ec.url_to_be(f"{server}/keys"))
    _no_alert(browser)
    assert XSS in browser.find_element(By.TAG_NAME, "main").text  # shown as text, not run
    _shot(browser, "dashboard-keys.png")

    row = browser.find_element(By.XPATH, "//table[contains(@class,'keys')]//tr[.//a[text()='invoice:42']]")
    assert "blocked" in row.text
    row.find_element(By.CSS_SELECTOR, "a.holder").click()
    wait.until(ec.url_to_be(f"{server}/runs/{scene.held}"))

    assert browser.find_element(By.ID, "holds").text == "yes"
    assert browser.find_element(By.ID, "readds").text == "2"
    assert browser.find_element(By.ID, "dropped-count").text == "1"
    diff = browser.find_element(By.ID, "dropped-1").text
    assert "amount" in diff and "- 10" in diff and "+ 12" in diff
    assert "note" in diff and '+ "rush"' in diff
    _shot(browser, "dashboard-run.png")

    browser.find_element(By.ID, "cancel").click()
    wait.until(ec.url_to_be(f"{server}/runs/{scene.held}/cancel"))
    assert scene.durable.get_run(scene.held).status == "waiting"  # asked first
    _shot(browser, "dashboard-cancel.png")
    browser.find_element(By.ID, "confirm-cancel").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "run-status"), "cancelled"))
    assert browser.find_element(By.ID, "note").text == "cancelled"
    assert scene.durable.get_run(scene.held).status == "cancelled"

    browser.get(f"{server}/")
    assert "schema up to date" in browser.find_element(By.ID, "schema").text


def test_why_runs_are_not_moving_in_chromium(scene: Scene, server: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    stuck = stuck_runs(scene)
    browser.get(f"{server}/login?next=/runs")
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.ID, "login").click()
    WebDriverWait(browser, 15).until(ec.url_to_be(f"{server}/runs"))

    def page(run_id: str) -> Any:
        browser.get(f"{server}/runs/{run_id}")
        return lambda element_id: browser.find_element(By.ID, element_id).text

    text = page(stuck.retrying)
    assert text("run-status") == "running" and text("run-state") == "retry backoff"
    assert "RuntimeError: card 4242 declined" in text("why-retry")
    assert "Attempt 2 of 3 is due" in text("why-retry") and "UTC in " in text("next-attempt")
    _shot(browser, "dashboard-retrying.png")

    text = page(stuck.debounced)
    assert text("run-status") == "pending" and text("run-state") == "debounced"
    assert "UTC in " in text("debounce-due") and "UTC in " in text("debounce-cap")
    _shot(browser, "dashboard-debounced.png")

    text = page(stuck.no_consumer)
    assert text("run-state") == "no consumer"
    assert f"start a worker with -Q {stuck.queue}" in text("why-queue")
    _shot(browser, "dashboard-no-consumer.png")

    text = page(stuck.compensation_failed)
    assert text("run-status") == "compensation_failed" and text("run-state") == "not compensated: book"
    assert text("uncompensated-step") == "book"
    assert "hotel in Oslo refuses the refund" in text("why-compensation")
    _shot(browser, "dashboard-compensation-failed.png")

    browser.get(f"{server}/workflows/trip")
    assert "unbook" in browser.find_element(By.ID, "workflow-steps").text
    browser.find_element(By.LINK_TEXT, "Flow").click()  # the nav's link to the Flow page
    WebDriverWait(browser, 15).until(ec.url_to_be(f"{server}/flow"))
    quota = browser.find_element(By.ID, "flow-quota").text
    assert "2 at once per tenant:{tenant}" in quota and "nothing in use" in quota
    _shot(browser, "dashboard-flow.png")
    browser.get(f"{server}/runs")
    _shot(browser, "dashboard-runs.png")
    browser.get(f"{server}/")
    assert "no consumer" in browser.find_element(By.TAG_NAME, "main").text
    _shot(browser, "dashboard-overview.png")
