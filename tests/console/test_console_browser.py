"""The web console in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``.ci/install.sh`` installs under CI) driven by Selenium.  Every
page opens without an error, the charts are drawn (a canvas with data points), commit on
a half message, resend on a dead letter and a group's offsets reset are clicked (the
page asks for the token); screenshots go to the test's temp dir.  Elsewhere, without the browser, it skips saying
what is missing."""
from __future__ import annotations

import shutil
import uuid

import pytest

from tests import console_scene
from tests.helpers import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PAGES = ("overview", "topics", "message", "halves", "transactions", "timers", "groups")


def _missing() -> list[str]:
    missing = [tool for tool in ("chromium", "chromedriver") if shutil.which(tool) is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    return missing


@pytest.fixture(scope="module")
def browser():
    missing = _missing()
    if missing:
        pytest.skip(f"no browser to drive: {', '.join(missing)} missing (CI installs "
                    "chromium and chromium-driver with apt; make install the package)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def site(mq, browser):
    scene = console_scene.build(mq, f"browser{uuid.uuid4().hex[:6]}")
    server = console_scene.serve(mq)
    yield scene, server
    server.stop()
    scene.close()


def _open(driver, server, page: str, shots=None):
    driver.get(f"{server.url}#{page}")
    driver.refresh()  # (a new hash alone does not reload; the route is drawn on load)
    drawn = wait_for(lambda: driver.find_elements("css selector", f"[data-page='{page.split('?')[0]}']"),
                     what=f"the {page} page drawn")
    errors = driver.find_elements("css selector", "#page .bad")
    assert not errors, errors[0].text
    if shots is not None:
        driver.save_screenshot(str(shots / f"{page.split('?')[0]}.png"))
    return drawn[0]


def _canvas_points(driver, chart: str) -> int:
    [div] = driver.find_elements("css selector", f".chart[data-chart='{chart}']")
    wait_for(lambda: div.find_elements("css selector", "canvas"), what=f"{chart} drawn")
    return int(div.get_attribute("data-points"))


def _click(driver, path: str) -> None:
    """Click the action button for ``path``; answer the token prompt (and a confirm)."""
    from selenium.common.exceptions import NoAlertPresentException
    [button] = driver.find_elements("css selector", f"button[data-action='{path}']")
    button.click()
    for _ in range(2):  # a confirm, then the token prompt (asked once per tab)
        try:
            alert = driver.switch_to.alert
        except NoAlertPresentException:
            break
        if "token" in alert.text:
            alert.send_keys(console_scene.TOKEN)
        alert.accept()


def test_every_page_opens_and_draws_its_charts(browser, site, tmp_path):
    scene, server = site
    for page in PAGES:
        _open(browser, server, page, tmp_path)
    wait_for(lambda: _open(browser, server, "overview") and
             _canvas_points(browser, "messages per second (in, out)") > 0,
             what="throughput points")
    _open(browser, server, "timers")
    assert _canvas_points(browser, "scheduled messages by due time") == 4
    page = _open(browser, server, f"message?id={scene.sent[0].msg_id}", tmp_path)
    assert "order 0" in page.find_element("css selector", "pre.body").text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{p}.png" for p in PAGES)


def test_commit_a_half_and_resend_a_dead_letter_by_clicking(browser, site, mq, tmp_path):
    scene, server = site
    # the open transaction first (its queue's last stable offset holds the commit back)
    _open(browser, server, "transactions")
    _click(browser, f"transactions/{scene.tid}/abort")
    wait_for(lambda: mq.admin.tx_describe(scene.tid)["state"] == "COMPLETE_ABORT",
             what="the transaction aborted")

    _open(browser, server, "halves")
    _click(browser, f"halves/{scene.half_id}/commit")
    notice = wait_for(lambda: browser.find_element("id", "notice").text, what="the answer")
    assert "COMMIT" in notice.upper(), notice
    browser.save_screenshot(str(tmp_path / "half-committed.png"))
    assert scene.half_id not in {h["id"] for h in mq.admin.half_list() +
                                 mq.admin.half_list(expired=True)}

    group = f"dl{scene.topic}"
    _open(browser, server, f"groups?group={group}")
    _click(browser, f"groups/{group}/dead-letters/resend#{scene.dead_letter.stored_id}")
    notice = wait_for(lambda: browser.find_element("id", "notice").text, what="the answer")
    assert scene.dead_letter.stored_id in notice
    browser.save_screenshot(str(tmp_path / "dead-letter-resent.png"))
    again = mq.consumer(group, [f"{scene.topic}-poison"])  # it comes back to its group
    got = wait_for(lambda: [m.body for m in again.poll(10, 0.5)], what="the resent letter")
    again.close()
    assert got == [b"poison"]


def test_a_groups_offsets_are_previewed_and_reset_from_its_page(browser, site, mq):
    from selenium.webdriver.support.ui import Select
    scene, server = site
    group = f"reset{uuid.uuid4().hex[:6]}"
    mq.admin.reset_offsets(group, scene.topic, to="latest")  # committed at each queue's end
    ends = mq.admin.reset_offsets(group, scene.topic, to="earliest", dry_run=True)
    assert any(before > after for before, after in ends.values())  # (something to move)
    _open(browser, server, f"groups?group={group}")
    browser.find_element("css selector", "input[name='reset-topic']").send_keys(scene.topic)
    Select(browser.find_element("css selector", "select[name='reset-to']")) \
        .select_by_value("earliest")
    _click(browser, f"groups/{group}/reset-offsets#dry-run")
    notice = wait_for(lambda: browser.find_element("id", "notice").text, what="the preview")
    assert '"dry_run":true' in notice and scene.topic in notice, notice
    assert mq.admin.reset_offsets(group, scene.topic, to="earliest", dry_run=True) == ends
    _open(browser, server, f"groups?group={group}")
    browser.find_element("css selector", "input[name='reset-topic']").send_keys(scene.topic)
    Select(browser.find_element("css selector", "select[name='reset-to']")) \
        .select_by_value("earliest")
    _click(browser, f"groups/{group}/reset-offsets")
    wait_for(lambda: all(b == a for b, a in mq.admin.reset_offsets(
        group, scene.topic, to="earliest", dry_run=True).values()), what="the reset")
