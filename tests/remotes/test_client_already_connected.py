"""The README's ``python weather.py`` (a ``Remote`` with ``remote.run()``) started twice: the
second copy ends like ``dispatch-remote serve`` does, with one ``error: …`` line on stderr
and exit status 1, never a traceback (docs/ws-protocol.md ``remote-connect``: names are
unique per user and never taken over from a live session).

A real ``manage.py serve``; both copies are real ``python weather.py`` processes, the
README's block as it is except ``remote.run(retry_window=1)``, so the second one gives up
after 1 s instead of 30.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.infra import PYTHON, REPO, Instance, Server, instance
from tests.remotes.client.test_client_first_run import readme_snippet

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ALREADY_CONNECTED = "error: remote 'weather-service' is already connected"
RETRY_NOTICE = re.compile(r"remote 'weather-service' is still registered; retrying in \d+\.\ds")


@pytest.fixture(scope="module")
def site() -> Iterator[tuple[Instance, Server]]:
    with instance() as inst:
        yield inst, inst.serve()


def weather_script(folder: Path) -> Path:
    """The README's ``weather.py``, importing this clone's client, with a 1 s retry window."""
    snippet = readme_snippet()
    assert "    remote.run()" in snippet
    script = folder / "weather.py"
    script.write_text(snippet.replace("    remote.run()", "    remote.run(retry_window=1)"))
    return script


def test_a_second_python_weather_py_exits_1_with_one_error_line_and_no_traceback(
    site: tuple[Instance, Server], tmp_path: Path
) -> None:
    inst, server = site
    script = weather_script(tmp_path)
    env = {
        **inst.env,
        "PYTHONPATH": str(REPO),
        "DISPATCH_URL": server.url,
        "DISPATCH_TOKEN": inst.admin_token,
    }
    first = inst.spawn([PYTHON, str(script)], name="weather-first", **env)
    first.wait_for_log("serving 'weather-service' (1 function) on")
    assert server.remote_names(inst.admin_token) == ["weather-service"]

    second = subprocess.run([PYTHON, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    lines = second.stderr.splitlines()
    assert second.returncode == 1, second.stderr
    assert "Traceback" not in second.stderr, second.stderr
    assert lines[-1] == ALREADY_CONNECTED, second.stderr
    assert all(RETRY_NOTICE.fullmatch(line) for line in lines[:-1]), second.stderr
    assert lines[:-1], "the second copy retries for its window before it gives up"
    assert second.stdout == ""
    # The first copy still serves the name.
    assert first.running, first.log()
    assert server.remote_names(inst.admin_token) == ["weather-service"]


def test_run_refuses_a_negative_retry_window_before_connecting() -> None:
    from remotes.client import Remote

    with pytest.raises(ValueError, match="retry_window"):
        Remote("weather-service", url="http://127.0.0.1:9", token="t").run(retry_window=-1)
