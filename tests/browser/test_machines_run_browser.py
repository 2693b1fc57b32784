"""A person runs commands from the Machines page (docs/live-operations.md#the-machines-page):
one runs, its output arrives while it runs, and another is cancelled.

A real ``manage.py serve``, two real shims (``python -m machines.shim run``, protocol 2.1)
attached to every session, Chromium. The page reads the REST routes' server-sent events
with ``fetch``; nothing here talks to the server behind the page's back except to check
that a cancelled command's process is gone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.infra import Instance, Server, ShimProcess, instance, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.integration, pytest.mark.timeout(120)]

STREAMED = "for i in 1 2 3 4 5; do echo line$i; sleep 0.4; done"
SLOW = "echo started; sleep 30"
# Collects, per output line added to the pane, when it arrived (ms since the page's start).
WATCH_OUTPUT = """() => {
  window.arrivals = [];
  new MutationObserver((records) => {
    for (const record of records) for (const node of record.addedNodes)
      window.arrivals.push([performance.now(), node.textContent]);
  }).observe(document.getElementById("run-output"), { childList: true });
  window.resultAt = null;
  new MutationObserver(() => { if (window.resultAt === null) window.resultAt = performance.now(); })
    .observe(document.querySelector("#run-results tbody"), { childList: true });
}"""


def sleeping(cwd: Path) -> list[int]:
    """The pids of the processes running exactly ``sleep 30`` in ``cwd`` (this test's
    commands: other tests on the machine may be sleeping too; Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and (entry / "cmdline").read_bytes() == b"sleep\x0030\x00"
                and Path(os.readlink(entry / "cwd")) == cwd.resolve()
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@dataclass
class Site:
    instance: Instance
    server: Server
    alpha: ShimProcess
    bravo: ShimProcess
    root: Path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    root = tmp_path_factory.mktemp("root")
    with instance() as inst:
        server = inst.serve()
        alpha = inst.shim("alpha", root, wait=False)
        bravo = inst.shim("bravo", root, wait=False)
        yield Site(inst, server, alpha.wait_connected(), bravo.wait_connected(), root)


@pytest.fixture
def page(site: Site, context: Any, artifacts: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The Machines page, logged in as ``admin``; a screenshot and the logs on failure."""
    from playwright.sync_api import expect

    page = context.new_page()
    page.goto(f"{site.server.url}/login/?next=/machines/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", site.instance.admin_password)
    page.click("#login-button")
    expect(page).to_have_url(f"{site.server.url}/machines/")
    failed = True
    try:
        yield page
        failed = False
    finally:
        name = request.node.name.removeprefix("test_")[:60]
        page.screenshot(path=str(artifacts / f"machines-run-{name}.png"), full_page=True)
        if failed:
            print("--- server log ---\n" + site.server.log())
            for shim in (site.alpha, site.bravo):
                print(f"--- {shim.log_path} ---\n" + shim.log())


def choose(page: Any, *machines: ShimProcess) -> None:
    """Tick exactly ``machines`` in the Run panel."""
    for box in page.locator("#run-target-list input[name=machine]").all():
        box.uncheck()
    for machine in machines:
        page.locator(f'#run-target-list [data-target="{machine.machine_id}"] input').check()


def test_a_command_run_from_the_page_shows_its_output_as_it_is_printed(site, page):
    from playwright.sync_api import expect

    choose(page, site.alpha)
    page.evaluate(WATCH_OUTPUT)
    page.fill("#run-command", STREAMED)
    page.click("#run-start")

    output = page.locator("#run-output")
    expect(output).to_contain_text("line1", timeout=5_000)
    expect(page.locator("#run-status")).to_have_text("Running on alpha…")
    expect(page.locator("#run-cancel")).to_be_enabled()
    expect(page.locator("#run-status")).to_have_text("Finished", timeout=10_000)
    assert output.inner_text().splitlines() == [f"line{i}" for i in range(1, 6)]  # one machine: no labels
    row = page.locator(f'#run-results tr[data-machine="{site.alpha.machine_id}"]')
    expect(row.locator(".result-machine")).to_have_text("alpha")
    expect(row.locator(".exit-code")).to_have_text("0")
    expect(row.locator(".result-text")).to_have_text("ok")
    # The output arrived while the command ran, not with its result.
    arrivals = page.evaluate("window.arrivals")
    first = next(at for at, text in arrivals if text.strip() == "line1")
    assert page.evaluate("window.resultAt") - first > 1_000, arrivals
    expect(page.locator("#run-cancel")).to_be_disabled()
    expect(page.locator("#run-start")).to_be_enabled()


def test_a_running_command_is_listed_in_flight_and_cancelled_from_the_page(site, page):
    from playwright.sync_api import expect

    choose(page, site.bravo)
    page.fill("#run-command", SLOW)
    page.click("#run-start")
    expect(page.locator("#run-output")).to_contain_text("started", timeout=5_000)
    request_id = page.locator("#live-operations").get_attribute("data-request-id")
    in_flight = page.locator(f'#ops-table tr[data-request-id="{request_id}"]')
    expect(in_flight).to_contain_text("bravo", timeout=8_000)  # the list refreshes every 3 s
    expect(in_flight.locator(".op-summary")).to_contain_text("sleep 30")
    expect(in_flight.locator("button.op-cancel")).to_have_text("Cancel")
    assert sleeping(site.root), "the command is not running"

    cancelled_at = time.monotonic()
    page.click("#run-cancel")
    expect(page.locator("#run-status")).to_have_text("Cancelled", timeout=6_000)
    assert time.monotonic() - cancelled_at < 6
    row = page.locator(f'#run-results tr[data-machine="{site.bravo.machine_id}"]')
    expect(row.locator(".result-text")).to_contain_text("cancelled")
    expect(row.locator(".exit-code")).to_have_text("-15")  # SIGTERM: the sleep was killed, not finished
    expect(in_flight).to_have_count(0, timeout=8_000)
    wait_until(lambda: not sleeping(site.root), timeout=3, what="the cancelled command's processes to be gone")


def test_every_machine_runs_it_and_each_line_names_its_machine(site, page):
    from playwright.sync_api import expect

    page.check("#run-all")
    page.fill("#run-command", "echo one; echo two >&2")
    page.click("#run-start")

    expect(page.locator("#run-status")).to_have_text("Finished", timeout=10_000)
    lines = sorted(page.locator("#run-output").inner_text().splitlines())
    assert lines == ["[alpha] one", "[alpha] two", "[bravo] one", "[bravo] two"]
    assert page.locator("#run-output .stderr .run-machine").count() == 2
    for shim in (site.alpha, site.bravo):
        expect(page.locator(f'#run-results tr[data-machine="{shim.machine_id}"] .exit-code')).to_have_text("0")


def test_output_is_shown_as_text_never_as_markup(site, page):
    from playwright.sync_api import expect

    choose(page, site.alpha)
    page.fill("#run-command", "echo '<img src=x onerror=window.pwned=1><b>bold</b>'")
    page.click("#run-start")

    expect(page.locator("#run-status")).to_have_text("Finished", timeout=10_000)
    expect(page.locator("#run-output")).to_have_text("<img src=x onerror=window.pwned=1><b>bold</b>")
    assert page.locator("#run-output img, #run-output b").count() == 0
    assert page.evaluate("window.pwned") is None


def test_a_copy_started_from_the_page_shows_its_progress(site, page):
    from playwright.sync_api import expect

    source = site.root / "big.bin"
    source.write_bytes(b"\x5a" * (5 * 1024 * 1024 + 17))
    page.evaluate("""() => {
      window.progressValues = [];
      const bar = document.getElementById("copy-progress");
      new MutationObserver(() => window.progressValues.push([bar.value, bar.max]))
        .observe(bar, { attributes: true, attributeFilter: ["value", "max"] });
    }""")
    page.select_option("#copy-source-machine", site.alpha.machine_id)
    page.fill("#copy-source-path", str(source))
    page.select_option("#copy-destination-machine", site.bravo.machine_id)
    page.fill("#copy-destination-path", str(site.root / "copied.bin"))
    page.click("#copy-start")

    expect(page.locator("#copy-status")).to_contain_text("Copied 5.0 MiB, SHA-256 ", timeout=20_000)
    assert (site.root / "copied.bin").read_bytes() == source.read_bytes()
    values = page.evaluate("window.progressValues")
    assert any(0 < value < total for value, total in values), values  # the bar moved during the copy
    assert page.locator("#copy-progress").evaluate("bar => bar.value === bar.max")
