"""What a newcomer reads on the pages to serve a first remote from their own computer: the
``dispatch-remote`` command naming this instance by its public base URL
(``DISPATCH_PUBLIC_URL``, what ``--server`` takes), where the client wheel is (the
Downloads page, linked from the nav bar too) — README "Serve and call a remote".

The last test follows the Remotes page to the letter against a real ``manage.py serve``:
the wheel ``make dist`` built, installed with the page's ``pip install`` command into a
fresh venv outside the clone, the page's ``weather.py`` served with the page's command,
then called."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import Client

from tests.backends import free_port
from tests.infra import PYTHON, REPO, Instance, Process, Server, instance
from tests.packaging.conftest import Dist, client_env
from tests.packaging.conftest import dist as dist  # the session's `make dist` (a fixture)
from tests.packaging.conftest import outside as outside  # a scratch folder outside the clone (a fixture)

PUBLIC_URL = "https://dispatch.example.org:8443"
WHEEL = "dispatch_remote-9.9.9-py3-none-any.whl"


def text(response: Any) -> str:
    return str(response.content.decode())


def element(page: str, element_id: str) -> str:
    """The text of the element with ``element_id`` in ``page`` (HTML): tags stripped, then
    entities decoded."""
    match = re.search(rf'id="{element_id}"[^>]*>(.*?)</(code|pre|span|p)>', page, re.DOTALL)
    assert match, f"no #{element_id} on the page"
    return html.unescape(re.sub(r"<[^>]+>", "", match.group(1)))


@pytest.fixture
def browser(owner: Any, settings: Any, tmp_path: Path) -> Client:
    settings.PUBLIC_URL = PUBLIC_URL
    settings.DIST_DIR = tmp_path
    client = Client()
    client.force_login(owner)
    return client


@pytest.mark.django_db
def test_the_empty_remotes_page_gives_the_dispatch_remote_command_with_the_public_url(browser: Client) -> None:
    page = text(browser.get("/remotes/"))

    assert element(page, "serve-command") == (
        f"dispatch-remote serve weather.py:remote --server {PUBLIC_URL} --token $DISPATCH_TOKEN"
    )
    assert "python -m remotes.client" not in page and "ws://" not in page
    assert 'href="/downloads/" id="remote-downloads-link"' in page
    assert "from dispatch_remote import Remote" in element(page, "example-remote")
    # No wheel built yet: the page says how to get one instead of an install command.
    assert "make dist" in element(page, "no-remote-wheel") and 'id="install-command"' not in page


@pytest.mark.django_db
def test_the_install_command_names_the_newest_served_wheel_at_the_public_url(browser: Client, tmp_path: Path) -> None:
    (tmp_path / WHEEL).write_bytes(b"PK")
    (tmp_path / "dispatch_remote-10.0.0-py3-none-any.whl").write_bytes(b"PK")
    (tmp_path / "dispatch_shim-11.0.0-py3-none-any.whl").write_bytes(b"PK")  # the shim is not the client

    page = text(browser.get("/remotes/"))

    assert element(page, "install-command") == (
        f"pip install {PUBLIC_URL}/downloads/dispatch_remote-10.0.0-py3-none-any.whl"
    )


@pytest.mark.django_db
def test_the_polled_fragment_gives_the_same_commands(browser: Client) -> None:
    fragment = text(browser.get("/remotes/fragment"))
    assert element(fragment, "serve-command").startswith(
        f"dispatch-remote serve weather.py:remote --server {PUBLIC_URL} "
    )


@pytest.mark.django_db
def test_a_new_token_comes_with_the_dispatch_remote_command_and_the_downloads_link(browser: Client) -> None:
    page = text(browser.post("/settings/", {"name": "laptop remote"}))

    assert element(page, "serve-command") == (
        f"dispatch-remote serve weather.py:remote --server {PUBLIC_URL} --token <the token>"
    )
    hint = page[page.index('id="serve-hint"') :]
    hint = hint[: hint.index("</p>")]
    assert 'href="/downloads/"' in hint and "python -m remotes.client" not in page


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/", "/remotes/", "/machines/", "/settings/", "/downloads/"])
def test_the_nav_bar_links_the_downloads_page(browser: Client, path: str) -> None:
    page = browser.get(path).content.decode()
    nav = page[page.index('<nav aria-label="Main">') : page.index("</nav>")]
    link = re.search(r'<a href="/downloads/"\s*([^>]*)>Downloads</a>', nav)
    assert link, nav
    assert ('aria-current="page"' in link.group(1)) == (path == "/downloads/")


# --- the page's instructions, followed against a real server ---------------------------------


def _log_in(client: httpx.Client, password: str) -> None:
    form = client.get("/login/").text
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
    assert token, form
    answer = client.post(
        "/login/",
        data={"username": "admin", "password": password, "csrfmiddlewaretoken": token.group(1)},
        headers={"Referer": f"{client.base_url}/login/"},
    )
    assert answer.status_code == 302, answer.text


@pytest.fixture
def site(dist: Dist) -> Iterator[tuple[Instance, Server]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with instance(DISPATCH_DIST_DIR=str(dist.folder), DISPATCH_PUBLIC_URL=url) as inst:
        started = inst.spawn([PYTHON, str(REPO / "manage.py"), "serve", "--port", str(port)], name="newcomer-serve")
        yield inst, Server(proc=started.proc, log_path=started.log_path, port=port).wait_healthy()


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_following_the_remotes_page_serves_a_remote_from_outside_the_clone(
    site: tuple[Instance, Server], outside: Path
) -> None:
    inst, server = site
    with httpx.Client(base_url=server.url, timeout=30) as browser:
        _log_in(browser, inst.admin_password)
        page = browser.get("/remotes/").text
    install, serve = element(page, "install-command"), element(page, "serve-command")
    assert install.startswith(f"pip install {server.url}/downloads/dispatch_remote-")
    assert serve == f"dispatch-remote serve weather.py:remote --server {server.url} --token $DISPATCH_TOKEN"

    # 1. Install: the page's pip command, into a fresh venv of the user's project.
    project = outside / f"newcomer-{server.port}"
    project.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(project / "venv")], check=True, timeout=120)
    pip = install.split()
    assert pip[:2] == ["pip", "install"]
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(project / "venv" / "bin" / "python"), *pip[1:]],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]

    # 2. Save weather.py as the page shows it; 3. serve it with the page's command, as typed.
    (project / "weather.py").write_text(element(page, "example-remote"))
    env = client_env(DISPATCH_TOKEN=inst.admin_token)
    env["PATH"] = f"{project / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    log_path = project / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            ["bash", "-c", serve], cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
    serving = Process(proc=proc, log_path=log_path)
    inst.processes.append(serving)  # stopped with the server
    serving.wait_for_log(f"serving 'weather' (1 function) on ws://127.0.0.1:{server.port}/ws")

    called = subprocess.run(
        ["dispatch-remote", "call", "weather", "get_forecast", '{"city": "Rome"}', "--server", server.url],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert called.returncode == 0, called.stdout + called.stderr
    assert '"forecast": "sunny"' in called.stdout and '"city": "Rome"' in called.stdout
