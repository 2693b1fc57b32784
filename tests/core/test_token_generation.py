"""Tokens are safe to pass on a command line."""

from __future__ import annotations

import secrets

import pytest

from core import services


def test_it_never_issues_a_token_starting_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter(["-starts-with-a-dash", "fine-token"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(draws))
    assert services.generate_token() == "fine-token"
