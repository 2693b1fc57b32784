"""The tmux layer for CLI agents (agents/tmux.py, docs/agents.md#the-private-tmux-server),
against real tmux.

Each test runs its own tmux server (``tmux -L <unique name>``) and kills it afterwards,
so nothing here touches the user's sessions. Waiting is polling with a deadline.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import libtmux
import pytest

from agents.tmux import DEFAULT_SOCKET, PaneState, TmuxError, TmuxPaneDead, TmuxRunner, TmuxSessionNotFound

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")

INSTANCE = "ins_test_a"
SHELL = ["bash", "--norc", "--noprofile", "-i"]
# A quiet interactive bash: a fixed prompt, no history file written.
SHELL_ENV = {"PS1": "$ ", "HISTFILE": "/dev/null"}


@pytest.fixture
def socket_name() -> Iterator[str]:
    name = f"dispatch-test-{uuid.uuid4().hex[:12]}"
    yield name
    server = libtmux.Server(socket_name=name)
    if server.is_alive():
        server.kill()
    # tmux leaves the socket file behind when its server exits.
    (Path(os.environ.get("TMUX_TMPDIR", "/tmp")) / f"tmux-{os.getuid()}" / name).unlink(missing_ok=True)


@pytest.fixture
def runner(socket_name: str) -> TmuxRunner:
    return TmuxRunner(socket_name=socket_name)


def session() -> str:
    return f"dispatch_agt_{uuid.uuid4().hex[:12]}"


def wait_for(condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_shell(runner: TmuxRunner, cwd: Path) -> str:
    """Start an interactive bash and wait for its prompt.

    Text pasted before the program is ready (here: before readline turns on bracketed
    paste) is typed into the terminal line by line, so callers wait for a quiet pane.
    """
    name = session()
    runner.start(session_name=name, instance_id=INSTANCE, argv=SHELL, cwd=str(cwd), env=SHELL_ENV)
    wait_for(lambda: runner.capture(name).endswith("$"), "the shell's prompt")
    return name


def wait_dead(runner: TmuxRunner, name: str) -> PaneState:
    wait_for(lambda: runner.pane_state(name).dead, f"the pane of {name} to die")
    return runner.pane_state(name)


def ps_args(pid: int) -> str:
    """The command line of process ``pid``, as ``ps`` shows it."""
    return subprocess.run(
        ["ps", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, check=True
    ).stdout.strip()


def send_keys(socket_name: str, name: str, *keys: str) -> None:
    libtmux.Server(socket_name=socket_name).cmd("send-keys", "-t", f"={name}:", *keys)


def test_it_runs_the_program_in_cwd_and_a_pasted_command_runs(runner: TmuxRunner, tmp_path: Path) -> None:
    name = start_shell(runner, tmp_path)

    runner.paste(name, "echo hello-$((1+1)); pwd")

    wait_for(lambda: "hello-2" in runner.capture(name), "the command's output")
    assert str(tmp_path) in runner.capture(name).splitlines()
    state = runner.pane_state(name)
    assert not state.dead and state.exit_status is None and state.pid is not None


def test_it_delivers_a_multi_line_paste_whole_and_exactly(runner: TmuxRunner, socket_name: str, tmp_path: Path) -> None:
    name = session()
    text = "first line\n  second: $HOME `id` $(touch pwned) 'q' \"dq\" #{pane_id}\nthird line ends;\n"
    runner.start(session_name=name, instance_id=INSTANCE, argv=["sh", "-c", "cat > out.txt"], cwd=str(tmp_path), env={})

    runner.paste(name, text, enter=False)
    send_keys(socket_name, name, "C-d")

    assert wait_dead(runner, name).exit_status == 0
    assert (tmp_path / "out.txt").read_text() == text
    assert not (tmp_path / "pwned").exists()


def test_it_pastes_multi_line_text_into_a_shell_as_one_input(runner: TmuxRunner, tmp_path: Path) -> None:
    name = start_shell(runner, tmp_path)

    # As one input, bash runs both lines and ``read`` waits for the terminal; typed line
    # by line, ``read`` would take the second line as its data and nothing prints "got-".
    runner.paste(name, "echo waiting; read -r ANSWER\necho got-[$ANSWER]")
    wait_for(lambda: re.search(r"^waiting$", runner.capture(name), re.M), "read to wait")
    runner.paste(name, "forty-two")

    wait_for(lambda: "got-[forty-two]" in runner.capture(name), "the second line to run after read")


def test_it_leaves_no_paste_buffer_behind(runner: TmuxRunner, socket_name: str, tmp_path: Path) -> None:
    name = start_shell(runner, tmp_path)

    runner.paste(name, "echo one")
    runner.paste(name, "")  # just Enter

    wait_for(lambda: runner.capture(name).splitlines()[-3:] == ["one", "$", "$"], "the output and two prompts")
    assert libtmux.Server(socket_name=socket_name).cmd("list-buffers", "-F", "#{buffer_name}").stdout == []


def test_it_pastes_100_kb(runner: TmuxRunner, socket_name: str, tmp_path: Path) -> None:
    name = session()
    text = "".join(f"{i:06d} " + "x" * 92 + "\n" for i in range(1024))  # 1024 lines of 100 bytes
    runner.start(session_name=name, instance_id=INSTANCE, argv=["sh", "-c", "cat > out.txt"], cwd=str(tmp_path), env={})

    runner.paste(name, text, enter=False)
    send_keys(socket_name, name, "C-d")

    assert wait_dead(runner, name).exit_status == 0
    assert len(text) == 102_400
    assert (tmp_path / "out.txt").read_text() == text


def test_it_keeps_a_session_that_exited_0_with_its_status(runner: TmuxRunner, tmp_path: Path) -> None:
    name = start_shell(runner, tmp_path)

    runner.paste(name, "exit 0")

    assert wait_dead(runner, name) == PaneState(dead=True, exit_status=0, pid=None)
    assert runner.exists(name)
    assert runner.owned_sessions(INSTANCE) == [name]


def test_it_keeps_the_status_and_last_lines_of_a_failed_program(runner: TmuxRunner, tmp_path: Path) -> None:
    name = start_shell(runner, tmp_path)

    runner.paste(name, "echo last-$((40+2))")
    wait_for(lambda: "last-42" in runner.capture(name), "the command's output")
    runner.paste(name, "exit 3")

    assert wait_dead(runner, name).exit_status == 3
    assert "last-42" in runner.capture(name, lines=5).splitlines()


def test_it_keeps_a_program_that_exits_at_once(runner: TmuxRunner, tmp_path: Path) -> None:
    name = session()

    runner.start(session_name=name, instance_id=INSTANCE, argv=["sh", "-c", "exit 7"], cwd=str(tmp_path), env={})

    assert wait_dead(runner, name) == PaneState(dead=True, exit_status=7, pid=None)
    assert runner.owned_sessions(INSTANCE) == [name]


def test_it_passes_argv_literally_without_a_shell(runner: TmuxRunner, tmp_path: Path) -> None:
    name = session()
    marker = Path(f"/tmp/pwned-{uuid.uuid4().hex}")
    hostile = [f"$(touch {marker}); `touch {marker}`", "ends;", "back\\;", ";", "#{session_name}", "~", "*", "a b"]
    # The hostile strings are positional parameters: "$@" prints them without evaluating
    # them, so only a shell string built from argv could run the ``touch``. (The program
    # stays alive: tmux 3.3a may drop the last output of a program that exits at once.)
    script = 'printf "%s\\n" "$@"; exec sleep 60'

    runner.start(
        session_name=name, instance_id=INSTANCE, argv=["sh", "-c", script, "sh", *hostile], cwd=str(tmp_path), env={}
    )

    wait_for(lambda: len(runner.capture(name).splitlines()) == len(hostile), "every argument printed")
    assert runner.capture(name).splitlines() == hostile
    assert not marker.exists()


def test_it_runs_a_lone_argv_element_as_one_program_path(runner: TmuxRunner, tmp_path: Path) -> None:
    program = tmp_path / "my prog $(echo INJECTED) `echo INJECTED`;"
    program.write_text('#!/bin/sh\necho "ran-$0"\nexec sleep 60\n')
    program.chmod(0o755)
    name = session()

    runner.start(session_name=name, instance_id=INSTANCE, argv=[str(program)], cwd=str(tmp_path), env={})

    wait_for(lambda: "ran-" in runner.capture(name), "the program's output")
    assert runner.capture(name).splitlines()[0] == f"ran-{program}"
    pid = runner.pane_state(name).pid
    assert pid is not None
    # ``exec`` all the way down: the pane's process is the program itself, not a shell.
    assert ps_args(pid) == "sleep 60"


def test_it_uses_a_cwd_with_tmux_format_characters_literally(runner: TmuxRunner, tmp_path: Path) -> None:
    cwd = tmp_path / "dir #{session_name} #(echo INJECTED);"
    cwd.mkdir()
    name = session()

    runner.start(session_name=name, instance_id=INSTANCE, argv=["sh", "-c", "pwd; exec sleep 60"], cwd=str(cwd), env={})

    wait_for(lambda: runner.capture(name), "the working directory in the pane")
    assert runner.capture(name).splitlines()[0] == str(cwd)


def test_it_gives_env_to_the_process_but_not_its_command_line(
    runner: TmuxRunner, socket_name: str, tmp_path: Path
) -> None:
    name = session()
    secret = f"s3cret-{uuid.uuid4().hex};"

    runner.start(
        session_name=name,
        instance_id=INSTANCE,
        argv=["sh", "-c", 'printf "%s\\n" "$FOO"; exec sleep 60'],
        cwd=str(tmp_path),
        env={"FOO": secret},
    )

    wait_for(lambda: secret in runner.capture(name), "the variable's value in the pane")
    pid = runner.pane_state(name).pid
    assert pid is not None
    args = ps_args(pid)
    assert args == "sleep 60" and secret not in args
    session_env = libtmux.Server(socket_name=socket_name).cmd("show-environment", "-t", f"={name}").stdout
    assert not any(secret in line for line in session_env)


def test_it_lists_only_the_sessions_tagged_with_its_instance(
    runner: TmuxRunner, socket_name: str, tmp_path: Path
) -> None:
    mine, theirs = session(), session()
    runner.start(session_name=mine, instance_id=INSTANCE, argv=["sleep", "60"], cwd=str(tmp_path), env={})
    runner.start(session_name=theirs, instance_id="ins_test_b", argv=["sleep", "60"], cwd=str(tmp_path), env={})
    libtmux.Server(socket_name=socket_name).cmd("new-session", "-d", "-s", "users_own", "sleep", "60")

    assert runner.owned_sessions(INSTANCE) == [mine]
    assert runner.owned_sessions("ins_test_b") == [theirs]
    assert runner.owned_sessions("ins_test_c") == []


def test_it_lists_no_sessions_when_no_tmux_server_runs(runner: TmuxRunner) -> None:
    assert runner.owned_sessions(INSTANCE) == []
    assert not runner.exists(session())


def test_it_interrupts_and_kills(runner: TmuxRunner, tmp_path: Path) -> None:
    name = session()
    runner.start(session_name=name, instance_id=INSTANCE, argv=["sleep", "60"], cwd=str(tmp_path), env={})
    pid = runner.pane_state(name).pid
    assert pid is not None
    # A C-c that lands while tmux is still setting up the child's terminal is lost.
    wait_for(lambda: ps_args(pid) == "sleep 60", "sleep to run")

    runner.interrupt(name)

    assert wait_dead(runner, name) == PaneState(dead=True, exit_status=None, pid=None, signal=signal.SIGINT)
    runner.kill(name)
    assert not runner.exists(name)
    assert runner.owned_sessions(INSTANCE) == []


def test_it_acts_only_on_the_exact_session_name(runner: TmuxRunner, tmp_path: Path) -> None:
    name = session()
    runner.start(session_name=name, instance_id=INSTANCE, argv=["sleep", "60"], cwd=str(tmp_path), env={})
    prefix = name[:-4]

    assert not runner.exists(prefix)
    for action in (runner.kill, runner.interrupt, runner.pane_state, runner.capture, lambda n: runner.paste(n, "x")):
        with pytest.raises(TmuxSessionNotFound):
            action(prefix)
    assert runner.pane_state(name).dead is False


def test_it_refuses_a_second_session_of_the_same_name(runner: TmuxRunner, tmp_path: Path) -> None:
    name = session()
    runner.start(session_name=name, instance_id=INSTANCE, argv=["sleep", "60"], cwd=str(tmp_path), env={})

    with pytest.raises(TmuxError, match="already exists"):
        runner.start(session_name=name, instance_id="ins_test_b", argv=["sleep", "60"], cwd=str(tmp_path), env={})

    assert runner.owned_sessions(INSTANCE) == [name]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("session_name", "bad.name", "Invalid session name"),
        ("session_name", "", "Invalid session name"),
        ("instance_id", "ins;x", "Invalid instance id"),
        ("argv", [], "argv must name a program"),
        ("cwd", "/nonexistent/dir", "not an existing directory"),
        ("env", {"A=B": "c"}, "Invalid environment variable name"),
    ],
)
def test_it_refuses_bad_start_arguments(
    runner: TmuxRunner, tmp_path: Path, field: str, value: object, message: str
) -> None:
    arguments: dict[str, object] = {
        "session_name": session(),
        "instance_id": INSTANCE,
        "argv": ["sleep", "60"],
        "cwd": str(tmp_path),
        "env": {},
    }
    arguments[field] = value

    with pytest.raises(TmuxError, match=message):
        runner.start(**arguments)  # type: ignore[arg-type]

    assert runner.owned_sessions(INSTANCE) == []
    assert os.listdir(tmp_path) == []


# --- secrets and control characters ------------------------------------------------------


def test_the_environment_reaches_the_program_through_a_deleted_file_never_a_command_line(
    runner: TmuxRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cret-" + uuid.uuid4().hex
    commands: list[tuple[object, ...]] = []
    real_cmd = runner._cmd

    def recording(command: str, *args: str | int) -> object:
        commands.append((command, *args))
        return real_cmd(command, *args)

    monkeypatch.setattr(runner, "_cmd", recording)
    out = tmp_path / "env.out"
    name = session()
    runner.start(
        session_name=name,
        instance_id=INSTANCE,
        argv=["sh", "-c", f"printf '%s' \"$DISPATCH_MCP_TOKEN\" > {out}"],
        cwd=str(tmp_path),
        env={"DISPATCH_MCP_TOKEN": secret},
    )
    wait_dead(runner, name)
    assert out.read_text() == secret
    assert not any(secret in str(arg) for command in commands for arg in command)  # no tmux argv held it
    assert not [p for p in Path(tempfile.gettempdir()).glob("dispatch-agent-env-*") if secret in _text_or_empty(p)]


def _text_or_empty(path: Path) -> str:
    """A file's text, or "" when another worker's agent deleted it between the glob and the read."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def test_dispatch_configuration_in_the_tmux_servers_environment_does_not_reach_the_agent(
    socket_name: str, tmp_path: Path
) -> None:
    # A tmux server started by Dispatch inherits its environment: start one that way.
    tmux = shutil.which("tmux")
    assert tmux is not None
    leaky = {
        **os.environ,
        "SECRET_KEY": "django-secret",
        "DATABASE_URL": "postgres://u:p@h/db",
        "DISPATCH_LLM_API_KEY": "sk-secret",
        "DJANGO_SETTINGS_MODULE": "dispatch.settings",
        "USER_TOOL_TOKEN": "kept",
    }
    subprocess.run([tmux, "-L", socket_name, "new-session", "-d", "-s", "keeper"], env=leaky, check=True)
    runner = TmuxRunner(socket_name=socket_name)
    out = tmp_path / "env.out"
    name = session()
    runner.start(
        session_name=name, instance_id=INSTANCE, argv=["sh", "-c", f"env > {out}"], cwd=str(tmp_path), env={"A": "b"}
    )
    wait_dead(runner, name)
    seen = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    for name_ in ("SECRET_KEY", "DATABASE_URL", "DISPATCH_LLM_API_KEY", "DJANGO_SETTINGS_MODULE"):
        assert name_ not in seen
    assert seen["USER_TOOL_TOKEN"] == "kept" and seen["A"] == "b"


def test_a_program_that_cannot_start_says_why_in_the_pane(runner: TmuxRunner, tmp_path: Path) -> None:
    name = session()
    runner.start(
        session_name=name, instance_id=INSTANCE, argv=["dispatch-no-such-program-x"], cwd=str(tmp_path), env={}
    )
    state = wait_dead(runner, name)
    assert state.exit_status == 127
    assert "cannot start 'dispatch-no-such-program-x'" in runner.capture(name)


def test_control_characters_cannot_break_out_of_the_paste(runner: TmuxRunner, tmp_path: Path) -> None:
    name = start_shell(runner, tmp_path)
    early = tmp_path / "EARLY"
    # ESC [201~ would end the bracketed paste; Ctrl-U would then erase the line and the
    # rest would run as typed keystrokes.
    runner.paste(name, f"echo SAFE-$((20+22)) # \x1b[201~\x15touch {early}")
    wait_for(lambda: "SAFE-42" in runner.capture(name), "the pasted command's output")
    assert not early.exists() and not (tmp_path / "EARLY~").exists()


def test_pasteable_keeps_text_tabs_and_newlines_and_drops_other_controls() -> None:
    from agents.tmux import pasteable

    assert pasteable("a\tb\r\nc\rd\n") == "a\tb\nc\nd\n"
    assert pasteable("x\x1b[201~y\x15z\x00\x7f") == "x[201~yz"
    assert pasteable("héllo ✓") == "héllo ✓"


# --- never writing into a dead pane (docs/agents.md#how-a-message-reaches-the-pane) --------


def start_dead(runner: TmuxRunner, cwd: Path) -> str:
    """A ``remain-on-exit`` session whose program printed a line and exited 1 at once."""
    name = session()
    argv = ["sh", "-c", "echo cannot start; exit 1"]
    runner.start(session_name=name, instance_id=INSTANCE, argv=argv, cwd=str(cwd), env={})
    assert wait_dead(runner, name).exit_status == 1
    return name


def test_a_paste_into_a_dead_pane_reports_it_and_the_tmux_server_survives(
    runner: TmuxRunner, socket_name: str, tmp_path: Path
) -> None:
    # tmux 3.3a segfaults on ``paste-buffer`` into a dead ``remain-on-exit`` pane, taking
    # every session of the server with it: here the bystander.
    bystander = session()
    runner.start(session_name=bystander, instance_id=INSTANCE, argv=["sleep", "600"], cwd=str(tmp_path), env={})
    dead = start_dead(runner, tmp_path)

    with pytest.raises(TmuxPaneDead, match="pane dead"):
        runner.paste(dead, "hello\nworld")

    assert runner.exists(bystander) and not runner.pane_state(bystander).dead
    assert runner.owned_sessions(INSTANCE) == sorted([bystander, dead])
    assert "cannot start" in runner.capture(dead)
    assert libtmux.Server(socket_name=socket_name).cmd("list-buffers", "-F", "#{buffer_name}").stdout == []


def test_keys_and_an_empty_paste_into_a_dead_pane_report_it_too(runner: TmuxRunner, tmp_path: Path) -> None:
    bystander = start_shell(runner, tmp_path)
    dead = start_dead(runner, tmp_path)

    for write in (
        lambda: runner.send_keys(dead, ["C-c"]),
        lambda: runner.interrupt(dead),
        lambda: runner.paste(dead, ""),
        lambda: runner.paste(dead, "/exit", enter=False, bracketed=False),
    ):
        with pytest.raises(TmuxPaneDead):
            write()

    assert not runner.pane_state(bystander).dead
    with pytest.raises(TmuxSessionNotFound):
        runner.send_keys(session(), ["C-c"])


def test_send_keys_refuses_anything_but_key_names(runner: TmuxRunner, tmp_path: Path) -> None:
    name = start_shell(runner, tmp_path)

    for keys in ([], ["C-c ; kill-server"], ["#{pane_pid}"], ["Enter;"], [""], ["x" * 17]):
        with pytest.raises(TmuxError, match="Invalid keys"):
            runner.send_keys(name, keys)

    assert runner.exists(name) and not runner.pane_state(name).dead


def test_keys_and_typed_text_reach_a_live_pane(runner: TmuxRunner, tmp_path: Path) -> None:
    name = start_shell(runner, tmp_path)

    runner.paste(name, "echo typed-$((2*21))", enter=False, bracketed=False)
    runner.send_keys(name, ["Enter"])

    wait_for(lambda: re.search(r"^typed-42$", runner.capture(name), re.M), "the typed command's output")


def test_without_a_socket_name_the_runner_uses_dispatchs_own_tmux_server() -> None:
    # Never the user's default server (``tmux`` without ``-L``): Dispatch's is ``-L dispatch``.
    for unset in (None, ""):
        runner = TmuxRunner(socket_name=unset)
        assert runner.socket_name == DEFAULT_SOCKET == "dispatch"
        assert runner._server.socket_name == "dispatch"
    assert TmuxRunner(socket_name="mine").socket_name == "mine"
