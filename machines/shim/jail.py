"""The path jail: every FILE_* path must resolve inside an allowed root (docs/shim-protocol.md#operations).

Paths are resolved with ``os.path.realpath`` (symlinks followed) and compared with the
roots segment by segment, so ``/home/al`` is not inside ``/home/alice`` and
``root/link/..`` is judged by where ``link`` really points. For writes the lexical parent
and its nearest existing ancestor must resolve inside a root too, so nothing is created
through a symlinked directory that points out of the roots, and the roots themselves
cannot be replaced or deleted. Relative paths are relative to the first root.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from .protocol import ErrorCode, ShimError


@dataclass(frozen=True)
class JailedPath:
    """A request path that passed the jail.

    ``real``: the realpath (final symlink followed) — what reads and writes open.
    ``entry``: the directory entry itself, ``realpath(parent)/name`` (a final symlink
    not followed) — what ``lstat``, delete and move act on.
    ``requested``: the path as the request named it, made absolute (for messages).
    """

    requested: str
    real: str
    entry: str


class PathJail:
    """Confines paths to a set of allowed roots (directories; realpaths once resolved).

    Raises ``ValueError`` from the constructor when ``roots`` is empty or one of them is
    not an existing directory. The check methods raise ``ShimError`` with
    ``PATH_OUTSIDE_ALLOWED_ROOT`` or ``INVALID_REQUEST`` (not a string, empty, NUL byte,
    a write whose last component is ``.`` or ``..``).
    """

    def __init__(self, roots: Iterable[str | os.PathLike[str]]) -> None:
        resolved: list[str] = []
        for root in roots:
            real = os.path.realpath(os.path.expanduser(os.fspath(root)))
            if not os.path.isdir(real):
                raise ValueError(f"allowed root {os.fspath(root)!r} is not an existing directory")
            if real not in resolved:
                resolved.append(real)
        if not resolved:
            raise ValueError("at least one allowed root is needed")
        self.roots: tuple[str, ...] = tuple(resolved)

    def contains(self, real_path: str) -> bool:
        """Whether the absolute, already resolved ``real_path`` is a root or below one."""
        return any(_is_within(real_path, root) for root in self.roots)

    def absolute(self, path: object, field: str = "path") -> str:
        """``path`` made absolute against the first root, not resolved.

        Raises ``ShimError(INVALID_REQUEST)`` unless ``path`` is a non-empty string
        without NUL bytes; ``field`` names the payload field in the message.
        """
        if not isinstance(path, str) or not path:
            raise ShimError(ErrorCode.INVALID_REQUEST, f"'{field}' must be a non-empty string")
        if "\x00" in path:
            raise ShimError(ErrorCode.INVALID_REQUEST, f"'{field}' must not contain NUL bytes")
        return os.path.join(self.roots[0], path)  # an absolute path replaces the root

    def check(self, path: object, field: str = "path") -> JailedPath:
        """Resolve a path that will be read, listed, stat'ed, deleted or moved from.

        The realpath must be inside a root, else ``PATH_OUTSIDE_ALLOWED_ROOT``.
        """
        requested = self.absolute(path, field)
        real = os.path.realpath(requested)
        self._require_inside(real, requested)
        parent, name = _split(requested)
        entry = os.path.join(os.path.realpath(parent), name) if name else real
        return JailedPath(requested=requested, real=real, entry=entry)

    def check_write(self, path: object, field: str = "path") -> JailedPath:
        """Resolve a path that will be created, written, replaced, deleted or moved to.

        Besides the path itself, its lexical parent and the parent's nearest existing
        ancestor must resolve inside a root, else ``PATH_OUTSIDE_ALLOWED_ROOT``.
        The returned ``entry`` is ``realpath(parent)/name``.
        """
        requested = self.absolute(path, field)
        parent, name = _split(requested)
        if name in ("", ".", ".."):
            raise ShimError(
                ErrorCode.INVALID_REQUEST,
                f"'{field}' must end in a file or directory name, not {name or '/'!r}",
                {field: requested},
            )
        real_parent = os.path.realpath(parent)
        self._require_inside(real_parent, requested)
        self._require_inside(os.path.realpath(_nearest_existing(parent)), requested)
        real = os.path.realpath(requested)
        self._require_inside(real, requested)
        return JailedPath(requested=requested, real=real, entry=os.path.join(real_parent, name))

    def _require_inside(self, real: str, requested: str) -> None:
        if not self.contains(real):
            raise ShimError(
                ErrorCode.PATH_OUTSIDE_ALLOWED_ROOT,
                f"{requested} is outside the allowed roots",
                {"path": requested, "allowed_roots": list(self.roots)},
            )


def _is_within(path: str, root: str) -> bool:
    """Segment-wise containment of two absolute, normalised paths."""
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # e.g. a relative path, which a realpath never is
        return False


def _split(path: str) -> tuple[str, str]:
    """``(lexical parent, last component)`` of an absolute path, trailing slashes ignored."""
    stripped = path.rstrip(os.sep) or os.sep
    return os.path.dirname(stripped), os.path.basename(stripped)


def _nearest_existing(path: str) -> str:
    """The longest lexical prefix of ``path`` that exists (``lexists``: a dangling link counts)."""
    current = path
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current
