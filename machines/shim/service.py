"""Run the shim as a service: started at boot, restarted when it fails
(docs/shim-protocol.md#the-shim-program).

``dispatch-shim service install [run options]`` writes one file and enables it:

- Linux (systemd): a **user** unit ``~/.config/systemd/user/<name>.service``
  (``$XDG_CONFIG_HOME`` honoured), then ``systemctl --user daemon-reload``, ``enable``,
  ``restart``, and lingering (``loginctl enable-linger USER``): without lingering a
  user's units start when the user logs in, not at boot. ``--system`` (as root) writes
  ``/etc/systemd/system/<name>.service`` with ``User=`` instead.
- macOS (launchd): an agent ``~/Library/LaunchAgents/<label>.plist`` loaded with
  ``launchctl bootstrap gui/UID``; ``--system`` writes a daemon
  ``/Library/LaunchDaemons/<label>.plist`` with ``UserName``.

The service runs ``dispatch-shim run`` (the absolute path of the installed command) with
the options given to ``install``, an absolute ``--state-dir`` and absolute paths. The
token is never written into the unit: the service uses the stored login of the state
directory. ``uninstall`` disables and removes the file; ``status`` reports it. The
``systemctl``/``loginctl``/``launchctl`` calls go through a :data:`Runner` (default
:func:`run_manager_command`), so that the file handling can be tested without a service
manager.
"""

from __future__ import annotations

import contextlib
import os
import plistlib
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]
"""Runs a service-manager command (argv) to completion, output captured as text."""

Say = Callable[[str], None]
"""Prints one message for the user."""

DEFAULT_NAME = "dispatch-shim"
"""The service's default name: ``dispatch-shim.service``, launchd label ``dev.dispatch.shim``."""

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")  # never in a unit or a plist value
"""A service name: a systemd unit name (without ``.service``) and a launchd label part."""

RESTART_SECONDS = 10
"""Seconds systemd and launchd wait before starting a failed shim again."""

USAGE_EXIT_STATUS = 2
"""``dispatch-shim run`` exits 2 for bad options or configuration: restarting cannot help."""


class Manager(StrEnum):
    """The service manager a unit is written for."""

    SYSTEMD = "systemd"
    LAUNCHD = "launchd"


class ServiceError(Exception):
    """The service cannot be installed or removed as asked (the message says why)."""


def detect_manager(platform: str = sys.platform) -> Manager:
    """systemd on Linux, launchd on macOS; ``ServiceError`` elsewhere."""
    if platform.startswith("linux"):
        return Manager.SYSTEMD
    if platform == "darwin":
        return Manager.LAUNCHD
    raise ServiceError(f"services are written for Linux (systemd) and macOS (launchd), not {platform!r}")


@dataclass(frozen=True)
class Service:
    """One shim service as installed for ``account`` (whose home is ``home``).

    ``command`` is the argv the service runs (``/abs/dispatch-shim run …``);
    ``working_directory`` is set only when the shim runs from a clone
    (``python -m machines.shim`` needs the clone as its current directory).
    ``config_home`` is where a systemd user unit goes (``$XDG_CONFIG_HOME``, else
    ``home/.config``). ``description`` names the server, for ``systemctl status``.
    """

    name: str
    manager: Manager
    system: bool
    account: str
    uid: int
    home: Path
    command: tuple[str, ...] = ()
    working_directory: Path | None = None
    description: str = "Dispatch shim"
    config_home: Path | None = None
    environment: Mapping[str, str] = field(default_factory=lambda: {"PYTHONUNBUFFERED": "1"})

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise ServiceError(f"a service name is 1-64 letters, digits, '_', '.', '-': {self.name!r}")
        values = [*self.command, self.description, str(self.working_directory or ""), *self.environment.values()]
        for value in values:
            if CONTROL_CHARACTER.search(value):
                # A unit file ends a line at \n and \r, a plist cannot hold them: refuse rather
                # than write a unit whose paths or options differ from the ones given.
                raise ServiceError(f"a service cannot run with a control character in {value!r}")

    @property
    def unit_name(self) -> str:
        """``<name>.service`` (systemd)."""
        return f"{self.name}.service"

    @property
    def label(self) -> str:
        """The launchd label: ``dev.dispatch.shim`` for ``dispatch-shim``, else ``dev.dispatch.<name>``."""
        return "dev.dispatch." + self.name.removeprefix("dispatch-")

    @property
    def path(self) -> Path:
        """Where the unit file or plist is written."""
        if self.manager is Manager.SYSTEMD:
            if self.system:
                return Path("/etc/systemd/system") / self.unit_name
            return (self.config_home or self.home / ".config") / "systemd" / "user" / self.unit_name
        if self.system:
            return Path("/Library/LaunchDaemons") / f"{self.label}.plist"
        return self.home / "Library" / "LaunchAgents" / f"{self.label}.plist"

    @property
    def log_path(self) -> Path:
        """Where launchd sends the shim's output (systemd keeps it in the journal)."""
        if self.system:
            return Path("/Library/Logs") / f"{self.name}.log"
        return self.home / "Library" / "Logs" / f"{self.name}.log"

    def render(self) -> str:
        """The unit file (systemd) or the plist (launchd), as written."""
        if self.manager is Manager.SYSTEMD:
            return systemd_unit(self)
        return launchd_plist(self).decode()


def systemd_unit(service: Service) -> str:
    """The systemd unit running ``service.command`` (systemd.service(5), systemd.exec(5)).

    ``Restart=on-failure`` after 10 s, except after exit status 2 (bad options); a user
    unit is wanted by ``default.target``, a system unit by ``multi-user.target`` after the
    network is online, as ``User=account``.
    """
    lines = [
        "# Written by `dispatch-shim service install`; `dispatch-shim service uninstall` removes it.",
        "[Unit]",
        f"Description={_systemd_escape(service.description)}",
    ]
    if service.system:
        lines += ["Wants=network-online.target", "After=network-online.target"]
    lines += ["", "[Service]", "Type=simple"]
    if service.system:
        lines.append(f"User={service.account}")
    if service.working_directory is not None:
        lines.append(f"WorkingDirectory={_systemd_escape(str(service.working_directory))}")
    lines += [f"Environment={_systemd_quote(f'{key}={value}')}" for key, value in service.environment.items()]
    lines += [
        "ExecStart=" + " ".join(_systemd_quote(argument) for argument in service.command),
        "Restart=on-failure",
        f"RestartSec={RESTART_SECONDS}",
        f"RestartPreventExitStatus={USAGE_EXIT_STATUS}",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if service.system else 'default.target'}",
        "",
    ]
    return "\n".join(lines)


def launchd_plist(service: Service) -> bytes:
    """The launchd property list running ``service.command`` (launchd.plist(5)).

    ``RunAtLoad`` starts it at login (agent) or boot (daemon); ``KeepAlive`` with
    ``SuccessfulExit: false`` starts it again when it fails, at most every 10 s.
    """
    job: dict[str, object] = {
        "Label": service.label,
        "ProgramArguments": list(service.command),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_SECONDS,
        "ProcessType": "Background",
        "EnvironmentVariables": dict(service.environment),
        "StandardOutPath": str(service.log_path),
        "StandardErrorPath": str(service.log_path),
    }
    if service.working_directory is not None:
        job["WorkingDirectory"] = str(service.working_directory)
    if service.system:
        job["UserName"] = service.account
    return plistlib.dumps(job)


_SYSTEMD_SAFE = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def _systemd_escape(text: str) -> str:
    """``%`` specifiers and ``$`` variables taken literally in a unit setting."""
    return text.replace("%", "%%").replace("$", "$$")


def _systemd_quote(argument: str) -> str:
    """One ``ExecStart=`` word: as it is when plain, else double-quoted with C escapes."""
    escaped = _systemd_escape(argument)
    if _SYSTEMD_SAFE.fullmatch(argument):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_manager_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The default :data:`Runner`: run ``argv`` (60 s at most); a missing program is exit 127.

    ``systemctl --user`` finds the user's manager through ``$XDG_RUNTIME_DIR``; a shell
    without a login session (su, some ssh setups) lacks it, so ``/run/user/<uid>`` is
    passed when it exists.
    """
    environment = None
    runtime_directory = Path(f"/run/user/{os.getuid()}")
    if list(argv[:2]) == ["systemctl", "--user"] and "XDG_RUNTIME_DIR" not in os.environ and runtime_directory.is_dir():
        environment = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_directory)}
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=60, env=environment)
    except FileNotFoundError:
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(argv), 124, "", f"{' '.join(argv)}: no answer within 60 s")


def install(service: Service, *, runner: Runner | None = None, say: Say = print) -> int:
    """Write ``service``'s file (replacing an older one), then enable and (re)start it.

    Returns 0 when it is enabled and will start at boot; 1 when the file was written but
    the service manager refused a step (``say`` tells which, why, and the command to run).
    Raises ``ServiceError`` when the file cannot be written (e.g. ``--system`` without root).
    """
    runner = runner or run_manager_command
    _write(service.path, service.render().encode())
    say(f"Wrote {service.path}")
    if service.manager is Manager.LAUNCHD:
        return _launchd_install(service, runner, say)
    return _systemd_install(service, runner, say)


def uninstall(service: Service, *, runner: Runner | None = None, say: Say = print) -> int:
    """Stop and disable ``service`` and remove its file.

    Returns 0 (also when nothing was installed), 1 when the service manager refused to
    stop it (the file is removed all the same; ``say`` tells what is left to do).
    """
    runner = runner or run_manager_command
    if not service.path.exists():
        say(f"Nothing to uninstall: {service.path} does not exist.")
        return 0
    code = 0
    if service.manager is Manager.LAUNCHD:
        done = runner(["launchctl", "bootout", f"{_launchd_domain(service)}/{service.label}"])
        if done.returncode != 0 and not _launchd_not_loaded(done):
            say(f"launchctl bootout failed: {_reason(done)}")
            code = 1
    else:
        done = runner([*_systemctl(service), "disable", "--now", service.unit_name])
        if done.returncode != 0:
            say(f"systemctl disable --now {service.unit_name} failed: {_reason(done)}")
            code = 1
    try:
        service.path.unlink()
    except OSError as error:
        raise ServiceError(f"cannot remove {service.path}: {error.strerror}") from None
    say(f"Removed {service.path}")
    if service.manager is Manager.SYSTEMD:
        runner([*_systemctl(service), "daemon-reload"])
        if not service.system:
            say(f"Lingering is left as it is (`loginctl disable-linger {service.account}` turns it off).")
    return code


def status(service: Service, *, runner: Runner | None = None, say: Say = print) -> int:
    """Report ``service``: its file, the command it runs, and what the manager says.

    Returns 0 when the file is installed, 1 when it is not.
    """
    kind = {
        (Manager.SYSTEMD, False): "systemd user unit",
        (Manager.SYSTEMD, True): "systemd system unit",
        (Manager.LAUNCHD, False): "launchd agent",
        (Manager.LAUNCHD, True): "launchd daemon",
    }[(service.manager, service.system)]
    runner = runner or run_manager_command
    installed = service.path.exists()
    say(f"service:  {service.name} ({kind})")
    say(f"file:     {service.path}{'' if installed else ' (not installed)'}")
    if not installed:
        return 1
    say(f"runs:     {_installed_command(service)}")
    if service.manager is Manager.LAUNCHD:
        done = runner(["launchctl", "print", f"{_launchd_domain(service)}/{service.label}"])
        state = re.search(r"^\s*state = (.+)$", done.stdout, re.MULTILINE)
        loaded = "loaded" if done.returncode == 0 else "not loaded"
        say(f"launchd:  {loaded}{f', {state.group(1).strip()}' if state else ''}")
        say(f"log:      {service.log_path}")
        return 0
    enabled = runner([*_systemctl(service), "is-enabled", service.unit_name])
    active = runner([*_systemctl(service), "is-active", service.unit_name])
    say(f"enabled:  {enabled.stdout.strip() or _reason(enabled)}")
    say(f"active:   {active.stdout.strip() or _reason(active)}")
    if not service.system:
        say(f"linger:   {_linger(service, runner) or 'unknown'} (a user unit starts at boot only with lingering)")
    say(f"log:      journalctl {'' if service.system else '--user '}-u {service.unit_name}")
    return 0


def _systemd_install(service: Service, runner: Runner, say: Say) -> int:
    # Lingering first: it also starts the user's manager when no login session runs one
    # (an ssh or su shell), which the systemctl --user steps below need.
    boots = service.system or _enable_linger(service, runner, say)
    systemctl = _systemctl(service)
    for step in (["daemon-reload"], ["enable", service.unit_name], ["restart", service.unit_name]):
        done = runner([*systemctl, *step])
        if done.returncode != 0:
            say(
                f"`{' '.join([*systemctl, *step])}` failed: {_reason(done)}\n"
                f"The unit is written but not running. Once a systemd "
                f"{'' if service.system else 'user '}manager is reachable, run: "
                f"{' '.join(systemctl)} daemon-reload && {' '.join(systemctl)} enable --now {service.unit_name}"
            )
            return 1
    journal = f"journalctl {'' if service.system else '--user '}-u {service.unit_name}"
    say(f"Enabled and started {service.unit_name}; logs: {journal}")
    return 0 if boots else 1


def _enable_linger(service: Service, runner: Runner, say: Say) -> bool:
    """Make sure ``service.account`` lingers (its units start at boot); say what happened.

    Returns whether it lingers. Without lingering a user unit starts at the user's login
    and stops at their logout (logind.conf(5) ``KillUserProcesses``, loginctl(1)).
    """
    if _linger(service, runner) == "yes":
        say(f"Lingering is on for {service.account}: the shim starts at boot.")
        return True
    done = runner(["loginctl", "enable-linger", service.account])
    if done.returncode == 0 and _linger(service, runner) != "no":
        say(f"Enabled lingering for {service.account}: the shim starts at boot, without a login.")
        return True
    say(
        f"Could not enable lingering for {service.account} (`loginctl enable-linger {service.account}`: "
        f"{_reason(done)}).\nWithout it this user unit starts when {service.account} logs in, not at boot. "
        f"Ask an administrator to run: sudo loginctl enable-linger {service.account}\n"
        f"(or install a system unit: sudo dispatch-shim service install --system --run-as {service.account} …)"
    )
    return False


def _launchd_install(service: Service, runner: Runner, say: Say) -> int:
    domain = _launchd_domain(service)
    runner(["launchctl", "bootout", f"{domain}/{service.label}"])  # an older copy, if loaded
    runner(["launchctl", "enable", f"{domain}/{service.label}"])
    done = runner(["launchctl", "bootstrap", domain, str(service.path)])
    if done.returncode != 0:
        say(
            f"`launchctl bootstrap {domain} {service.path}` failed: {_reason(done)}\n"
            f"The plist is written and will be loaded at the next {'boot' if service.system else 'login'}."
        )
        return 1
    say(f"Loaded {service.label}; it starts at {'boot' if service.system else 'login'}. Log: {service.log_path}")
    return 0


def _systemctl(service: Service) -> list[str]:
    return ["systemctl"] if service.system else ["systemctl", "--user"]


def _linger(service: Service, runner: Runner) -> str | None:
    """``"yes"``/``"no"`` from ``loginctl show-user``, or ``None`` when logind cannot tell."""
    done = runner(["loginctl", "show-user", service.account, "--property=Linger", "--value"])
    value = done.stdout.strip()
    return value if done.returncode == 0 and value in ("yes", "no") else None


def _launchd_domain(service: Service) -> str:
    return "system" if service.system else f"gui/{service.uid}"


def _launchd_not_loaded(done: subprocess.CompletedProcess[str]) -> bool:
    text = f"{done.stdout} {done.stderr}".lower()
    return "no such process" in text or "could not find service" in text


def _installed_command(service: Service) -> str:
    """The command line of the installed file, as the manager will run it."""
    if service.manager is Manager.LAUNCHD:
        try:
            with service.path.open("rb") as file:
                arguments = plistlib.load(file).get("ProgramArguments", [])
        except (OSError, plistlib.InvalidFileException, ValueError) as error:
            return f"(unreadable: {error})"
        return " ".join(str(argument) for argument in arguments)
    try:
        text = service.path.read_text(encoding="utf-8")
    except OSError as error:
        return f"(unreadable: {error.strerror})"
    found = re.search(r"^ExecStart=(.*)$", text, re.MULTILINE)
    return found.group(1) if found else "(no ExecStart)"


def _reason(done: subprocess.CompletedProcess[str]) -> str:
    text = (done.stderr or done.stdout or "").strip()
    return text.splitlines()[-1] if text else f"exit status {done.returncode}"


def _write(path: Path, content: bytes) -> None:
    """Write ``content`` atomically (mode 0644); parent folders are created."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(content)
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
    except PermissionError:
        raise ServiceError(f"cannot write {path}: permission denied (a --system service needs root: sudo)") from None
    except OSError as error:
        raise ServiceError(f"cannot write {path}: {error.strerror}") from None
