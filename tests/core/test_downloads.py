"""``/downloads/``: the client wheels `make dist` built, served to anyone, and nothing else
(README.md#http-api)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from django.test import AsyncClient

from core import downloads

pytestmark = pytest.mark.django_db(transaction=True)

SHIM_WHEEL = "dispatch_shim-0.2.0-py3-none-any.whl"
OLD_SHIM_WHEEL = "dispatch_shim-0.1.0-py3-none-any.whl"
SHIM_SDIST = "dispatch_shim-0.2.0.tar.gz"
REMOTE_WHEEL = "dispatch_remote-0.2.0-py3-none-any.whl"


@pytest.fixture
def dist(settings: Any, tmp_path: Path) -> Path:
    """A dist folder with the shim's two wheels and sdist, the remote client's wheel, and
    files that are not client packages (all of it read through ``DIST_DIR``)."""
    folder = tmp_path / "dist"
    folder.mkdir()
    for name in (SHIM_WHEEL, OLD_SHIM_WHEEL, SHIM_SDIST, REMOTE_WHEEL):
        (folder / name).write_bytes(f"contents of {name}".encode() * 1000)
    (folder / "notes.txt").write_text("not a package")
    (folder / "dispatch_shim-0.2.0-cp311-cp311-linux_x86_64.whl").write_bytes(b"a platform wheel")
    (folder / "dispatch_shim-0.2.0-py3-none-any.whl.asc").write_text("a signature")
    settings.DIST_DIR = folder
    return folder


async def body_of(response: Any) -> bytes:
    return bytes(response.content)


async def test_anyone_sees_the_index_with_name_version_size_and_sha256(dist):
    response = await AsyncClient().get("/downloads/")
    assert response.status_code == 200
    page = response.content.decode()
    for name in (SHIM_WHEEL, OLD_SHIM_WHEEL, SHIM_SDIST, REMOTE_WHEEL):
        assert f'href="/downloads/{name}"' in page
        assert hashlib.sha256((dist / name).read_bytes()).hexdigest() in page
    assert "0.1.0" in page and "0.2.0" in page
    assert f'title="{(dist / SHIM_SDIST).stat().st_size} bytes"' in page
    for other in ("notes.txt", "cp311", ".whl.asc"):
        assert other not in page
    assert "make dist" not in page
    listed = [p.filename for p in await _packages()]
    assert listed == [REMOTE_WHEEL, SHIM_WHEEL, SHIM_SDIST, OLD_SHIM_WHEEL]  # by project, newest first


async def _packages() -> list[downloads.ClientPackage]:
    from asgiref.sync import sync_to_async

    return await sync_to_async(downloads.client_packages)()


async def test_anyone_downloads_a_wheel_as_an_attachment(dist):
    response = await AsyncClient().get(f"/downloads/{SHIM_WHEEL}")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/zip"
    assert response["Content-Disposition"] == f'attachment; filename="{SHIM_WHEEL}"'
    assert response["Content-Length"] == str((dist / SHIM_WHEEL).stat().st_size)
    assert await body_of(response) == (dist / SHIM_WHEEL).read_bytes()


async def test_an_sdist_is_served_as_gzip(dist):
    response = await AsyncClient().get(f"/downloads/{SHIM_SDIST}")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/gzip"
    assert await body_of(response) == (dist / SHIM_SDIST).read_bytes()


async def test_the_body_is_always_as_long_as_announced(dist):
    big = "dispatch_remote-1.0.0-py3-none-any.whl"
    (dist / big).write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    response = await AsyncClient().get(f"/downloads/{big}")
    body = await body_of(response)
    assert body == (dist / big).read_bytes()
    assert response["Content-Length"] == str(len(body))


async def test_a_package_gone_after_it_was_listed_is_404(dist, monkeypatch):
    listed = downloads.client_package(SHIM_WHEEL)  # found, then make dist removes it
    assert listed is not None
    (dist / SHIM_WHEEL).unlink()
    monkeypatch.setattr(downloads, "client_package", lambda filename: listed)
    assert (await AsyncClient().get(f"/downloads/{SHIM_WHEEL}")).status_code == 404


async def test_something_far_larger_than_a_package_is_not_served(dist, monkeypatch):
    from dispatch import downloads as views

    monkeypatch.setattr(views, "MAX_PACKAGE_BYTES", 1000)
    assert (await AsyncClient().get(f"/downloads/{SHIM_WHEEL}")).status_code == 404


@pytest.mark.parametrize(
    "path",
    [
        "/downloads/notes.txt",
        "/downloads/dispatch_shim-0.2.0-cp311-cp311-linux_x86_64.whl",
        "/downloads/dispatch_shim-0.2.0-py3-none-any.whl.asc",
        "/downloads/dispatch_shim-9.9.9-py3-none-any.whl",  # a valid name, not built
        "/downloads/dispatch_other-0.2.0-py3-none-any.whl",
        "/downloads/dispatch_shim-not.a.version-py3-none-any.whl",
        "/downloads/..",
        "/downloads/../secret.whl",
        "/downloads/..%2Fsecret.whl",
        "/downloads/%2e%2e%2f%2e%2e%2fsettings.py",
        "/downloads/sub/dispatch_shim-0.2.0-py3-none-any.whl",
        "/downloads/dispatch_shim-0.2.0-py3-none-any.whl/",
    ],
)
async def test_nothing_else_is_served_from_the_path(dist, path):
    response = await AsyncClient().get(path)
    assert response.status_code == 404, path


async def test_a_symlink_or_a_folder_named_like_a_wheel_is_not_served(dist, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("private")
    (dist / "dispatch_shim-3.0.0-py3-none-any.whl").symlink_to(outside)
    (dist / "dispatch_remote-3.0.0-py3-none-any.whl").mkdir()
    client = AsyncClient()
    for name in ("dispatch_shim-3.0.0-py3-none-any.whl", "dispatch_remote-3.0.0-py3-none-any.whl"):
        assert (await client.get(f"/downloads/{name}")).status_code == 404
        assert name not in (await client.get("/downloads/")).content.decode()


async def test_without_a_dist_folder_the_index_says_to_run_make_dist(settings, tmp_path):
    settings.DIST_DIR = tmp_path / "never-built"
    client = AsyncClient()
    response = await client.get("/downloads/")
    assert response.status_code == 200
    assert "No client packages are built yet" in response.content.decode()
    assert "<code>make dist</code>" in response.content.decode()
    assert (await client.get(f"/downloads/{SHIM_WHEEL}")).status_code == 404


async def test_an_empty_dist_folder_says_to_run_make_dist_too(settings, tmp_path):
    settings.DIST_DIR = tmp_path
    (tmp_path / "notes.txt").write_text("not a package")
    response = await AsyncClient().get("/downloads/")
    assert "<code>make dist</code>" in response.content.decode()


async def test_the_downloads_only_answer_get_and_head(dist):
    client = AsyncClient(enforce_csrf_checks=True)  # 405, not a CSRF page
    assert (await client.post("/downloads/")).status_code == 405
    assert (await client.post(f"/downloads/{SHIM_WHEEL}")).status_code == 405
    head = await client.head(f"/downloads/{SHIM_WHEEL}")
    assert head.status_code == 200 and head["Content-Type"] == "application/zip"
    assert head["Content-Length"] == str((dist / SHIM_WHEEL).stat().st_size)


async def test_a_logged_in_user_sees_the_same_index(dist, owner):
    client = AsyncClient()
    await client.aforce_login(owner)
    page = (await client.get("/downloads/")).content.decode()
    assert SHIM_WHEEL in page and "Log out" in page


async def test_every_other_page_and_route_still_needs_a_login(dist, owner_token):
    client = AsyncClient()
    for path in ("/machines/", "/settings/", "/", "/remotes/", "/peers/"):
        response = await client.get(path)
        assert response.status_code == 302, path
        assert response["Location"].startswith("/login/"), path
    for path in ("/api/v1/machines", "/api/v1/auth/tokens", "/api/schema/"):
        assert (await client.get(path)).status_code == 401, path
    # A real token is not needed for the downloads, and changes nothing there.
    response = await client.get(f"/downloads/{SHIM_WHEEL}", headers={"authorization": f"Bearer {owner_token}"})
    assert response.status_code == 200
    await body_of(response)


def test_parse_filename_accepts_only_client_package_names():
    assert downloads.parse_filename(SHIM_WHEEL) == ("dispatch_shim", "0.2.0", "wheel")
    assert downloads.parse_filename("dispatch_remote-1.0rc1.tar.gz") == ("dispatch_remote", "1.0rc1", "sdist")
    assert downloads.parse_filename("dispatch_shim-0.2.0.dev3+g1234-py3-none-any.whl") == (
        "dispatch_shim",
        "0.2.0.dev3+g1234",
        "wheel",
    )
    for name in ("dispatch_shim-x-py3-none-any.whl", "dispatch_shim-0.2.0.zip", "../dispatch_shim-1.0.tar.gz", ""):
        assert downloads.parse_filename(name) is None, name


async def test_a_dist_dir_that_is_a_file_serves_nothing_and_says_to_run_make_dist(settings, tmp_path):
    settings.DIST_DIR = tmp_path / SHIM_WHEEL
    settings.DIST_DIR.write_bytes(b"a file, not a folder")
    client = AsyncClient()
    response = await client.get("/downloads/")
    assert response.status_code == 200
    assert "<code>make dist</code>" in response.content.decode()
    assert (await client.get(f"/downloads/{SHIM_WHEEL}")).status_code == 404
