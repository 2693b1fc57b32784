"""The client packages this instance serves at ``/downloads/`` (README.md#http-api).

``make dist`` puts the shim's and the remote client's wheels and sdists in ``DIST_DIR``
(``DISPATCH_DIST_DIR``, default ``<checkout>/dist``). A file there is a *client package*
only when it is a regular file directly inside ``DIST_DIR`` (a symlink out of it is not)
named ``dispatch_(shim|remote)-<version>-py3-none-any.whl`` or
``dispatch_(shim|remote)-<version>.tar.gz`` with a PEP 440 ``<version>``; nothing else in
the folder is listed or served.

These functions read the file system: async code calls them through
``sync_to_async(..., thread_sensitive=False)``, never on the event loop nor on the shared
sync thread (docs/architecture.md#how-the-code-is-written).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from django.conf import settings
from packaging.version import InvalidVersion, Version

SHIM = "dispatch_shim"
REMOTE = "dispatch_remote"

# A wheel's version has no "-" (the wheel spec writes it as "_"), so the suffix is unambiguous.
FILENAME = re.compile(
    r"(?P<project>dispatch_(?:shim|remote))-(?P<version>[0-9][0-9A-Za-z.+!_]*?)"
    r"(?P<suffix>-py3-none-any\.whl|\.tar\.gz)"
)
CONTENT_TYPES = {"wheel": "application/zip", "sdist": "application/gzip"}  # a wheel is a zip archive (PEP 427)
_HASH_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class ClientPackage:
    """One servable file: ``filename`` (the URL's last segment), its ``project``
    (``dispatch_shim`` / ``dispatch_remote``), ``version`` as written in the name, ``kind``,
    ``size_bytes``, its resolved ``path`` and modification time (``modified_ns``), and
    ``sha256`` (hex) when it was asked for."""

    filename: str
    project: str
    version: str
    kind: Literal["wheel", "sdist"]
    size_bytes: int
    path: Path
    modified_ns: int
    sha256: str | None = None

    @property
    def parsed_version(self) -> Version:
        return Version(self.version)

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.kind]


def parse_filename(filename: str) -> tuple[str, str, Literal["wheel", "sdist"]] | None:
    """``(project, version, kind)`` of a client package's file name, or ``None`` for any
    other name (another project, platform or suffix, an invalid PEP 440 version, a path)."""
    found = FILENAME.fullmatch(filename)
    if found is None:
        return None
    try:
        Version(found["version"])
    except InvalidVersion:
        return None
    return found["project"], found["version"], "wheel" if found["suffix"].endswith(".whl") else "sdist"


def _dist_dir() -> Path | None:
    """``DIST_DIR`` resolved, or ``None`` when it is not a folder (none yet, or a file given
    by mistake): then nothing is served and the pages say how to build the packages."""
    try:
        directory = Path(settings.DIST_DIR).resolve(strict=True)
    except OSError:  # no dist folder yet
        return None
    return directory if directory.is_dir() else None


def _package(directory: Path, filename: str) -> ClientPackage | None:
    parsed = parse_filename(filename)
    if parsed is None:
        return None
    try:
        real = (directory / filename).resolve(strict=True)
        status = real.stat()
    except OSError:
        return None
    if real.parent != directory or not real.is_file():
        return None
    project, version, kind = parsed
    return ClientPackage(filename, project, version, kind, status.st_size, real, status.st_mtime_ns)


def client_package(filename: str) -> ClientPackage | None:
    """The package served as ``/downloads/<filename>``, or ``None`` (not a client package's
    name, not in ``DIST_DIR``, or no ``DIST_DIR``)."""
    directory = _dist_dir()
    return None if directory is None else _package(directory, filename)


def client_packages(*, with_sha256: bool = False) -> list[ClientPackage]:
    """Every client package in ``DIST_DIR``: by project, newest version first, wheel before
    sdist; ``[]`` when the folder does not exist. ``with_sha256`` hashes each file (the
    digest is remembered while the file's size and modification time stay the same)."""
    directory = _dist_dir()
    if directory is None:
        return []
    found = [package for name in os.listdir(directory) if (package := _package(directory, name)) is not None]
    if with_sha256:
        found = [replace(p, sha256=_sha256(str(p.path), p.size_bytes, p.modified_ns)) for p in found]
    # Stable sorts, least significant key first.
    found.sort(key=lambda p: p.kind != "wheel")
    found.sort(key=lambda p: p.parsed_version, reverse=True)
    found.sort(key=lambda p: p.project)
    return found


def newest_wheel(project: str) -> ClientPackage | None:
    """The wheel of ``project`` (``SHIM`` / ``REMOTE``) with the highest version, if any."""
    wheels = [p for p in client_packages() if p.project == project and p.kind == "wheel"]
    return max(wheels, key=lambda p: p.parsed_version, default=None)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size_bytes: int, mtime_ns: int) -> str:
    """The file's SHA-256 (hex); cached by path, size and modification time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
