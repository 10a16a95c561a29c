"""The admin in a real browser, as a shop's staff first meet it: Debian's headless chromium
(through chromedriver), 1366 px wide, against Django's live-server thread on the test project.
A superuser logs in, reads the runs list (no horizontal scroll, durations), a failed run's
traceback as text, the keys list with whether each key blocks a new start, and releases a key
and reads which one. With DURABLE_SCREENSHOTS=1 it also saves the pictures in docs/django.md
(docs/img/django-admin-*.png; run this file alone then, as the filters list every workflow in
the session's database); CI leaves the checkout alone."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from .test_admin import KEYS, RUNS

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(180)]

# A 1366 x 768 screen less the browser's own bars: pages taller than that show a scrollbar,
# which the lists must leave room for.
WIDTH, HEIGHT = 1366, 650
IMAGES = Path(__file__).resolve().parents[2] / "docs" / "img"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    f"--window-size={WIDTH},{HEIGHT}",
]


class PaymentDeclined(Exception):
    """What the payment provider answers for a card it refuses."""


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


@pytest.fixture(scope="module")
def shop(django_project: Any) -> Any:
    """A shop's first hour: orders fulfilled, a payment declined, a long warehouse key, an order
    still queued; the ids of the runs the test looks at."""
    from tests.django.shop.models import Order
    from tests.django.shop.workflows import fulfil

    durable = django_project
    charge = durable.workflow("charge_card", key="payment:{order_id}", reuse="after_failure")

    @charge.step
    def authorize(order_id, amount):
        return {"authorization": f"auth_{order_id}"}

    @charge.step
    def capture(order_id, amount):
        if amount > 100:
            raise PaymentDeclined(f"card ending 4242 declined for {amount:.2f} EUR: insufficient funds")
        return {"captured": amount}

    restock = durable.workflow("restock", key="warehouse:{site}:sku:{sku}", reuse="never")

    @restock.step
    def reserve(site, sku):
        return {"reserved": sku}

    orders = [Order.objects.create(item=item) for item in ("book", "lamp", "mug", "desk", "pen")]
    fulfilled = [fulfil.start({"order_id": o.pk}) for o in orders[:3]]
    paid = charge.start({"order_id": orders[0].pk, "amount": 24.5})
    declined = charge.start({"order_id": orders[3].pk, "amount": 189.0})
    stock = restock.start({"site": "eu-west-1-dublin", "sku": "BK-2231-hardcover-blue"})
    time.sleep(1.3)  # they wait in the queue a while, as behind a busy worker
    for workflow, run_id in [*((fulfil, r) for r in fulfilled), (charge, paid), (charge, declined)]:
        _run_to_the_end(durable, workflow, run_id)
    _run_to_the_end(durable, restock, stock)
    waiting = fulfil.start({"order_id": orders[4].pk})  # still queued: no worker yet
    # The lists show the shop's runs only: other tests' runs share this session's database.
    only = f"?workflow__in={fulfil.name},{charge.name},{restock.name}"
    return {"fulfilled": fulfilled, "declined": declined, "waiting": waiting, "only": only}


def _run_to_the_end(durable: Any, workflow: Any, run_id: str) -> None:
    """Run the run's steps in this thread, as a worker would, until it finishes."""
    for _ in workflow.steps:
        run = durable.get_run(run_id)
        if run.status not in ("pending", "running"):
            break
        durable.run_message(workflow.name, run.step_index, run_id)
    assert durable.get_run(run_id).status in ("completed", "failed")


@pytest.fixture
def site(shop: Any) -> Iterator[str]:
    """The test project served by Django's live-server thread (the admin's CSS included)."""
    import django.contrib.admin
    from django.test import override_settings
    from django.test.testcases import LiveServerThread, _StaticFilesHandler

    static = Path(django.contrib.admin.__file__).parent / "static"
    with override_settings(STATIC_ROOT=str(static), ALLOWED_HOSTS=["localhost"]):
        server = LiveServerThread("localhost", _StaticFilesHandler)
        server.daemon = True
        server.start()
        server.is_ready.wait(timeout=20)
        if server.error:
            raise server.error
        try:
            yield f"http://localhost:{server.port}"
        finally:
            server.terminate()


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless chromium driven by Selenium, 1366 x 650 px, with a fresh profile."""
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
    driver.set_window_size(WIDTH, HEIGHT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _log_in(browser: Any, site: str, then: str) -> None:
    from django.contrib.auth.models import User
    from selenium.webdriver.common.by import By

    name = f"ops-{uuid.uuid4().hex[:6]}"
    User.objects.create_superuser(name, f"{name}@shop.example", "a-long-password")
    browser.get(f"{site}/admin/login/?{urlencode({'next': then})}")
    browser.find_element(By.ID, "id_username").send_keys(name)
    browser.find_element(By.ID, "id_password").send_keys("a-long-password")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    assert browser.find_element(By.TAG_NAME, "h1").text == "View runs"


def _fits(browser: Any) -> None:
    """The page scrolls down only, never sideways, at 1366 px: nor does a list inside it."""
    assert browser.execute_script("return window.innerWidth") == WIDTH
    assert browser.execute_script("return document.documentElement.clientWidth") < WIDTH  # a scrollbar
    width = browser.execute_script("return document.documentElement.scrollWidth")
    assert width <= WIDTH, f"the page is {width} px wide"
    for wide, room in browser.execute_script(
        "return [...document.querySelectorAll('.results')].map(r => [r.scrollWidth, r.clientWidth])"
    ):
        assert wide <= room, f"the list is {wide} px wide in {room} px: it scrolls sideways"


def _shot(browser: Any, name: str) -> None:
    """Save the whole page as docs/img/<name> when DURABLE_SCREENSHOTS is set."""
    if not os.environ.get("DURABLE_SCREENSHOTS"):
        return
    height, chrome = browser.execute_script(
        "return [document.getElementById('container').scrollHeight, outerHeight - innerHeight]"
    )
    browser.set_window_size(WIDTH, min(max(int(height), 600), 2400) + int(chrome))
    browser.save_screenshot(str(IMAGES / name))
    browser.set_window_size(WIDTH, HEIGHT)


def _cells(row: Any) -> dict[str, str]:
    """A list row's texts by column."""
    from selenium.webdriver.common.by import By

    cells = row.find_elements(By.CSS_SELECTOR, "td, th")
    return {c.get_attribute("class").split()[0].removeprefix("field-"): c.text for c in cells}


def test_the_admin_reads_well_at_1366_px(shop: Any, site: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    _log_in(browser, site, RUNS + shop["only"])
    _fits(browser)
    headers = browser.find_element(By.CSS_SELECTOR, "#result_list thead").text
    for column in ("ID", "WORKFLOW", "KEY", "STATUS", "STEP", "QUEUED", "RUNNING", "TOTAL", "CREATED"):
        assert column in headers.upper()
    done = _cells(browser.find_element(By.XPATH, f"//tr[.//span[@title='{shop['fulfilled'][0]}']]"))
    assert done["status_name"] == "completed" and done["queued"].endswith(" s"), done  # it waited 1.3 s
    assert done["short_id"] == f"…{shop['fulfilled'][0][-6:]}"
    waiting = _cells(browser.find_element(By.XPATH, f"//tr[.//span[@title='{shop['waiting']}']]"))
    assert waiting["status_name"] == "pending" and waiting["running"] == "-"
    whole = "warehouse:eu-west-1-dublin:sku:BK-2231-hardcover-blue"
    key = browser.find_element(By.XPATH, f"//td[contains(@class, 'field-key_link')]//span[@title='{whole}']")
    assert key.get_attribute("title") == whole  # cut short, the whole key in its tooltip
    assert key.text == whole[:31] + "…"
    assert browser.execute_script("return arguments[0].getClientRects().length", key) > 1  # it wraps
    _shot(browser, "django-admin-runs.png")

    browser.get(f"{site}{RUNS}{shop['declined']}/change/")
    _fits(browser)
    assert browser.find_element(By.TAG_NAME, "h1").text == "View run"
    error = browser.find_element(By.CSS_SELECTOR, ".field-error_text pre").text
    lines = error.splitlines()  # type and message on top, then the traceback, line by line
    assert lines[0] == "PaymentDeclined: card ending 4242 declined for 189.00 EUR: insufficient funds"
    assert lines[2] == "Traceback (most recent call last):" and "raise PaymentDeclined(" in error
    _shot(browser, "django-admin-run.png")

    browser.get(f"{site}{KEYS}{shop['only']}")
    _fits(browser)
    assert browser.find_element(By.TAG_NAME, "h1").text == "View keys"
    assert "BLOCKS A NEW START" in browser.find_element(By.CSS_SELECTOR, "#result_list thead").text.upper()
    declined = _cells(browser.find_element(By.XPATH, f"//tr[.//a[contains(@href, '{shop['declined']}')]]"))
    assert declined["blocks"] == "no"  # reuse="after_failure": a failed holder frees the key
    released = shop["fulfilled"][1]
    browser.find_element(By.CSS_SELECTOR, f"input[name=_selected_action][value='{released}']").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("release_keys")
    browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
    message = (
        WebDriverWait(browser, 15)
        .until(ec.presence_of_element_located((By.CSS_SELECTOR, "ul.messagelist")))
        .text
    )
    assert f"Run {released}: released key 'order:" in message and "of workflow fulfil." in message
    _fits(browser)
    _shot(browser, "django-admin-keys.png")
