"""``/downloads/``: the client wheels this instance serves, to anyone (README.md#http-api).

The one path of the site that needs no login: the shim and the remote client are
installed on computers that have no session yet (``pipx install <public URL>/downloads/
dispatch_shim-<version>-py3-none-any.whl``). It serves the index page and the client
packages ``core.downloads`` finds in ``DIST_DIR``, and nothing else: any other name is 404.

Both views are async; the folder and the files are read in worker threads, so neither
holds the event loop nor the shared sync thread.
"""

from __future__ import annotations

from pathlib import Path

from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_not_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.http import content_disposition_header
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_safe

from core import downloads

MAX_PACKAGE_BYTES = 64 * 1024 * 1024


@csrf_exempt  # GET/HEAD only: anything else is 405, not a CSRF page
@login_not_required
@require_safe
async def downloads_page(request: HttpRequest) -> HttpResponse:
    """``GET /downloads/``: each client package's name (a link), version, size and SHA-256;
    with none, how to build them (``make dist``)."""
    packages = await sync_to_async(downloads.client_packages, thread_sensitive=False)(with_sha256=True)
    response: HttpResponse = await sync_to_async(render)(request, "dispatch/downloads.html", {"packages": packages})
    return response


@csrf_exempt  # GET/HEAD only: anything else is 405, not a CSRF page
@login_not_required
@require_safe
async def download_file(request: HttpRequest, filename: str) -> HttpResponse:
    """``GET /downloads/<filename>``: the file as an attachment (``application/zip`` for a
    wheel, ``application/gzip`` for an sdist). 404 for any name that is not a client
    package in ``DIST_DIR`` (other files, paths, symlinks out of the folder), or one that
    went away meanwhile.

    The file is read whole, in a worker thread, before the answer starts (a client package
    is tens of kilobytes): ``make dist`` rewriting it meanwhile then gives one consistent
    version with its true ``Content-Length``, never a body shorter than announced."""
    package = await sync_to_async(downloads.client_package, thread_sensitive=False)(filename)
    if package is None:
        raise Http404("no such download")
    try:
        content = await sync_to_async(_read_whole, thread_sensitive=False)(package.path)
    except OSError:
        raise Http404("no such download")
    response = HttpResponse(content, content_type=package.content_type)
    disposition = content_disposition_header(as_attachment=True, filename=package.filename)
    assert disposition is not None  # an attachment always has one
    response["Content-Disposition"] = disposition
    response["X-Content-Type-Options"] = "nosniff"
    return response


def _read_whole(path: Path) -> bytes:
    """The file's bytes; ``OSError`` when it is gone, or is larger than ``MAX_PACKAGE_BYTES``
    (a client package never is: something else was put in its place)."""
    with path.open("rb") as handle:
        content = handle.read(MAX_PACKAGE_BYTES + 1)
    if len(content) > MAX_PACKAGE_BYTES:
        raise OSError(f"{path.name} is larger than {MAX_PACKAGE_BYTES} bytes")
    return content
