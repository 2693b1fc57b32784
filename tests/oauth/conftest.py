"""The OAuth tests' shared fixture: ``browser``, headless Chromium per module, as the browser
tests launch it (tests/browser/conftest.py)."""

from tests.browser.conftest import browser  # noqa: F401
