"""Playwright with Debian's Chromium, driving a real server.

``browser`` launches ``/usr/bin/chromium`` headless once per module; each test gets a
fresh ``context``. Without Chromium the tests are skipped locally and fail under CI=true.
Screenshots go to ``tests/artifacts/`` (git-ignored).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.backends import unavailable
from tests.infra import REPO

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "tests" / "artifacts"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        unavailable("browser tests need Chromium: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def context(browser: Any) -> Iterator[Any]:
    """A fresh browser profile (cookies, storage) with a desktop-sized window."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    ctx.set_default_timeout(15_000)
    try:
        yield ctx
    finally:
        ctx.close()


@pytest.fixture
def artifacts() -> Path:
    """Where screenshots go: ``tests/artifacts/``."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
