"""The tmux layer for CLI agents (docs/agents.md#the-private-tmux-server), built on ``libtmux``.

``TmuxRunner`` starts, inspects, feeds and stops the tmux sessions that hold CLI agents.
It knows nothing of agents or the database: the agent services call it (from a thread,
never on the event loop — every method blocks on a ``tmux`` subprocess) and translate
``TmuxError`` into their own vocabulary.

Rules kept here (docs/agents.md#agent-types):

- argv elements reach tmux as separate arguments, so tmux ``execvp``s the program
  directly; no user text is ever interpreted by a shell;
- secrets travel only in the environment (``respawn-pane -e``), never in argv, and are
  not stored in the session environment;
- every session carries the user option ``@dispatch_instance=<instance_id>``; an
  instance only lists (and so only touches) sessions tagged with its own id;
- ``remain-on-exit on`` keeps a dead pane, its exit status and its last output until the
  session is killed;
- messages are pasted through a named tmux buffer loaded from stdin, with bracketed
  paste (``paste-buffer -p``), so multi-line text arrives as one input at any length;
- nothing is ever written into a dead pane: ``paste-buffer`` into a dead
  ``remain-on-exit`` pane crashes tmux 3.3a, and with it every session on that server.
  Every write (paste, Enter, a stop's keys) runs inside one ``if-shell -F`` that the tmux
  server evaluates right before the write, in the same command queue
  (``_write_if_alive``; docs/agents.md#how-a-message-reaches-the-pane);
- Dispatch's tmux server is its own (``tmux -L dispatch`` unless another socket name is
  given), never the user's default server (docs/agents.md#the-private-tmux-server).

Two tmux parsing rules that user text must be protected from (tmux 3.3, verified):

- an argument that *ends* in ``;`` is taken as a command separator, even after ``--``
  and inside a command's argv (``printf a;`` runs ``printf a`` then a next command);
  ``\\;`` at the end stands for a literal ``;`` (``_literal``);
- ``-c start-directory`` is format-expanded, so ``#(cmd)`` in a path would run ``cmd``
  through a shell; ``##`` stands for a literal ``#`` (``_literal_format``).

Targets are always written ``=NAME`` (session) or ``=NAME:`` (its current pane): without
``=`` tmux falls back to prefix and pattern matching and could act on another session.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import libtmux
from libtmux import exc as libtmux_exc
from libtmux.common import tmux_cmd

from agents.agent_exec import agent_environment

# Session names and instance ids are identifiers Dispatch mints (``dispatch_agt_<12 hex>``,
# the instance id); anything else is refused so no tmux target or option rule applies.
_IDENTIFIER = re.compile(r"[A-Za-z0-9_-]{1,100}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

INSTANCE_OPTION = "@dispatch_instance"
# The socket name (``tmux -L``) of Dispatch's own tmux server when none is configured
# (docs/agents.md#the-private-tmux-server): one fixed name a person can type to attach;
# instances sharing it stay apart by ``INSTANCE_OPTION``.
DEFAULT_SOCKET = "dispatch"
# A tmux key name a stop sequence may send (``C-c``, ``Enter``, ``Escape``, ``F1``): no
# quoting, separator or format character can appear in one.
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,15}")
# What the ``if-shell`` of ``_write_if_alive`` prints when it wrote.
_WROTE = "dispatch:written"
# The pane's first process: reads the agent's environment file and execs its program.
AGENT_EXEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_exec.py")
# C0 controls and DEL except tab and newline (carriage returns become newlines first).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def pasteable(text: str) -> str:
    """``text`` fit to paste: CRLF and CR become LF; every other control character but tab
    and newline is removed — ESC above all, since ``ESC [201~`` inside a bracketed paste
    would end it and make the rest keystrokes (Enter, Ctrl-U, a permission answer)."""
    return _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def _write_env_file(env: dict[str, str]) -> str:
    """Write ``env`` as JSON to a new mode-0600 file; its path."""
    descriptor, path = tempfile.mkstemp(prefix="dispatch-agent-env-", suffix=".json")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(env, handle)
    except BaseException:
        _remove_quietly(path)
        raise
    return path


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# Size of a detached session's window, in character cells (tmux's default is 80x24,
# narrow for the full-screen CLIs agents run).
PANE_WIDTH = 200
PANE_HEIGHT = 50
# The first process of a new session only holds the pane while ``remain-on-exit`` and the
# instance tag are set; ``respawn-pane -k`` replaces it with the real command. Setting the
# option after ``new-session <argv>`` instead is a race: a command that exits at once
# takes its session with it before the option lands (observed with tmux 3.3a).
_PLACEHOLDER_ARGV = ("sleep", "2147483647")
# Seconds ``pane_state`` waits for tmux to reap a pane's process it already shows dead.
_STATUS_WAIT = 1.0
# Seconds a ``load-buffer`` may take to read a message from stdin.
_LOAD_BUFFER_TIMEOUT = 30.0


class TmuxError(Exception):
    """A tmux operation failed; ``str(error)`` says which and why (tmux's own message)."""


class TmuxSessionNotFound(TmuxError):
    """The named session does not exist (never started, killed, or the server is down)."""


class TmuxPaneDead(TmuxError):
    """The session's pane is dead (its program exited; ``remain-on-exit`` keeps it): nothing
    was written to it."""


@dataclass(frozen=True)
class PaneState:
    """The state of a session's pane (tmux formats ``#{pane_dead}``, ``#{pane_dead_status}``).

    ``dead``: the process has exited (the pane remains, ``remain-on-exit``).
    ``exit_status``: its exit code once dead; ``None`` while alive or if a signal killed it.
    ``pid``: the running process's pid; ``None`` once dead.
    ``signal``: the number of the signal that killed it (``#{pane_dead_signal}``, tmux
    >= 3.3), else ``None``.
    """

    dead: bool
    exit_status: int | None
    pid: int | None
    signal: int | None = None


def _literal(arg: str) -> str:
    """Return ``arg`` such that tmux's argument parser hands it back unchanged.

    tmux treats an argument ending in ``;`` as a command separator; ``\\;`` at the end
    becomes ``;`` (and ``X\\\\;`` becomes ``X\\;``), so a trailing ``;`` is escaped.
    """
    return arg[:-1] + "\\;" if arg.endswith(";") else arg


def _literal_format(arg: str) -> str:
    """Return ``arg`` for a format-expanded tmux argument (``-c``): ``#`` doubled, then ``_literal``."""
    return _literal(arg.replace("#", "##"))


def server_environment() -> dict[str, str]:
    """This process's environment without Dispatch's own configuration (``DATABASE_URL``,
    ``REDIS_URL``, ``SECRET_KEY_FILE``, ``DISPATCH_*``, …; ``agent_exec.agent_environment``):
    the environment a tmux server started by Dispatch gets as its global environment, which
    every window on it inherits, so Dispatch's own settings never reach an agent."""
    return agent_environment(dict(os.environ), {})


def _check_identifier(kind: str, value: str) -> None:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise TmuxError(f"Invalid {kind} {value!r}: use 1-100 characters among A-Z a-z 0-9 _ -.")


def _is_server_down(stderr: str) -> bool:
    """True for the messages tmux gives when no server listens on the socket, or when the
    server exited while the command connected (its last session just closed)."""
    return (
        "no server running" in stderr
        or ("error connecting to" in stderr and "No such file" in stderr)
        or "server exited unexpectedly" in stderr
    )


class TmuxRunner:
    """Runs CLI agents in tmux sessions on one tmux server (docs/agents.md#the-private-tmux-server).

    ``socket_name``: the ``tmux -L`` socket name of the server; ``None`` or ``""`` for
    Dispatch's own, ``DEFAULT_SOCKET`` — never the user's default tmux server
    (docs/agents.md#the-private-tmux-server). Every method is synchronous
    (it runs ``tmux`` subprocesses) and raises ``TmuxError`` — ``TmuxSessionNotFound``
    when the session is missing — with tmux's message.
    """

    def __init__(self, socket_name: str | None = None) -> None:
        self.socket_name: str = socket_name or DEFAULT_SOCKET
        self._server = libtmux.Server(socket_name=self.socket_name)

    # --- lifecycle -------------------------------------------------------------------

    def start(self, *, session_name: str, instance_id: str, argv: list[str], cwd: str, env: dict[str, str]) -> None:
        """Start ``argv`` in a new detached session ``session_name`` in directory ``cwd``.

        ``argv``: the program and its arguments, each passed to tmux as its own argument
        (never joined into a shell string). ``env``: extra environment variables for the
        process (secrets go here, never in ``argv``), over this process's own environment
        (``server_environment``), which wins over the tmux server's. They travel in a mode-0600 file that
        ``agents/agent_exec.py`` (the pane's first process) reads, deletes and then
        ``exec``s ``argv`` with — so no command line, not even tmux's, ever holds them —
        and the program's environment loses Dispatch's own configuration (``SECRET_KEY``,
        ``DATABASE_URL``, ``DISPATCH_*``, …) that a tmux server started by Dispatch would
        otherwise pass on. The session is tagged
        ``@dispatch_instance=<instance_id>`` before the program starts, and keeps its pane
        after the program exits (``remain-on-exit on``).

        Raises ``TmuxError`` for an invalid name, id, argv, environment name or ``cwd``
        (must be an existing directory), for a session of that name that already exists,
        and when tmux fails (the half-made session is then killed).
        """
        _check_identifier("session name", session_name)
        _check_identifier("instance id", instance_id)
        if not argv or not argv[0]:
            raise TmuxError("argv must name a program.")
        if not os.path.isdir(cwd):
            raise TmuxError(f"The working directory {cwd!r} is not an existing directory.")
        for name in env:
            if not _ENV_NAME.fullmatch(name):
                raise TmuxError(f"Invalid environment variable name {name!r}.")
        if self.exists(session_name):
            raise TmuxError(f"A tmux session named {session_name!r} already exists.")

        # This process's environment (Dispatch's configuration left out), not only the tmux
        # server's: a server started by an earlier process keeps the environment of then, so
        # a key exported before this `serve` would miss the agent, and its HOME could differ
        # from the one the CLI's config was written in (agents.cli_prepare.agent_environment).
        env_file = _write_env_file({**server_environment(), **env})
        # Four or more arguments: tmux ``execvp``s them directly (no shell); the wrapper
        # then ``exec``s the program, which stays the pane's process (pid, exit status).
        command = [_literal(arg) for arg in (sys.executable, "-I", AGENT_EXEC, env_file, "--", *argv)]
        directory = _literal_format(cwd)
        pane = f"={session_name}:"

        # ``new-session`` starts the tmux server when none runs: with a clean environment,
        # so Dispatch's settings never become the server's global environment.
        self._check_clean(
            "new-session",
            "-d",
            "-s",
            session_name,
            "-x",
            PANE_WIDTH,
            "-y",
            PANE_HEIGHT,
            "-c",
            directory,
            "--",
            *_PLACEHOLDER_ARGV,
            session_name=None,
        )
        try:
            self._check("set-option", "-t", pane, INSTANCE_OPTION, instance_id, session_name=session_name)
            self._check("set-option", "-w", "-t", pane, "remain-on-exit", "on", session_name=session_name)
            # tmux >= 3.3 writes "Pane is dead (status N, <time>)" on the pane's bottom row,
            # which would end every capture of a short-lived program (and push its real
            # last lines out of ``capture``); the status is read from ``pane_state``
            # instead. tmux < 3.3 lacks the option: its failure is ignored.
            self._cmd("set-option", "-w", "-t", pane, "remain-on-exit-format", "")
            self._check("respawn-pane", "-k", "-t", pane, "-c", directory, "--", *command, session_name=session_name)
        except TmuxError:
            self._server.cmd("kill-session", "-t", f"={session_name}")
            _remove_quietly(env_file)
            raise

    def kill(self, session_name: str) -> None:
        """Kill the session and its process (SIGHUP). Raises ``TmuxSessionNotFound`` if it is gone."""
        _check_identifier("session name", session_name)
        self._check("kill-session", "-t", f"={session_name}", session_name=session_name)

    def interrupt(self, session_name: str) -> None:
        """Send C-c to the session's pane (``send_keys``). Raises ``TmuxSessionNotFound`` if
        it is gone, ``TmuxPaneDead`` if its program has exited."""
        self.send_keys(session_name, ["C-c"])

    # --- inspection ------------------------------------------------------------------

    def exists(self, session_name: str) -> bool:
        """True if a session of exactly this name exists (False if the server is down)."""
        _check_identifier("session name", session_name)
        try:
            return self._server.has_session(session_name, exact=True)
        except libtmux_exc.TmuxCommandNotFound:
            raise TmuxError("tmux is not installed (not found on PATH).")

    def owned_sessions(self, instance_id: str) -> list[str]:
        """Names of the sessions tagged ``@dispatch_instance=<instance_id>``, sorted.

        Sessions of other instances, and untagged ones, are never listed. ``[]`` when
        the tmux server is not running.
        """
        _check_identifier("instance id", instance_id)
        proc = self._cmd("list-sessions", "-F", f"#{{session_name}}\t#{{{INSTANCE_OPTION}}}")
        if proc.returncode != 0:
            stderr = "\n".join(proc.stderr)
            if _is_server_down(stderr):
                return []
            raise TmuxError(f"tmux list-sessions failed: {stderr}")
        owned = []
        for line in proc.stdout:
            name, _, tag = line.rpartition("\t")
            if name and tag == instance_id:
                owned.append(name)
        return sorted(owned)

    def pane_state(self, session_name: str) -> PaneState:
        """The pane's ``PaneState``. Raises ``TmuxSessionNotFound`` if the session is gone.

        A dead pane always comes with its exit status or signal when tmux can tell it
        within ``_STATUS_WAIT`` seconds (else both are ``None``): tmux marks a pane dead
        when its terminal closes, a moment before it reaps the process; and tmux 3.3a
        now and then misses the SIGCHLD altogether, leaving the process a zombie and the
        status unknown for good (seen in about 1 run in 20 of a short-lived program).
        Sending the server a SIGCHLD makes it reap the process and record the status.
        """
        _check_identifier("session name", session_name)
        deadline = time.monotonic() + _STATUS_WAIT
        while True:
            state, server_pid = self._read_pane_state(session_name)
            if not state.dead or state.exit_status is not None or state.signal is not None:
                return state
            if time.monotonic() >= deadline:
                return state
            try:
                os.kill(server_pid, signal.SIGCHLD)
            except OSError:
                pass  # the server is gone or not ours: the next read says so
            time.sleep(0.01)

    def _read_pane_state(self, session_name: str) -> tuple[PaneState, int]:
        """The active pane's ``PaneState`` and the tmux server's pid."""
        # ``list-panes`` and not ``display-message``: the latter falls back to another
        # session when the target is missing instead of failing.
        proc = self._check(
            "list-panes",
            "-t",
            f"={session_name}:",
            "-F",
            "#{pane_active}\t#{pane_dead}\t#{pane_dead_status}\t#{pane_dead_signal}\t#{pane_pid}\t#{pid}",
            session_name=session_name,
        )
        for line in proc.stdout:
            active, dead, status, dead_signal, pid, server_pid = line.split("\t")
            if active == "1":
                is_dead = dead == "1"
                state = PaneState(
                    dead=is_dead,
                    exit_status=int(status) if is_dead and status else None,
                    pid=int(pid) if not is_dead and pid else None,
                    signal=int(dead_signal) if is_dead and dead_signal else None,
                )
                return state, int(server_pid)
        raise TmuxError(f"tmux listed no active pane for session {session_name!r}.")

    def capture(self, session_name: str, lines: int = 100) -> str:
        """The last ``lines`` lines of text in the pane (history included), ``\\n``-joined.

        Trailing blank lines (the unused rows of the screen) are dropped, so the result
        ends with the last line written. Plain text, no escape sequences. Raises
        ``TmuxSessionNotFound`` if the session is gone, ``TmuxError`` if ``lines < 1``.
        """
        _check_identifier("session name", session_name)
        if lines < 1:
            raise TmuxError("lines must be at least 1.")
        proc = self._check(
            "capture-pane", "-p", "-t", f"={session_name}:", "-S", f"-{lines}", session_name=session_name
        )
        captured = [line.rstrip() for line in proc.stdout]
        while captured and not captured[-1]:
            captured.pop()
        return "\n".join(captured[-lines:])

    # --- input -----------------------------------------------------------------------

    def paste(self, session_name: str, text: str, *, enter: bool = True, bracketed: bool = True) -> None:
        """Paste ``text`` into the pane as one input, then press Enter if ``enter``.

        The text goes through a buffer of its own (loaded from stdin, deleted after),
        pasted with bracketed paste (``bracketed``; ``paste-buffer -p``) so a program that
        asks for it (readline, the agent CLIs) receives multi-line text whole. Any length;
        the text never passes through a shell or tmux's parser. Control characters are
        removed first (``pasteable``): an ESC could end the bracketed paste early and turn
        the rest into keystrokes. The paste and the Enter happen only if the pane is alive
        at that instant (``_write_if_alive``). ``bracketed=False`` types the text as plain
        keystrokes (a stop sequence's ``/exit``).

        Raises ``TmuxSessionNotFound`` if the session is gone, ``TmuxPaneDead`` (nothing
        pasted, the buffer deleted) if its program has exited.
        """
        _check_identifier("session name", session_name)
        text = pasteable(text)
        pane = f"={session_name}:"
        commands: list[str] = []
        buffer_name = ""
        if text:
            buffer_name = f"dispatch-paste-{uuid.uuid4().hex}"
            self._load_buffer(buffer_name, text)
            commands.append(f"paste-buffer {'-p ' if bracketed else ''}-d -b {buffer_name} -t {pane}")
        if enter:
            commands.append(f"send-keys -t {pane} Enter")
        if not commands:
            return
        try:
            self._write_if_alive(session_name, commands)
        except TmuxError:
            if buffer_name:  # not pasted, so ``paste-buffer -d`` did not delete it
                self._cmd("delete-buffer", "-b", buffer_name)
            raise

    def send_keys(self, session_name: str, keys: list[str]) -> None:
        """Send the tmux keys ``keys`` (names like ``C-c``, ``Enter``: ``KEY_NAME``) to the
        pane, only if it is alive at that instant (``_write_if_alive``).

        Raises ``TmuxError`` for an empty list or a key that is not a key name,
        ``TmuxSessionNotFound`` if the session is gone, ``TmuxPaneDead`` if its program
        has exited.
        """
        _check_identifier("session name", session_name)
        if not keys or not all(isinstance(key, str) and KEY_NAME.fullmatch(key) for key in keys):
            raise TmuxError(f"Invalid keys {keys!r}: give tmux key names like C-c or Enter.")
        self._write_if_alive(session_name, [f"send-keys -t ={session_name}: {' '.join(keys)}"])

    def _write_if_alive(self, session_name: str, commands: list[str]) -> None:
        """Run the tmux ``commands`` (a ``;``-separated list, parsed by tmux: only
        identifiers and key names may appear in them) only if ``session_name``'s pane is
        alive, decided by the tmux server right before it runs them.

        One ``if-shell -F`` in one client call: the server evaluates the condition and then
        runs the chosen commands from the same command queue, with no event (a pane dying)
        handled in between — a check followed by a second call would leave that window open,
        and ``paste-buffer`` into a dead pane crashes tmux 3.3a. The condition also checks
        the pane's session name: ``if-shell -t`` does not fail on a missing target.

        Raises ``TmuxSessionNotFound`` if the session is missing, ``TmuxPaneDead`` if it is
        there but its pane is dead, ``TmuxError`` if a command failed.
        """
        pane = f"={session_name}:"
        alive = f"#{{&&:#{{==:#{{session_name}},{session_name}}},#{{!=:#{{pane_dead}},1}}}}"
        proc = self._check(
            "if-shell",
            "-F",
            "-t",
            pane,
            alive,
            " ; ".join([*commands, f"display-message -p {_WROTE}"]),
            "",
            session_name=session_name,
        )
        if _WROTE in proc.stdout:
            return
        if not self.exists(session_name):
            raise TmuxSessionNotFound(f"No tmux session named {session_name!r}.")
        raise TmuxPaneDead(f"pane dead: the program in tmux session {session_name!r} has exited; nothing was written.")

    # --- plumbing --------------------------------------------------------------------

    def _cmd(self, command: str, *args: str | int) -> tmux_cmd:
        try:
            return self._server.cmd(command, *args)
        except libtmux_exc.TmuxCommandNotFound:
            raise TmuxError("tmux is not installed (not found on PATH).")

    def _check(self, command: str, *args: str | int, session_name: str | None) -> tmux_cmd:
        """Run a tmux command; raise on a non-zero exit (``TmuxSessionNotFound`` if the session is missing)."""
        proc = self._cmd(command, *args)
        if proc.returncode != 0:
            stderr = "\n".join(proc.stderr) or f"exit status {proc.returncode}"
            missing = "can't find session" in stderr or "no such session" in stderr or _is_server_down(stderr)
            if session_name is not None and missing:
                raise TmuxSessionNotFound(f"No tmux session named {session_name!r}.")
            raise TmuxError(f"tmux {command} failed: {stderr}")
        return proc

    def _check_clean(self, command: str, *args: str | int, session_name: str | None) -> None:
        """Run a tmux command that may start the server, with ``server_environment()``.

        A tmux server takes its global environment from the client that starts it; libtmux
        passes on this process's, so this one command runs as its own subprocess. Raises
        as ``_check``.
        """
        tmux = shutil.which("tmux")
        if tmux is None:
            raise TmuxError("tmux is not installed (not found on PATH).")
        socket = ["-L", self.socket_name] if self.socket_name else []
        proc = subprocess.run(
            [tmux, *socket, command, *(str(arg) for arg in args)],
            env=server_environment(),
            capture_output=True,
            text=True,
            timeout=_LOAD_BUFFER_TIMEOUT,
            check=False,
        )
        if proc.returncode != 0:
            stderr = proc.stderr.strip() or f"exit status {proc.returncode}"
            if session_name is not None and ("can't find session" in stderr or _is_server_down(stderr)):
                raise TmuxSessionNotFound(f"No tmux session named {session_name!r}.")
            raise TmuxError(f"tmux {command} failed: {stderr}")

    def _load_buffer(self, buffer_name: str, text: str) -> None:
        """``load-buffer -b <name> -`` with ``text`` on stdin (libtmux's ``cmd`` has no stdin)."""
        tmux = shutil.which("tmux")
        if tmux is None:
            raise TmuxError("tmux is not installed (not found on PATH).")
        socket = ["-L", self.socket_name] if self.socket_name else []
        try:
            proc = subprocess.run(
                [tmux, *socket, "load-buffer", "-b", buffer_name, "-"],
                input=text.encode(),
                capture_output=True,
                timeout=_LOAD_BUFFER_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise TmuxError(f"tmux load-buffer did not finish within {_LOAD_BUFFER_TIMEOUT:.0f} s.")
        if proc.returncode != 0:
            raise TmuxError(f"tmux load-buffer failed: {proc.stderr.decode(errors='replace').strip()}")
