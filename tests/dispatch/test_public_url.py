"""The public URL (docs/deployment.md#public-url, docs/operating.md#settings): a
wildcard one is refused by ``serve`` and by ``make run``, and the URL a running ``serve``
recorded is read back only while that process lives."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.conf import recorded_public_url
from dispatch.management.commands.serve import (
    forget_public_url,
    record_public_url,
    records_its_public_url,
    unnamed_wildcard_host_error,
    wildcard_public_url_error,
)
from tests.backends import free_port
from tests.infra import PYTHON, REPO, base_env, manage


@pytest.fixture
def record(tmp_path: Path) -> Path:
    return tmp_path / "public_url.json"


@pytest.fixture
def other_live_pid() -> int:
    return os.getppid()  # pytest's parent: alive, not this process


def test_a_recorded_url_is_read_while_its_process_lives(record, other_live_pid):
    record.write_text(json.dumps({"url": "http://laptop.lan:9000", "pid": other_live_pid}))
    assert recorded_public_url(record) == "http://laptop.lan:9000"


def test_a_dead_process_s_record_is_ignored(record):
    dead = subprocess.Popen(["true"])
    dead.wait()
    record.write_text(json.dumps({"url": "http://laptop.lan:9000", "pid": dead.pid}))
    assert recorded_public_url(record) == ""


@pytest.mark.parametrize(
    "content",
    [
        "",
        "not json",
        "[]",
        '{"url": "http://x"}',
        '{"pid": 1}',
        '{"url": 5, "pid": 1}',
        '{"url": "http://x", "pid": true}',
    ],
)
def test_a_bad_record_is_ignored(record, content):
    record.write_text(content)
    assert recorded_public_url(record) == ""


def test_a_missing_record_and_this_process_s_own_are_ignored(record):
    assert recorded_public_url(record) == ""
    record.write_text(json.dumps({"url": "http://laptop.lan:9000", "pid": os.getpid()}))
    assert recorded_public_url(record) == ""


def test_serve_writes_its_record_and_removes_only_its_own(record, other_live_pid):
    record_public_url(record, "http://laptop.lan:9000")
    assert json.loads(record.read_text()) == {"url": "http://laptop.lan:9000", "pid": os.getpid()}
    forget_public_url(record)
    assert not record.exists()
    record.write_text(json.dumps({"url": "http://other:1", "pid": other_live_pid}))
    forget_public_url(record)
    assert record.exists()


@pytest.mark.parametrize(
    "url", ["http://0.0.0.0:9000", "http://[::]:9000", "https://0.0.0.0", "http://[::0]:80", "http://0.0.0.0:99999"]
)
def test_a_wildcard_public_url_is_refused(url):
    message = wildcard_public_url_error(url)
    assert message is not None
    assert "DISPATCH_PUBLIC_URL=http://laptop.lan" in message


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://laptop.lan:9000", "https://[::1]", "http://10.0.0.5"])
def test_a_reachable_public_url_is_accepted(url):
    assert wildcard_public_url_error(url) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_host_needs_a_configured_public_url(host):
    message = unnamed_wildcard_host_error(host, 9000, "default")
    assert message is not None and "DISPATCH_PUBLIC_URL=http://laptop.lan:9000" in message
    assert unnamed_wildcard_host_error(host, 9000, "DISPATCH_PUBLIC_URL") is None
    # Another live serve's record names that serve, not this machine's wildcard listener.
    assert unnamed_wildcard_host_error(host, 9000, "/data/public_url.json") is not None


@pytest.mark.parametrize("host", ["127.0.0.1", "192.168.1.5", "::1", "laptop.lan"])
def test_a_named_host_needs_no_public_url(host):
    assert unnamed_wildcard_host_error(host, 9000, "default") is None


def test_serve_on_a_wildcard_host_without_a_public_url_refuses_before_listening():
    port = free_port()
    data_dir = tempfile.mkdtemp(prefix="dispatch-c1-")
    done = manage(base_env(DISPATCH_DATA_DIR=data_dir), "serve", "--host", "0.0.0.0", "--port", str(port), check=False)
    assert done.returncode != 0
    assert "DISPATCH_PUBLIC_URL is not set" in done.stderr
    assert f"DISPATCH_PUBLIC_URL=http://laptop.lan:{port}" in done.stderr
    assert "Dispatch serving on" not in done.stdout


def test_serve_refuses_a_wildcard_public_url_before_listening():
    port = free_port()
    data_dir = tempfile.mkdtemp(prefix="dispatch-c1-")
    env = base_env(DISPATCH_DATA_DIR=data_dir, DISPATCH_PUBLIC_URL=f"http://0.0.0.0:{port}")
    done = manage(env, "serve", "--host", "0.0.0.0", "--port", str(port), check=False)
    assert done.returncode != 0
    assert "wildcard" in done.stderr and f"DISPATCH_PUBLIC_URL=http://laptop.lan:{port}" in done.stderr
    assert "Dispatch serving on" not in done.stdout
    assert not (Path(data_dir) / "public_url.json").exists()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]"])
def test_make_run_on_a_wildcard_host_refuses_without_a_public_url(host):
    env = base_env(DISPATCH_DATA_DIR=tempfile.mkdtemp(prefix="dispatch-c1-"))
    if (REPO / ".env").exists() and "DISPATCH_PUBLIC_URL=" in (REPO / ".env").read_text():
        pytest.fail("this checkout's .env sets DISPATCH_PUBLIC_URL; the test needs it unset")
    # -o: never (re)install the virtualenv from here; the refusal comes before any other step.
    done = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "run", f"HOST={host}", "PORT=9000", "PY=/bin/false"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "wildcard" in done.stderr
    assert "DISPATCH_PUBLIC_URL=http://laptop.lan:9000" in done.stderr
    assert "migrate" not in done.stdout + done.stderr


@pytest.mark.parametrize("as_make_variable", [False, True], ids=["environment", "make-variable"])
def test_make_run_on_a_wildcard_host_goes_on_with_a_public_url(as_make_variable):
    given = "DISPATCH_PUBLIC_URL=http://laptop.lan:9000"
    env = base_env() if as_make_variable else base_env(DISPATCH_PUBLIC_URL="http://laptop.lan:9000")
    # PY=echo: each step prints its command line instead of running it.
    done = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "run", "HOST=0.0.0.0", "PORT=9000", "PY=echo"]
        + ([given] if as_make_variable else []),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "manage.py migrate" in done.stdout
    assert "manage.py serve --host 0.0.0.0 --port 9000  (public URL http://laptop.lan:9000)" in done.stdout


def test_only_a_serve_whose_url_is_its_own_records_it(record):
    assert records_its_public_url("DISPATCH_PUBLIC_URL", record)
    assert records_its_public_url("default", record)
    assert not records_its_public_url(str(record), record)


@pytest.fixture
def another_serve_s_record() -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A data dir whose record names a live process (standing in for a running serve)."""
    data_dir = Path(tempfile.mkdtemp(prefix="dispatch-record-"))
    holder = subprocess.Popen(["sleep", "120"])
    (data_dir / "public_url.json").write_text(json.dumps({"url": "http://127.0.0.1:8765", "pid": holder.pid}))
    manage(base_env(DISPATCH_DATA_DIR=str(data_dir)), "migrate", "--noinput", "-v0")
    yield data_dir, holder
    holder.kill()
    holder.wait()


def test_a_second_serve_neither_takes_nor_removes_a_running_serve_s_record(another_serve_s_record):
    data_dir, holder = another_serve_s_record
    record = data_dir / "public_url.json"
    port = free_port()
    server = subprocess.Popen(
        [PYTHON, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=base_env(DISPATCH_DATA_DIR=str(data_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if "Dispatch serving on" in line:
                break
        else:
            pytest.fail("serve ended before it listened")
        assert json.loads(record.read_text())["pid"] == holder.pid
    finally:
        server.terminate()
        server.communicate(timeout=30)
    assert json.loads(record.read_text()) == {"url": "http://127.0.0.1:8765", "pid": holder.pid}


def test_a_wildcard_serve_is_refused_though_another_serve_recorded_a_url(another_serve_s_record):
    data_dir, _ = another_serve_s_record
    port = free_port()
    done = manage(
        base_env(DISPATCH_DATA_DIR=str(data_dir)), "serve", "--host", "0.0.0.0", "--port", str(port), check=False
    )
    assert done.returncode != 0
    assert "DISPATCH_PUBLIC_URL is not set" in done.stderr
    assert "Dispatch serving on" not in done.stdout
