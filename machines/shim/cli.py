"""Command line of the shim (docs/shim-protocol.md#the-shim-program): ``dispatch-shim``, or ``python -m
machines.shim`` in a clone of the server. Its help (:data:`DESCRIPTION`) says how it is
used; ``service`` is :mod:`.service`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pwd
import re
import shlex
import signal
import stat
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .audit import AuditLog
from .connection import Shim, ShimRefused, websocket_url
from .jail import PathJail
from .login import LoginError, device_login
from .operations import MachineIdentity
from .protocol import PROTOCOL_VERSION, SESSION_ID_PATTERN, SHIM_VERSION, Capability
from .service import (
    DEFAULT_NAME,
    Manager,
    Service,
    ServiceError,
    detect_manager,
    install,
    status,
    uninstall,
)
from .state import STATE_DIR_ENV, ConfigError, ShimConfig, StateError, StateStore, load_config

DESCRIPTION = f"""\
Connect this computer to a Dispatch instance and serve its operations.

  dispatch-shim login --server URL [--state-dir DIR]
  dispatch-shim run [--server URL] [--token T] [--state-dir DIR] [--config FILE]
                    [--root DIR]... [--session ID]... | [--all-sessions]
                    [--name DISPLAY_NAME] [--no-shell] [--no-files]
  dispatch-shim status [--state-dir DIR]
  dispatch-shim logout [--state-dir DIR]
  dispatch-shim service install [run options] [--system [--run-as USER]] [--dry-run]
  dispatch-shim service uninstall|status [--system] [--service-name NAME]
  dispatch-shim --version

The state directory is --state-dir, else ${STATE_DIR_ENV}, else
~/.config/dispatch-shim; it holds state.json (machine_id, server, token; mode 0600),
config.toml (allowed_roots, capabilities, [limits]) and audit.jsonl. run takes its
token from --token, else $DISPATCH_SHIM_TOKEN, else the stored login. File operations
are allowed only under its roots: --root, else allowed_roots in config.toml, else your
whole home directory.

service install makes run (with the options given) a systemd unit or a launchd agent
that starts at boot and restarts on failure; it uses the stored login (--token is
stored in the state file, never in the unit).

Exit codes: 0 success (run: stopped by SIGINT/SIGTERM), 1 refused or failed (service
status: not installed), 2 bad usage or configuration, 130 interrupted login.
The protocol: docs/shim-protocol.md in the Dispatch repository.
"""

TOKEN_ENV = "DISPATCH_SHIM_TOKEN"
"""Environment variable holding a token for headless ``run``."""

SESSION_ID = re.compile(SESSION_ID_PATTERN)
"""A machine session id (docs/shim-protocol.md#machine-sessions)."""


class _UsageError(Exception):
    """Bad command-line input or configuration; reported with exit code 2."""


def main(argv: Sequence[str] | None = None, prog: str = "dispatch-shim") -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit code.

    ``prog`` is how the user started it, for help and messages (``python -m machines.shim``
    in a clone).
    """
    args = _parser(prog).parse_args(argv)
    try:
        if args.command == "service":
            return _service(args, prog)
        store = StateStore(args.state_dir)
        if args.command == "login":
            return _login(args, store, prog)
        if args.command == "run":
            return _run(args, store, prog)
        if args.command == "status":
            return _status(store)
        return _logout(store)
    except (_UsageError, ConfigError, StateError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ServiceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser(prog: str = "dispatch-shim") -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir",
        metavar="DIR",
        help=f"state directory (default: ${STATE_DIR_ENV}, else ~/.config/dispatch-shim)",
    )
    run_options = argparse.ArgumentParser(add_help=False)
    run_options.add_argument("--server", help="base URL, http(s)://host:port (default: the one logged in to)")
    run_options.add_argument("--config", metavar="FILE", help="configuration file (default: <state-dir>/config.toml)")
    run_options.add_argument(
        "--root",
        action="append",
        default=[],
        metavar="DIR",
        help="an allowed root (repeatable; default: allowed_roots in config.toml, else your whole home directory)",
    )
    sessions = run_options.add_mutually_exclusive_group()
    sessions.add_argument(
        "--session", action="append", default=[], metavar="ID", help="attach to this session only (repeatable)"
    )
    sessions.add_argument("--all-sessions", action="store_true", help="attach to every session (the default)")
    run_options.add_argument("--name", metavar="DISPLAY_NAME", help="display name shown to users and agents")
    run_options.add_argument("--no-shell", action="store_true", help="do not offer the shell capability")
    run_options.add_argument("--no-files", action="store_true", help="do not offer the files capability")
    run_options.add_argument("-v", "--verbose", action="store_true", help="log every frame's handling")

    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--version", action="version", version=f"dispatch-shim {SHIM_VERSION} (shim protocol {PROTOCOL_VERSION})"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    login = commands.add_parser("login", parents=[common], help="log in with the device flow")
    login.add_argument("--server", required=True, help="the instance's base URL, http(s)://host:port")

    run = commands.add_parser("run", parents=[common, run_options], help="connect and serve operations")
    run.add_argument("--token", help=f"machine or API token (default: ${TOKEN_ENV}, else the stored login)")

    commands.add_parser("status", parents=[common], help="show the stored login (never the token)")
    commands.add_parser("logout", parents=[common], help="forget the stored token")

    service_options = argparse.ArgumentParser(add_help=False)
    service_options.add_argument(
        "--system",
        action="store_true",
        help="a system service (as root: /etc/systemd/system, /Library/LaunchDaemons) instead of the user's own",
    )
    service_options.add_argument(
        "--service-name", default=DEFAULT_NAME, metavar="NAME", help=f"unit name (default: {DEFAULT_NAME})"
    )
    service_options.add_argument(
        "--manager",
        choices=[str(manager) for manager in Manager],
        help="the service manager to write for (default: systemd on Linux, launchd on macOS)",
    )
    service = commands.add_parser("service", help="run the shim at boot as a systemd unit or launchd agent")
    actions = service.add_subparsers(dest="action", required=True)
    install_command = actions.add_parser(
        "install",
        parents=[common, run_options, service_options],
        help="write, enable and start the service running 'run' with these options",
    )
    install_command.add_argument(
        "--token", help="store this token in the state file first (never in the unit; default: the stored login)"
    )
    install_command.add_argument(
        "--run-as", metavar="USER", help="with --system: the account the shim runs as (default: $SUDO_USER)"
    )
    install_command.add_argument("--dry-run", action="store_true", help="print the unit or plist and change nothing")
    # --state-dir is accepted as install takes it, and not needed: the service is found by
    # its --service-name (its unit names its state directory).
    located = argparse.ArgumentParser(add_help=False)
    located.add_argument(
        "--state-dir", metavar="DIR", help="accepted as for install; not needed (the service is found by its name)"
    )
    actions.add_parser("uninstall", parents=[located, service_options], help="stop, disable and remove the service")
    actions.add_parser("status", parents=[located, service_options], help="show the service's file and state")
    return parser


def _login(args: argparse.Namespace, store: StateStore, prog: str) -> int:
    try:
        state = device_login(args.server, store)
    except LoginError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Logged in to {state.server} as machine {state.machine_id}; token stored in {store.path}")
    print(f"Next: {_next_run_command(args, prog)}")
    print("  (file operations are allowed only under the --root directories; without --root, your whole home)")
    return 0


def _next_run_command(args: argparse.Namespace, prog: str) -> str:
    """``dispatch-shim run --root <dir>``, with ``--state-dir``/``--server`` as ``login`` got them."""
    words = [prog, "run", "--root", "<dir>"]
    if args.state_dir:
        words += ["--state-dir", shlex.quote(args.state_dir)]
    if args.server:
        words += ["--server", shlex.quote(args.server.strip())]
    return " ".join(words)


def _login_hint(prog: str, state_dir: str | None) -> str:
    """How to log in, naming ``--state-dir`` (given, or possibly meant)."""
    if state_dir:
        return f"{prog} login --server URL --state-dir {shlex.quote(state_dir)}"
    return f"{prog} login --server URL; if you logged in with --state-dir DIR, pass the same --state-dir here"


def _run(args: argparse.Namespace, store: StateStore, prog: str) -> int:
    config = load_config(args.config or store.config_path)
    state = store.ensure_machine_id()
    assert state.machine_id is not None
    token = args.token or os.environ.get(TOKEN_ENV) or state.token
    if not token:
        raise _UsageError(
            f"no token in {store.path}: pass --token, set {TOKEN_ENV}, or log in first "
            f"({_login_hint(prog, args.state_dir)})"
        )
    server = args.server or state.server
    if not server:
        raise _UsageError(
            f"no server: pass --server http(s)://host:port, or log in first ({_login_hint(prog, args.state_dir)})"
        )
    jail = _checked_run_options(args, server, config, Path.home())
    capabilities = set(config.capabilities or [str(c) for c in Capability])
    if args.no_shell:
        capabilities.discard(Capability.SHELL)
    if args.no_files:
        capabilities.discard(Capability.FILES)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    shim = Shim(
        server=server,
        token=token,
        identity=MachineIdentity.detect(state.machine_id, args.name.strip() if args.name else None),
        jail=jail,
        capabilities=capabilities,
        sessions=args.session or ["*"],
        limits=config.limits,
        audit=AuditLog(store.audit_path),
    )
    print(f"serving roots: {', '.join(jail.roots)}{_roots_origin(args, config, store)}", file=sys.stderr)
    print(
        f"shim {state.machine_id} serving {', '.join(jail.roots)} "
        f"({', '.join(shim.capabilities) or 'no capabilities'}) on {shim.url}",
        file=sys.stderr,
    )
    try:
        asyncio.run(_serve(shim))
    except ShimRefused as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


async def _serve(shim: Shim) -> None:
    """Run ``shim`` until it is refused or SIGINT/SIGTERM stops it cleanly."""
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, shim.stop)
    await shim.run()


def _status(store: StateStore) -> int:
    state = store.load()
    config_note = "" if store.config_path.exists() else " (not present)"
    print(f"state file: {store.path}")
    print(f"server:     {state.server or '(not logged in)'}")
    print(f"machine_id: {state.machine_id or '(not created yet)'}")
    print(f"token:      {'stored' if state.token else 'not stored'}")
    print(f"config:     {store.config_path}{config_note}")
    print(f"audit log:  {store.audit_path}")
    return 0


def _logout(store: StateStore) -> int:
    state = store.load()
    if not state.token:
        print("No token was stored.")
        return 0
    state.token = None
    store.save(state)
    print(f"Token removed from {store.path} (the machine_id is kept).")
    return 0


def _roots_origin(args: argparse.Namespace, config: ShimConfig, store: StateStore) -> str:
    """Where ``run``'s roots come from, unless from ``--root``: `` (default: no --root given)``."""
    if args.root:
        return ""
    if config.allowed_roots:
        return f" (allowed_roots of {args.config or store.config_path}; no --root given)"
    return " (default: no --root given)"


def _checked_run_options(args: argparse.Namespace, server: str, config: ShimConfig, home: Path) -> PathJail:
    """Check ``run``'s options as ``run`` will use them; return the path jail of its roots.

    The roots are ``--root``, else the configured ones, else ``home``. Raises
    ``_UsageError`` for a malformed server URL, a root that is not a directory, a
    display name out of 1–255 characters or a malformed session id.
    """
    try:
        websocket_url(server)
        jail = PathJail(args.root or config.allowed_roots or [str(home)])
    except ValueError as error:
        raise _UsageError(str(error)) from None
    if args.name is not None and not 0 < len(args.name.strip()) <= 255:
        raise _UsageError("--name must be 1 to 255 characters")
    for session_id in args.session:
        if not SESSION_ID.match(session_id):
            raise _UsageError(f"not a session id: {session_id!r}")
    return jail


def _service(args: argparse.Namespace, prog: str) -> int:
    """``service install|uninstall|status`` (:mod:`.service`)."""
    try:
        manager = Manager(args.manager) if args.manager else detect_manager()
    except ServiceError as error:
        raise _UsageError(f"{error}; --manager systemd|launchd writes one anyway") from None
    account, uid, home = _service_account(args)
    xdg_config = os.environ.get("XDG_CONFIG_HOME", "")
    try:
        service = Service(
            name=args.service_name,
            manager=manager,
            system=args.system,
            account=account,
            uid=uid,
            home=home,
            config_home=Path(xdg_config) if os.path.isabs(xdg_config) and not args.system else None,
        )
    except ServiceError as error:
        raise _UsageError(str(error)) from None
    if args.action == "install":
        return _service_install(args, service, prog)
    if args.action == "uninstall":
        return uninstall(service)
    return status(service)


def _service_account(args: argparse.Namespace) -> tuple[str, int, Path]:
    """The account a service runs as: (name, uid, home).

    The current user for a user service; for ``--system``, ``--run-as`` else
    ``$SUDO_USER`` (the user who ran ``sudo``). Raises ``_UsageError`` when there is none
    or it does not exist.
    """
    run_as = getattr(args, "run_as", None)
    if not args.system:
        if run_as:
            raise _UsageError("--run-as is for --system services; a user service runs as you")
        return pwd.getpwuid(os.geteuid()).pw_name, os.geteuid(), Path.home()
    account = run_as or os.environ.get("SUDO_USER")
    if not account:
        raise _UsageError("--system needs --run-as USER: the account the shim runs as (better not root)")
    try:
        entry = pwd.getpwnam(account)
    except KeyError:
        raise _UsageError(f"no such user: {account!r}") from None
    return entry.pw_name, entry.pw_uid, Path(entry.pw_dir)


def _service_install(args: argparse.Namespace, service: Service, prog: str) -> int:
    """Check the options as ``run`` would, then print (``--dry-run``) or install the unit.

    The unit runs ``run`` with an absolute ``--state-dir`` and absolute paths, and uses
    the state directory's stored login: without one (and without ``--token``) it is
    refused, since the service could only fail.
    """
    if args.state_dir:
        state_dir = Path(os.path.abspath(os.path.expanduser(args.state_dir)))
    elif args.system:
        state_dir = service.home / ".config" / "dispatch-shim"
    else:
        state_dir = Path(os.path.abspath(StateStore().state_dir))
    store = StateStore(state_dir)
    state = store.load()
    if args.token and args.system:
        raise _UsageError(
            f"a --system service uses {service.account}'s stored login: log in as that user "
            f"(sudo -u {service.account} {prog} login --server URL) instead of passing --token"
        )
    server = args.server or state.server
    if not server:
        raise _UsageError(
            f"no server in {store.path}: pass --server http(s)://host:port, or log in first "
            f"({_login_hint(prog, args.state_dir)})"
        )
    if not (args.token or state.token):
        raise _UsageError(
            f"no stored login in {store.path}: log in first ({_login_hint(prog, args.state_dir)}), or pass --token "
            "(stored in the state file, mode 0600, never in the unit)"
        )
    config_path = Path(os.path.abspath(os.path.expanduser(args.config))) if args.config else None
    config = load_config(config_path or store.config_path)
    _checked_run_options(args, server, config, service.home)
    for warning in _service_warnings(args, service, state_dir, config, prog):
        print(f"warning: {warning}", file=sys.stderr)

    run_arguments = ["run", "--state-dir", str(state_dir)]
    if args.server:
        run_arguments += ["--server", args.server.strip()]
    if config_path is not None:
        run_arguments += ["--config", str(config_path)]
    for root in args.root:
        run_arguments += ["--root", os.path.abspath(os.path.expanduser(root))]
    for session_id in args.session:
        run_arguments += ["--session", session_id]
    if args.name:
        run_arguments += ["--name", args.name.strip()]
    run_arguments += [flag for flag, given in (("--no-shell", args.no_shell), ("--no-files", args.no_files)) if given]
    if args.verbose:
        run_arguments.append("--verbose")
    command, working_directory = _shim_command()
    service = replace(
        service,
        command=(*command, *run_arguments),
        working_directory=working_directory,
        description=f"Dispatch shim for {server.strip()}",
    )
    if args.dry_run:
        print(service.render(), end="")
        print(f"(dry run: nothing written; without --dry-run this goes to {service.path})", file=sys.stderr)
        return 0
    if args.token:
        state = store.ensure_machine_id()
        state.server, state.token = server.strip().rstrip("/"), args.token
        store.save(state)
        print(f"Token stored in {store.path} (mode 0600).")
    return install(service)


def _service_warnings(
    args: argparse.Namespace, service: Service, state_dir: Path, config: ShimConfig, prog: str
) -> list[str]:
    """What ``service install`` (and its dry run) should tell before it goes on: roots that
    default to the whole home, a state directory the service's account cannot read, and
    a user unit installed for root."""
    warnings = []
    if not args.root and not config.allowed_roots:
        warnings.append(
            f"no --root given: the service will allow file operations anywhere under {service.home} "
            "(the whole home directory); pass --root DIR to limit it"
        )
    if service.system and not _account_can_read(state_dir / "state.json", service.uid):
        warnings.append(
            f"{service.account} cannot read {state_dir / 'state.json'}: the service (running as {service.account}) "
            f"would fail to start; log in as that user (sudo -u {service.account} {prog} login --server URL) "
            f"or pass a --state-dir {service.account} owns"
        )
    if not service.system and service.uid == 0:
        warnings.append(
            f"running as root without --system: this installs a user unit for root ({service.path}), "
            f"which runs only in root's user manager; for a machine-wide service run as an account, "
            f"use --system --run-as USER"
        )
    return warnings


def _account_can_read(path: Path, uid: int) -> bool:
    """Whether the account ``uid`` can reach and read ``path`` by its permission bits
    (owner, group, other; every folder above it searchable). Root can; a path that does
    not exist yet (no login stored) is judged by its nearest existing folder."""
    if uid == 0:
        return True
    try:
        entry = pwd.getpwuid(uid)
        groups = set(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except KeyError:
        groups = set()
    target = path if path.exists() else next((p for p in path.parents if p.exists()), Path("/"))
    checks = [(folder, stat.S_IXUSR) for folder in reversed(target.parents)]
    checks.append((target, stat.S_IRUSR | (stat.S_IXUSR if target.is_dir() else 0)))
    for checked, owner_bits in checks:
        mode = checked.stat()
        if mode.st_uid == uid:
            granted = mode.st_mode & owner_bits == owner_bits
        elif mode.st_gid in groups:
            granted = mode.st_mode & (owner_bits >> 3) == owner_bits >> 3
        else:
            granted = mode.st_mode & (owner_bits >> 6) == owner_bits >> 6
        if not granted:
            return False
    return True


def _shim_command() -> tuple[list[str], Path | None]:
    """The command a service starts this shim with, and the folder to start it in.

    The ``dispatch-shim`` script this process runs as (its absolute path, symlinks kept:
    pipx's ``~/.local/bin`` link outlives upgrades of the venv behind it), else the one
    beside this Python; else ``python -m <this package>`` started in the folder that holds
    the package (a clone of the server: ``python -m machines.shim`` from the clone).
    """
    if Path(sys.argv[0]).name == "dispatch-shim":
        return [os.path.abspath(sys.argv[0])], None
    beside = Path(os.path.abspath(sys.executable)).parent / "dispatch-shim"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)], None
    package = __package__ or "machines.shim"
    holder = Path(__file__).resolve().parents[package.count(".") + 1]
    return [os.path.abspath(sys.executable), "-m", package], holder
