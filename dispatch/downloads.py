"""``/downloads/``: the client wheels this instance serves, to anyone (issue 13).

The one path of the site that needs no login: the shim and the remote client are
installed on computers that have no session yet (``pipx install <public URL>/downloads/
dispatch_shim-<version>-py3-none-any.whl``). It serves the index page and the client
packages ``core.downloads`` finds in ``DIST_DIR``, and nothing else: any other name is 404.

Both views are async; the folder is read and the files are streamed from worker threads,
so a slow download holds neither the event loop nor the shared sync thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_not_required
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.http import content_disposition_header
from django.views.decorators.http import require_safe

from core import downloads

CHUNK_BYTES = 64 * 1024


@login_not_required
@require_safe
async def downloads_page(request: HttpRequest) -> HttpResponse:
    """``GET /downloads/``: each client package's name (a link), version, size and SHA-256;
    with none, how to build them (``make dist``)."""
    packages = await sync_to_async(downloads.client_packages, thread_sensitive=False)(with_sha256=True)
    response: HttpResponse = await sync_to_async(render)(request, "dispatch/downloads.html", {"packages": packages})
    return response


@login_not_required
@require_safe
async def download_file(request: HttpRequest, filename: str) -> FileResponse:
    """``GET /downloads/<filename>``: the file as an attachment (``application/zip`` for a
    wheel, ``application/gzip`` for an sdist). 404 for any name that is not a client
    package in ``DIST_DIR`` (other files, paths, symlinks out of the folder)."""
    package = await sync_to_async(downloads.client_package, thread_sensitive=False)(filename)
    if package is None:
        raise Http404("no such download")
    response = FileResponse(_chunks(package.path, package.size_bytes), content_type=package.content_type)
    response["Content-Length"] = str(package.size_bytes)
    disposition = content_disposition_header(as_attachment=True, filename=package.filename)
    assert disposition is not None  # an attachment always has one
    response["Content-Disposition"] = disposition
    response["X-Content-Type-Options"] = "nosniff"
    return response


async def _chunks(path: Path, size_bytes: int) -> AsyncIterator[bytes]:
    """The file's first ``size_bytes`` bytes (its size when listed, the ``Content-Length``:
    ``make dist`` may rewrite it meanwhile), read in a worker thread. The file is opened
    only when the body is sent (not for ``HEAD``) and closed at the end, also when the
    client goes away mid-download."""
    handle = await sync_to_async(_open_binary, thread_sensitive=False)(path)
    read = sync_to_async(handle.read, thread_sensitive=False)
    try:
        remaining = size_bytes
        while remaining > 0:
            chunk = await read(min(CHUNK_BYTES, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk
    finally:
        await sync_to_async(handle.close, thread_sensitive=False)()


def _open_binary(path: Path) -> BinaryIO:
    return path.open("rb")
