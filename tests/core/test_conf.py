"""The strict settings readers (``core.conf``; docs/architecture.md#how-the-code-is-written)."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from core.conf import env_bool, env_float, env_int, env_list, env_secret, env_str

NAME = "DISPATCH_TEST_SETTING"


@pytest.fixture(autouse=True)
def _unset(monkeypatch):
    for name in (NAME, f"{NAME}_FILE"):
        monkeypatch.delenv(name, raising=False)


def test_unset_variables_yield_the_default():
    assert env_bool(NAME, True) is True
    assert env_int(NAME, 7) == 7
    assert env_float(NAME, 0.5) == 0.5
    assert env_list(NAME, ["a"]) == ["a"]
    assert env_str(NAME, "d") == "d"
    assert env_secret(NAME) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("TRUE", True),
        (" yes ", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("OFF", False),
        ("", False),
    ],
)
def test_env_bool_reads_the_usual_spellings(monkeypatch, value, expected):
    monkeypatch.setenv(NAME, value)
    assert env_bool(NAME, not expected) is expected


@pytest.mark.parametrize("value", ["maybe", "2", "tru", "y es", "enabled"])
def test_env_bool_refuses_anything_else(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ImproperlyConfigured, match=NAME):
        env_bool(NAME, False)


def test_env_int_reads_an_integer(monkeypatch):
    monkeypatch.setenv(NAME, " 42 ")
    assert env_int(NAME, 0) == 42
    monkeypatch.setenv(NAME, "")
    assert env_int(NAME, 3) == 3


@pytest.mark.parametrize("value", ["1.5", "abc", "1e3", "0x10", "ten"])
def test_env_int_refuses_a_non_integer(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ImproperlyConfigured, match=NAME):
        env_int(NAME, 0)


def test_env_int_refuses_a_value_below_the_minimum(monkeypatch):
    monkeypatch.setenv(NAME, "9")
    with pytest.raises(ImproperlyConfigured, match=f"{NAME} must be at least 10"):
        env_int(NAME, 10, minimum=10)
    monkeypatch.setenv(NAME, "10")
    assert env_int(NAME, 0, minimum=10) == 10


def test_env_float_reads_a_number(monkeypatch):
    monkeypatch.setenv(NAME, "0.25")
    assert env_float(NAME, 1.0) == 0.25


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "1,5"])
def test_env_float_refuses_a_bad_or_non_positive_number(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ImproperlyConfigured, match=NAME):
        env_float(NAME, 1.0)


def test_env_list_splits_on_commas_and_drops_blanks(monkeypatch):
    monkeypatch.setenv(NAME, " a.example , b.example,, ,c ")
    assert env_list(NAME, ["default"]) == ["a.example", "b.example", "c"]
    monkeypatch.setenv(NAME, "")
    assert env_list(NAME, ["default"]) == []


def test_env_secret_reads_the_variable(monkeypatch):
    monkeypatch.setenv(NAME, " s3cret ")
    assert env_secret(NAME) == "s3cret"


def test_env_secret_reads_a_file(monkeypatch, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file\n")
    monkeypatch.setenv(f"{NAME}_FILE", str(secret_file))
    assert env_secret(NAME) == "from-file"


def test_env_secret_refuses_both_the_variable_and_the_file(monkeypatch, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-file")
    monkeypatch.setenv(NAME, "direct")
    monkeypatch.setenv(f"{NAME}_FILE", str(secret_file))
    with pytest.raises(ImproperlyConfigured, match=f"{NAME}_FILE"):
        env_secret(NAME)


def test_env_secret_refuses_a_missing_file(monkeypatch, tmp_path):
    monkeypatch.setenv(f"{NAME}_FILE", str(tmp_path / "absent"))
    with pytest.raises(ImproperlyConfigured, match=f"{NAME}_FILE"):
        env_secret(NAME)


def test_env_secret_refuses_an_empty_file(monkeypatch, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("  \n")
    monkeypatch.setenv(f"{NAME}_FILE", str(secret_file))
    with pytest.raises(ImproperlyConfigured, match="empty"):
        env_secret(NAME)


def test_a_bad_setting_stops_manage_py_with_a_one_line_message_naming_it():
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "dispatch.settings", "DISPATCH_WS_RATE": "abc"}
    done = subprocess.run(
        [sys.executable, str(repo / "manage.py"), "check"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "Configuration error: DISPATCH_WS_RATE must be a number, got 'abc'"
