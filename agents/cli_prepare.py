"""Preparing Claude Code and codex so that a launch starts with no dialog
(docs/agents.md#what-dispatch-writes).

Both CLIs stop at their first start in a folder with questions only a person at the
terminal could answer (onboarding, "use this API key?", "trust this folder?", a login
screen). Before each session of a type that reports through hooks (``AgentType.hooks``)
Dispatch writes the answers into the CLI's own config for the agent's HOME and working
folder, or refuses the launch saying what is missing:

- **Claude Code** — ``<HOME>/.claude.json`` (``$CLAUDE_CONFIG_DIR/.claude.json`` when
  that is set): ``hasCompletedOnboarding``, ``hasSeenAutoDefaultNotice``,
  ``projects[<cwd>].hasTrustDialogAccepted`` (a trusted folder only, ``agents.trust``) and
  the last 20 characters of ``ANTHROPIC_API_KEY`` in ``customApiKeyResponses.approved``
  (when the agent gets a key). Every session gets a ``--settings`` file of its own
  (``<DISPATCH_DATA_DIR>/agents/<agent id>/claude-settings.json``, mode 0600) wiring the
  hooks (``agents.cli_hooks.hook_command``), with ``skipDangerousModePermissionPrompt``
  for a full-access launch; the environment gets ``DISABLE_AUTOUPDATER=1`` and, for a
  full-access launch as root, ``IS_SANDBOX=1``.
- **codex** — ``<CODEX_HOME or HOME/.codex>/config.toml``:
  ``[projects."<cwd>"] trust_level = "trusted"`` (edited with ``tomlkit``, the rest of the
  file kept as it was); the hooks as ``-c hooks.<Event>=[...]`` overrides on the command
  line (nothing written), with ``--dangerously-bypass-hook-trust`` and ``--no-daemon``.
  A codex with no way to reach a model (no ``auth.json``, no ``OPENAI_API_KEY``, no
  ``model_provider`` of its own) is refused.

The values the CLIs need come from FINDINGS of running them (docs/agents.md). Every
write is a read-modify-write under an ``fcntl.flock`` on a sidecar lock file
(``<file>.dispatch-lock``), to a temporary file in the same folder, fsynced, then
``os.replace``d, the file's mode kept: two launches at once both land, and a crash never
leaves half a file. Keys Dispatch did not set are never dropped. A file that cannot be
read or parsed refuses the launch (``InvalidRequest`` naming the file) and is left as it
was.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import pwd
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomlkit
from django.conf import settings
from tomlkit.exceptions import TOMLKitError

from agents.cli_hooks import hook_command
from agents.tmux import server_environment
from agents.types import AgentType
from core.errors import InvalidRequest
from core.presence import HOSTNAME

# The events each CLI reports (docs/agents.md#hooks); the tool events take a matcher in
# Claude Code ("*": every tool). codex has no Notification event.
CLAUDE_EVENTS = ("SessionStart", "UserPromptSubmit", "Notification", "Stop", "SessionEnd")
CLAUDE_TOOL_EVENTS = ("PreToolUse", "PostToolUse", "PermissionRequest")
CODEX_EVENTS = (
    "SessionStart",
    "UserPromptSubmit",
    "PreToolUse",
    "PermissionRequest",
    "PostToolUse",
    "Stop",
    "SessionEnd",
)
# Seconds the CLI lets a PermissionRequest hook run beyond the approval's own timeout: the
# hook client waits for the answer up to that timeout, then for the expiry Dispatch records;
# the CLI must not kill it first (docs/agents.md#approvals). Both CLIs take ``timeout`` in
# seconds on a command hook.
APPROVAL_HOOK_MARGIN = 60
# Claude Code approves a custom API key by its last 20 characters.
API_KEY_TAIL = 20
MAX_CONFIG_BYTES = 16 * 1024 * 1024
LOCK_SUFFIX = ".dispatch-lock"
SETTINGS_NAME = "claude-settings.json"


@dataclass(frozen=True)
class Prepared:
    """What a session of a prepared type gets on top of its type's argv and environment:
    ``argv`` is appended to the command, ``env`` added to the environment."""

    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


def agent_environment(spec: AgentType, *, mcp_url: str, agent_id: str) -> dict[str, str]:
    """The environment the CLI will see, as far as its config goes: what Dispatch's tmux
    server passes on (``agents.tmux.server_environment``), with the type's ``env`` over it
    (a type's ``HOME``, ``CODEX_HOME`` or API key wins)."""
    return {**server_environment(), **spec.environment(mcp_url=mcp_url, agent_id=agent_id)}


def _home(env: Mapping[str, str]) -> Path:
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(home).expanduser()


def claude_config_file(env: Mapping[str, str]) -> Path:
    """Claude Code's global config for ``env``: ``$CLAUDE_CONFIG_DIR/.claude.json`` when
    ``CLAUDE_CONFIG_DIR`` is set (where the CLI keeps it then), else ``$HOME/.claude.json``."""
    config_dir = env.get("CLAUDE_CONFIG_DIR")
    if config_dir:
        return Path(config_dir).expanduser() / ".claude.json"
    return _home(env) / ".claude.json"


def codex_home(env: Mapping[str, str]) -> Path:
    """codex's home for ``env``: ``$CODEX_HOME``, else ``$HOME/.codex``."""
    configured = env.get("CODEX_HOME")
    return Path(configured).expanduser() if configured else _home(env) / ".codex"


def settings_file(agent_id: str) -> Path:
    """The per-agent Claude Code ``--settings`` file:
    ``<DISPATCH_DATA_DIR>/agents/<agent id>/claude-settings.json``."""
    return Path(settings.DATA_DIR) / "agents" / agent_id / SETTINGS_NAME


def agent_files_remove(agent_id: str) -> None:
    """Remove what Dispatch wrote for one agent under ``DISPATCH_DATA_DIR/agents/<id>``
    (its ``--settings`` file); nothing there is fine."""
    shutil.rmtree(Path(settings.DATA_DIR) / "agents" / agent_id, ignore_errors=True)


# --- files ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<path>.dispatch-lock`` (created 0600) for the block: two
    launches editing the same config take turns. The lock file stays (removing it would
    let a third writer lock a fresh inode while the second holds the old one)."""
    lock = path.with_name(path.name + LOCK_SUFFIX)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def _read(path: Path) -> str | None:
    """The file's text, ``None`` when it does not exist; ``InvalidRequest`` naming it when
    it cannot be read."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise InvalidRequest(
            f"cannot read {path} ({error.strerror or error}); fix or remove it, then launch again",
            {"file": str(path)},
        ) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InvalidRequest(f"{path} is larger than {MAX_CONFIG_BYTES} bytes: not a config file", {"file": str(path)})
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(
            f"{path} is not UTF-8 text; fix or remove it, then launch again", {"file": str(path)}
        ) from None


def _write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: a temporary file beside it, fsynced, ``os.replace``d,
    with the old file's mode and owner (a new file: 0600)."""
    try:
        current = path.stat()
    except FileNotFoundError:
        current = None
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, (current.st_mode & 0o7777) if current is not None else 0o600)
        if current is not None and os.geteuid() == 0:  # root writing a user's file: it stays theirs
            os.chown(temporary, current.st_uid, current.st_gid)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _edit(path: Path, load: Callable[[str], Any], change: Callable[[Any], bool], dump: Callable[[Any], str]) -> bool:
    """Read-modify-write ``path`` under its lock: ``load`` the text (missing file: ``""``),
    let ``change`` edit the document in place (True: it changed), ``dump`` it back only if
    it did. Returns whether the file was written."""
    with _locked(path):
        text = _read(path)
        document = load(text or "")
        if not change(document):
            return False
        _write_atomic(path, dump(document))
        return True


def _corrupt(path: Path, why: str) -> InvalidRequest:
    return InvalidRequest(
        f"{path} {why}; Dispatch does not overwrite it: fix or remove it, then launch again", {"file": str(path)}
    )


# --- Claude Code ------------------------------------------------------------------------------


def claude_config_merge(*, path: Path, cwd: str | None, api_key: str | None) -> bool:
    """Merge into Claude Code's ``.claude.json`` at ``path`` what a start with no dialog
    needs (docs/agents.md#what-dispatch-writes): ``hasCompletedOnboarding`` and
    ``hasSeenAutoDefaultNotice`` true; ``projects[cwd].hasTrustDialogAccepted`` true when
    ``cwd`` (a trusted folder) is given; the last 20 characters of ``api_key`` appended to
    ``customApiKeyResponses.approved`` when given. Every other key is kept. Returns whether
    the file was written (False: it already said all that).

    Raises ``InvalidRequest`` naming the file when it cannot be read, is not a JSON object,
    or holds one of these keys with another shape (the file is then left untouched).
    """

    def load(text: str) -> Any:
        if not text.strip():
            return {}
        try:
            return json.loads(text)
        except ValueError as error:
            raise _corrupt(path, f"is not valid JSON ({error})") from None

    def change(config: Any) -> bool:
        if not isinstance(config, dict):
            raise _corrupt(path, "is not a JSON object")
        before = json.dumps(config, sort_keys=True)
        config["hasCompletedOnboarding"] = True
        config["hasSeenAutoDefaultNotice"] = True
        if cwd is not None:
            projects = config.setdefault("projects", {})
            if not isinstance(projects, dict):
                raise _corrupt(path, "has a 'projects' that is not an object")
            project = projects.setdefault(cwd, {})
            if not isinstance(project, dict):
                raise _corrupt(path, f"has a 'projects[{cwd!r}]' that is not an object")
            project["hasTrustDialogAccepted"] = True
        if api_key:
            responses = config.setdefault("customApiKeyResponses", {})
            if not isinstance(responses, dict):
                raise _corrupt(path, "has a 'customApiKeyResponses' that is not an object")
            approved = responses.setdefault("approved", [])
            rejected = responses.setdefault("rejected", [])
            if not isinstance(approved, list) or not isinstance(rejected, list):
                raise _corrupt(path, "has a 'customApiKeyResponses' whose approved/rejected are not lists")
            tail = api_key[-API_KEY_TAIL:]
            if tail not in approved:
                approved.append(tail)
        return json.dumps(config, sort_keys=True) != before

    return _edit(path, load, change, lambda config: json.dumps(config, indent=2) + "\n")


def approval_hook_timeout(spec: AgentType | None) -> int:
    """Seconds the CLI gives its ``PermissionRequest`` hook: the type's approval timeout
    (``approval_timeout``, else ``DISPATCH_APPROVAL_TIMEOUT``) plus ``APPROVAL_HOOK_MARGIN``."""
    timeout = (spec.approval_timeout if spec is not None else None) or settings.APPROVAL_TIMEOUT
    return int(timeout) + APPROVAL_HOOK_MARGIN


def claude_settings(*, full_access: bool, spec: AgentType | None = None) -> dict[str, Any]:
    """The ``--settings`` JSON of a Claude Code session: a command hook per event
    (``hook_command``; tool events with matcher ``"*"``; the ``PermissionRequest`` hook with
    ``timeout`` ``approval_hook_timeout(spec)`` seconds, as it waits for an answer) and, for
    ``full_access``, ``skipDangerousModePermissionPrompt`` (the bypass-permissions warning
    answered for this session only)."""
    hooks: dict[str, Any] = {
        event: [{"hooks": [{"type": "command", "command": hook_command(event)}]}] for event in CLAUDE_EVENTS
    }
    for event in CLAUDE_TOOL_EVENTS:
        hooks[event] = [{"matcher": "*", "hooks": [{"type": "command", "command": hook_command(event)}]}]
    hooks["PermissionRequest"][0]["hooks"][0]["timeout"] = approval_hook_timeout(spec)
    body: dict[str, Any] = {"hooks": hooks}
    if full_access:
        body["skipDangerousModePermissionPrompt"] = True
    return body


def _write_settings(agent_id: str, body: dict[str, Any]) -> Path:
    path = settings_file(agent_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".settings.", suffix=".tmp")
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:  # mkstemp: 0600 already
        json.dump(body, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return path


def prepare_claude(
    *, env: Mapping[str, str], cwd: str, full_access: bool, agent_id: str | None, spec: AgentType | None = None
) -> Prepared:
    """Write Claude Code's config for a session in the trusted folder ``cwd`` (see
    ``claude_config_merge``) and, given ``agent_id``, its ``--settings`` file; return the
    argv and environment to add. ``agent_id`` ``None`` checks and writes the shared config
    only (a launch before its agent exists). Raises ``InvalidRequest`` as
    ``claude_config_merge``."""
    claude_config_merge(path=claude_config_file(env), cwd=cwd, api_key=env.get("ANTHROPIC_API_KEY") or None)
    extra_env = {"DISABLE_AUTOUPDATER": "1"}  # else it updates itself from npm seconds after start
    if full_access and os.geteuid() == 0:
        extra_env["IS_SANDBOX"] = "1"  # else --dangerously-skip-permissions refuses to run as root
    if agent_id is None:
        return Prepared(env=extra_env)
    path = _write_settings(agent_id, claude_settings(full_access=full_access, spec=spec))
    return Prepared(argv=("--settings", str(path)), env=extra_env)


# --- codex ------------------------------------------------------------------------------------


def _load_toml(path: Path) -> Callable[[str], tomlkit.TOMLDocument]:
    def load(text: str) -> tomlkit.TOMLDocument:
        try:
            return tomlkit.parse(text)
        except TOMLKitError as error:
            raise _corrupt(path, f"is not valid TOML ({error})") from None

    return load


def _argv_sets(argv: tuple[str, ...] | list[str], key: str) -> bool:
    """Whether ``argv`` overrides config ``key`` (``-c key=…`` / ``--config key=…``)."""
    return any(
        previous in ("-c", "--config") and part.split("=", 1)[0].strip() == key
        for previous, part in itertools.pairwise(argv)
    )


def codex_login_check(*, env: Mapping[str, str], argv: tuple[str, ...] | list[str] = ()) -> None:
    """Refuse (``InvalidRequest``) a codex that has no way to reach a model: no
    ``auth.json`` in its home (``codex login``), no ``OPENAI_API_KEY`` / ``CODEX_API_KEY`` in
    its environment, and no ``model_provider`` of its own (in ``config.toml`` or a ``-c``
    in ``argv``) — it would stop at its sign-in screen. A ``config.toml`` that cannot be
    read or parsed is refused too, naming it."""
    home = codex_home(env)
    if (home / "auth.json").is_file() or env.get("OPENAI_API_KEY") or env.get("CODEX_API_KEY"):
        return
    if _argv_sets(argv, "model_provider"):
        return
    config = home / "config.toml"
    text = _read(config)
    if text is not None:
        provider = _load_toml(config)(text).get("model_provider")
        if isinstance(provider, str) and provider and provider != "openai":
            return
    user = pwd.getpwuid(os.geteuid()).pw_name
    raise InvalidRequest(
        f"codex cannot reach a model as user {user} on host {HOSTNAME}: there is no {home / 'auth.json'} "
        f"(run `codex login` as {user} there), no OPENAI_API_KEY in the agent type's or the server's "
        f"environment, and no model_provider in {config}",
        {"file": str(config), "user": user, "host": HOSTNAME},
    )


def codex_config_trust(*, path: Path, cwd: str) -> bool:
    """Set ``[projects."<cwd>"] trust_level = "trusted"`` in codex's ``config.toml`` at
    ``path`` (created 0600 if missing), everything else kept byte for byte (``tomlkit``).
    Returns whether the file was written. Raises ``InvalidRequest`` naming the file when it
    cannot be read or parsed, or ``projects`` / its entry is not a table."""

    def change(document: tomlkit.TOMLDocument) -> bool:
        projects = document.get("projects")
        if projects is None:
            projects = tomlkit.table(is_super_table=True)
            document["projects"] = projects
        elif not isinstance(projects, dict):
            raise _corrupt(path, "has a 'projects' that is not a table")
        entry = projects.get(cwd)
        if entry is None:
            entry = tomlkit.table()
            entry["trust_level"] = "trusted"
            projects[cwd] = entry
            return True
        if not isinstance(entry, dict):
            raise _corrupt(path, f"has a 'projects.\"{cwd}\"' that is not a table")
        if entry.get("trust_level") == "trusted":
            return False
        entry["trust_level"] = "trusted"
        return True

    return _edit(path, _load_toml(path), change, tomlkit.dumps)


def codex_hook_overrides(spec: AgentType | None = None) -> list[str]:
    """``-c hooks.<Event>=[{hooks=[{type="command",command="…"}]}]`` for each codex event:
    the hooks for this process only, nothing written to the user's ``hooks.json``. The
    ``PermissionRequest`` hook also gets ``timeout=<approval_hook_timeout(spec)>`` (seconds,
    codex's ``timeout`` key; it waits for an answer)."""
    argv: list[str] = []
    for event in CODEX_EVENTS:
        # A JSON string is a valid TOML basic string (same escapes for what json.dumps emits).
        command = json.dumps(hook_command(event))
        timeout = f",timeout={approval_hook_timeout(spec)}" if event == "PermissionRequest" else ""
        argv += ["-c", f'hooks.{event}=[{{hooks=[{{type="command",command={command}{timeout}}}]}}]']
    return argv


def prepare_codex(
    *, env: Mapping[str, str], cwd: str, argv: tuple[str, ...] | list[str], spec: AgentType | None = None
) -> Prepared:
    """Check codex can reach a model (``codex_login_check``), trust ``cwd`` in its
    ``config.toml`` (``codex_config_trust``) and return the argv to add: ``--no-daemon``
    (without it C-c only detaches and a background server outlives the pane),
    ``--dangerously-bypass-hook-trust`` (the hooks are Dispatch's own, given for this
    process) and the hook overrides — the flags the type's argv does not already have."""
    codex_login_check(env=env, argv=argv)
    codex_config_trust(path=codex_home(env) / "config.toml", cwd=cwd)
    extra = [flag for flag in ("--no-daemon", "--dangerously-bypass-hook-trust") if flag not in argv]
    return Prepared(argv=(*extra, *codex_hook_overrides(spec)))


# --- entry point -----------------------------------------------------------------------------


def prepare(
    *, spec: AgentType, cwd: str, full_access: bool, env: Mapping[str, str], agent_id: str | None = None
) -> Prepared:
    """Prepare a session of ``spec`` in the trusted folder ``cwd`` with environment ``env``
    (``agent_environment``): ``prepare_claude`` or ``prepare_codex`` by ``spec.hooks``,
    nothing for a type without hooks. ``agent_id`` ``None``: a check before the agent
    exists (the shared config is written, no per-agent file). Raises ``InvalidRequest``
    saying what is missing or which file is unusable; nothing is written then."""
    if spec.hooks == "claude":
        return prepare_claude(env=env, cwd=cwd, full_access=full_access, agent_id=agent_id, spec=spec)
    if spec.hooks == "codex":
        return prepare_codex(env=env, cwd=cwd, argv=spec.full_access_argv if full_access else spec.argv, spec=spec)
    return Prepared()
