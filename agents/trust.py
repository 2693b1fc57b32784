"""Folder trust: which working folders Claude Code and codex are told to trust
(docs/agents.md#folder-trust).

Both CLIs ask before working in a folder they have not seen. Dispatch answers that question
for them (``agents.cli_prepare`` writes the answer into their config), so the answer must be
a person's: a folder is trusted for an owner when

- a ``TrustedFolder`` row of that owner has exactly its normalised path (a person launched
  there with ``trust_folder``: ``folder_trust``), or
- it is one of ``settings.TRUSTED_ROOTS`` (``DISPATCH_TRUSTED_ROOTS``, folders an admin
  trusts once for everyone) or inside one.

A launch of a type that reports through hooks (``AgentType.hooks``: claude, codex) in a
folder that is not trusted is refused with ``FolderNotTrusted`` (``FOLDER_NOT_TRUSTED``);
``shell`` and ``opencode`` types need no trust. Only a person — a user's session or API
token — may trust a folder; agents (their tokens, MCP) and linked instances launch only in
folders already trusted (``launch_trust_check``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction

from agents.models import TrustedFolder
from core.errors import DispatchError, InvalidRequest

# The names the refusal gives each CLI family (AgentType.hooks).
CLI_NAMES = {"claude": "Claude Code", "codex": "codex"}


class FolderNotTrusted(InvalidRequest):
    """A CLI launch in a folder nobody trusted (400, code ``FOLDER_NOT_TRUSTED``; details
    ``{"path", "type"}``). An ``InvalidRequest``, so every edge that reports a bad launch
    reports this one too."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, details)
        self.code = "FOLDER_NOT_TRUSTED"


def normalise(path: str) -> str:
    """``path`` as trust keys it: ``~`` expanded, ``.``/``..`` and a trailing ``/`` removed
    (``os.path.normpath``), as the CLIs key their folders. Raises ``InvalidRequest`` for a
    relative path, an empty one or one with NUL."""
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        raise InvalidRequest("a trusted folder is an absolute path")
    expanded = os.path.expanduser(path.strip())
    if not os.path.isabs(expanded):
        raise InvalidRequest(f"a trusted folder is an absolute path, not '{path}'")
    return os.path.normpath(expanded)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def trusted_roots() -> tuple[str, ...]:
    """``settings.TRUSTED_ROOTS`` normalised (absolute entries only; a relative one is ignored)."""
    roots: Iterable[str] = getattr(settings, "TRUSTED_ROOTS", ()) or ()
    return tuple(os.path.normpath(root) for root in roots if isinstance(root, str) and os.path.isabs(root))


def folder_is_trusted(*, owner: User, path: str) -> bool:
    """Whether ``path`` is trusted for ``owner``: a ``TrustedFolder`` of theirs with exactly
    its normalised path, or inside one of ``trusted_roots()``. For a root, the real path
    (symlinks resolved) must be inside the root's real path too, so a symlink under a root
    cannot lend its trust to a folder outside it. Raises ``InvalidRequest`` for a path
    ``normalise`` refuses."""
    folder = normalise(path)
    if TrustedFolder.objects.filter(owner=owner, path=folder).exists():
        return True
    real = os.path.realpath(folder)
    return any(_inside(folder, root) and _inside(real, os.path.realpath(root)) for root in trusted_roots())


def folder_trust(*, owner: User, path: str) -> TrustedFolder:
    """Record that ``owner`` (a person) trusts ``path`` (normalised) and return the row;
    idempotent (an existing row is returned unchanged). Raises ``InvalidRequest`` for a
    path ``normalise`` refuses."""
    folder = normalise(path)
    try:
        with transaction.atomic():
            row, _ = TrustedFolder.objects.get_or_create(owner=owner, path=folder)
    except IntegrityError:  # two launches trusting it at once: the other one's row
        row = TrustedFolder.objects.get(owner=owner, path=folder)
    return row


def refusal(*, family: str, path: str, type: str, person: bool) -> FolderNotTrusted:
    """The ``FOLDER_NOT_TRUSTED`` error for a launch of ``type`` (CLI ``family``) in ``path``;
    ``person`` says whether the caller could trust it (else it is told who can)."""
    cli = CLI_NAMES.get(family, family)
    if person:
        message = (
            f"{cli} will be told to trust {path}; launch again with trust_folder set to trust it (a person's decision)"
        )
    else:
        message = (
            f"{cli} will be told to trust {path}, and only a person can decide that: its owner launches there "
            "once with trust_folder set (the Agents page or POST /api/v1/agents with a user's token), or an "
            "admin lists it in DISPATCH_TRUSTED_ROOTS"
        )
    return FolderNotTrusted(message, {"path": path, "type": type})


def launch_trust_check(
    *, owner: User, family: str | None, path: str, type: str, trust_folder: bool, person: bool
) -> bool:
    """Check a launch's folder before anything is written (docs/agents.md#folder-trust).

    ``family`` is the type's ``AgentType.hooks`` (``None``: no trust needed, returns
    False). ``trust_folder`` asks to trust ``path``; only a ``person`` may (an agent or a
    linked instance asking is ``PERMISSION_DENIED``). Returns True when the caller must
    record the trust (``folder_trust``) once the rest of the launch is accepted. Raises
    ``FolderNotTrusted`` when the folder is not trusted and the caller did not (or could
    not) trust it.
    """
    if family is None:
        return False
    if trust_folder and not person:
        raise DispatchError(
            "PERMISSION_DENIED",
            "trust_folder is a person's decision: an agent or a linked instance cannot trust a folder",
            {"path": path},
        )
    if folder_is_trusted(owner=owner, path=path):
        return False
    if trust_folder:
        return True
    raise refusal(family=family, path=normalise(path), type=type, person=person)
