"""The built-in ``expert`` agent: a tool-calling loop over a Chat Completions endpoint
(docs/agents.md#the-expert-agent; the run-scoped remote tools: docs/agents.md#prompts-and-runs).

``ExpertAgent(run).execute()`` processes one claimed run to its end: it builds the tool
list once (native tools first, then the remotes named in ``run.input["remotes"]``),
sends the system prompt, the agent's earlier runs and this run's instruction to the
model (the ``openai`` SDK against ``DISPATCH_LLM_BASE_URL``), runs every tool call of a
reply concurrently, hands each result back as JSON text capped at
``DISPATCH_TOOL_RESULT_MAX_CHARS`` (a failing tool's result is an error string), and
repeats until the model answers without tool calls or ``DISPATCH_MAX_TOOL_STEPS`` model
calls were made. Every step is a ``system`` event on the agent and the run; the run ends
through ``run_finish``.

Live operations (docs/live-operations.md#the-built-in-agent): each tool call runs with a ``core.tools.ToolCall`` whose
``call_key`` is ``agent:<agent id>:<run id>`` and whose ``output``/``progress`` feed the
run's output tail (``agents.tail``: a long command's last lines as ``system`` events, at
most one per 2 s). While tool calls run, the run's status is checked every
``CANCEL_POLL`` seconds: a run cancelled meanwhile (``POST /api/v1/runs/{id}/cancel``, in
any process) cancels the operations started under its key (``cancel_calls``) and the
tool calls' tasks, and stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import openai
from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth.models import User

from agents import services
from agents.launching import NO_ENDPOINT
from agents.models import Agent, AgentEvent, Run
from agents.prompting import RemoteEntry, remote_entries, tool_names
from agents.tail import TailReporter
from agents.tools import tool_set
from core.errors import DispatchError, InvalidRequest
from core.tools import NATIVE, TOOL_CALL, Tool, ToolCall, ToolHandler, tool_name
from machines.services.live import cancel_calls
from remotes.selectors import remote_list_for
from remotes.services import remote_call

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are {name}, an expert agent of Dispatch (agent id {agent_id}). Carry out the user's "
    "instruction with the tools you are given: they act on the user's machines and remote "
    "services. Call tools when they help, several at once when they are independent. A tool "
    "result starting with 'error:' means the call failed; adjust and go on. When done, answer "
    "with the result in plain text."
)
HISTORY_BUDGET = 20_000  # characters of earlier runs in a run's context
HISTORY_RUNS = 20
EVENT_TEXT_MAX = 2_000  # characters of a tool result or argument kept in an event
CANCEL_POLL = 1.0  # seconds between two checks of the run's status while its tools run
_SECRET_KEY = re.compile(r"token|secret|password|passwd|api[_-]?key|authorization|credential", re.IGNORECASE)


def as_openai(tool: Tool) -> dict[str, Any]:
    """The Chat Completions ``tools`` entry of ``tool``."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def cap(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a note saying so when cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[result cut: {len(text)} characters, only the first {limit} shown]"


def redacted(value: Any) -> Any:
    """``value`` with every field whose name looks like a secret replaced by ``"***"``."""
    if isinstance(value, dict):
        return {key: "***" if _SECRET_KEY.search(str(key)) else redacted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [redacted(item) for item in value]
    if isinstance(value, str):
        return cap(value, EVENT_TEXT_MAX)
    return value


def error_text(exc: BaseException) -> str:
    """A failing tool's result as the model sees it: ``error: CODE: message``."""
    if isinstance(exc, DispatchError):
        return f"error: {exc.code}: {exc.message}"
    return f"error: {type(exc).__name__}: {exc}"


# --- the run ------------------------------------------------------------------------------


def _load(run_id: str) -> tuple[Run, Agent, User]:
    run = Run.objects.select_related("agent__owner").get(pk=run_id)
    return run, run.agent, run.agent.owner


def _earlier_runs(agent: Agent, run: Run) -> list[Run]:
    return list(
        Run.objects.filter(agent=agent, status__in=[Run.Status.SUCCEEDED, Run.Status.FAILED])
        .exclude(pk=run.pk)
        .filter(created_at__lte=run.created_at)
        .order_by("-created_at", "-pk")[:HISTORY_RUNS]
    )


def _run_status(run_id: str) -> str:
    return str(Run.objects.values_list("status", flat=True).get(pk=run_id))


class ExpertAgent:
    """Executes one claimed run of an expert agent (docs/agents.md#the-expert-agent).

    ``execute()`` never raises for a failure of the model or a tool: the run ends
    ``failed`` with the reason (or ``succeeded`` with the final answer). A run cancelled
    meanwhile stops at its next step and keeps its cancelled status.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.agent: Agent = run.agent
        self.user: User = run.agent.owner
        self.tail = TailReporter(self._record)

    @property
    def call_key(self) -> str:
        """The ``ToolCall.call_key`` of this run's tool calls: ``agent:<agent id>:<run id>``."""
        return f"agent:{self.agent.pk}:{self.run.pk}"

    @classmethod
    async def for_run(cls, run_id: str) -> ExpertAgent:
        """The agent executing run ``run_id``, its agent and owner loaded."""
        run, _agent, _user = await database_sync_to_async(_load)(run_id)
        return cls(run)

    async def event(self, message: str, **metadata: Any) -> None:
        """Record a ``system`` event on the agent and this run (``message`` cut to
        ``EVENT_TEXT_MAX`` characters)."""
        await self._record(cap(message, EVENT_TEXT_MAX), metadata)

    async def _record(self, message: str, metadata: dict[str, Any]) -> None:
        try:
            await database_sync_to_async(services.agent_event_record)(
                agent=self.agent, run=self.run, type=AgentEvent.Type.SYSTEM, message=message, metadata=metadata
            )
        except Exception:
            logger.exception("could not record an event of run %s", self.run.pk)

    async def finish(self, status: str, *, output: str = "", error: str = "") -> None:
        await database_sync_to_async(services.run_finish)(run=self.run, status=status, output=output, error=error)

    async def fail(self, error: str) -> None:
        await self.event(f"run failed: {error}", error=error)
        await self.finish(Run.Status.FAILED, error=error)

    # --- tools ----------------------------------------------------------------------------

    async def tools(self) -> list[Tool]:
        """The run's tools, resolved once (docs/agents.md#prompts-and-runs;
        ``agents.tools.tool_set``).

        Native tools first: the machine tools (session = the agent's id) and the agent
        tools of ``agents.tools`` (``list_agents``, ``get_agent_history``,
        ``dispatch_launch_agent``, ``dispatch_send_message``, ``message_status``; the agent
        is their caller, so its launches record it as ``launched_by``; ``dispatch_event`` is
        left out, the loop records every step). ``run.input["tools"]``, when present, keeps only the named
        native tools and no remotes. Otherwise each entry of ``run.input["remotes"]`` adds
        every function of that remote of the run's user, named prefix + function (cut and
        hashed past 64 characters); a remote not connected now is skipped with a warning
        and an event. The first tool of a name wins.
        """
        only = tool_names(self.run.input.get("tools"))
        if only is not None:
            offered = await self._tool_set()
            unknown = [name for name in only if name not in offered]
            if unknown:
                await self.event(f"unknown native tools ignored: {', '.join(unknown)}", unknown=unknown)
            return [offered[name] for name in only if name in offered]
        remotes = await self._remote_tools(remote_entries(self.run.input.get("remotes")))
        return list((await self._tool_set(remotes)).values())

    async def _tool_set(self, remotes: list[Tool] | None = None) -> dict[str, Tool]:
        """``tool_set`` with the agent as caller and without ``dispatch_event`` (the loop
        records every step itself), then ``remotes``."""
        return await tool_set(user=self.user, caller_agent=self.agent, event_tool=False, remotes=remotes or [])

    async def _remote_tools(self, entries: list[RemoteEntry]) -> list[Tool]:
        """Every function of the remotes ``entries`` name, as tools named prefix + function;
        a remote not connected now is skipped with a warning and an event."""
        if not entries:
            return []
        functions: dict[str, list[dict[str, Any]]] = {}
        for spec in await database_sync_to_async(remote_list_for)(user=self.user):
            functions.setdefault(spec["remotename"], []).append(spec)
        remotes = []
        for entry in entries:
            if entry.name not in functions:
                logger.warning("run %s: remote '%s' is not connected; skipped", self.run.pk, entry.name)
                await self.event(f"remote '{entry.name}' is not connected: skipped", remote=entry.name)
                continue
            for spec in functions[entry.name]:
                summary = spec.get("description") or f"The function '{spec['name']}'."
                remotes.append(
                    Tool(
                        name=tool_name(entry.prefix + spec["name"]),
                        description=f"[remote '{entry.name}'] {summary}",
                        parameters=spec.get("parameters") or {"type": "object", "properties": {}},
                        handler=self._remote(entry.name, spec["name"]),
                        source=entry.name,
                        checked=False,  # remote_call checks the arguments against the function's schema
                    )
                )
        return remotes

    def _remote(self, remotename: str, function: str) -> ToolHandler:
        async def call(arguments: dict[str, Any]) -> Any:
            return await remote_call(user=self.user, remotename=remotename, function=function, args=arguments)

        return call

    async def call_tool(self, tools: dict[str, Tool], name: str, arguments_json: str, call_id: str = "") -> str:
        """Run one tool call; its result as text for the model (an error string on failure).

        The call runs with ``TOOL_CALL`` set: the run's ``call_key``, and ``output`` /
        ``progress`` feeding the run's output tail (``agents.tail``).
        """
        tool = tools.get(name)
        try:
            arguments = json.loads(arguments_json or "{}")
        except ValueError:
            arguments = None
        await self.event(
            f"tool call {name}", tool=name, arguments=redacted(arguments) if arguments is not None else None
        )
        try:
            if tool is None:
                raise InvalidRequest(f"no tool named '{name}'")
            if not isinstance(arguments, dict):
                raise InvalidRequest("tool arguments must be a JSON object")
            tail = self.tail.start(name, call_id)
            token = TOOL_CALL.set(ToolCall(progress=tail.progress, call_key=self.call_key, output=tail.output))
            try:
                result = await tool(arguments)
            finally:
                TOOL_CALL.reset(token)
                self.tail.end(tail)
            text = cap(json.dumps(result, ensure_ascii=False, default=str), settings.TOOL_RESULT_MAX_CHARS)
            failed = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, DispatchError):
                logger.exception("run %s: tool %s raised", self.run.pk, name)
            text = cap(error_text(exc), settings.TOOL_RESULT_MAX_CHARS)
            failed = True
        await self.event(f"tool result {name}", tool=name, result=cap(text, EVENT_TEXT_MAX), failed=failed)
        return text

    async def call_tools(self, tools: dict[str, Tool], calls: list[Any]) -> list[str] | None:
        """Run one reply's tool calls concurrently; their results in order, or ``None``
        when the run was cancelled meanwhile (its operations and the calls cancelled)."""
        batch = asyncio.gather(
            *(self.call_tool(tools, call.function.name, call.function.arguments, call.id) for call in calls)
        )
        watcher = asyncio.create_task(self._watch_cancel(batch), name=f"run {self.run.pk} cancel watch")
        try:
            return list(await batch)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if watcher.done() and not watcher.cancelled() and watcher.result() is not None:
                if current is None or not current.cancelling():
                    await self.event(
                        "run cancelled: its tool calls were stopped", cancelled_operations=watcher.result()
                    )
                    return None
            raise
        finally:
            watcher.cancel()
            batch.cancel()  # no-op when done; on our own cancellation, the calls stop too

    async def _watch_cancel(self, batch: asyncio.Future[Any]) -> int | None:
        """While ``batch`` runs, check every ``CANCEL_POLL`` seconds that the run is still
        running; when it is not, cancel the operations started under the run's key (in any
        process) and ``batch``. Returns how many operations were cancelled, or ``None``
        when ``batch`` ended first."""
        while not batch.done():
            await asyncio.sleep(CANCEL_POLL)
            if batch.done() or await database_sync_to_async(_run_status)(self.run.pk) == Run.Status.RUNNING:
                continue
            try:
                cancelled = await cancel_calls(user=self.user, call_key=self.call_key)
            except Exception:
                logger.exception("run %s: could not cancel its operations", self.run.pk)
                cancelled = 0
            batch.cancel()
            return cancelled
        return None

    # --- the loop -------------------------------------------------------------------------

    async def messages(self) -> list[dict[str, Any]]:
        """System prompt, earlier runs (newest last, within ``HISTORY_BUDGET``), this run."""
        earlier = await database_sync_to_async(_earlier_runs)(self.agent, self.run)
        history: list[dict[str, Any]] = []
        budget = HISTORY_BUDGET
        for run in earlier:  # newest first, so the budget keeps the most recent
            answer = run.output if run.status == Run.Status.SUCCEEDED else f"(failed: {run.error})"
            pair = [
                {"role": "user", "content": str(run.input.get("instruction", ""))},
                {"role": "assistant", "content": answer},
            ]
            budget -= sum(len(message["content"]) for message in pair)
            if budget < 0:
                break
            history[:0] = pair
        instruction = str(self.run.input.get("instruction", ""))
        given = self.run.input.get("input")
        if given is not None:
            instruction += "\n\nInput:\n" + json.dumps(given, ensure_ascii=False)
        system = SYSTEM_PROMPT.format(name=self.agent.name, agent_id=self.agent.pk)
        return [{"role": "system", "content": system}, *history, {"role": "user", "content": instruction}]

    async def execute(self) -> None:
        """Process the run to its end (see the class docstring)."""
        if not settings.LLM_BASE_URL:
            await self.fail(NO_ENDPOINT)
            return
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except openai.OpenAIError as exc:
            await self.fail(f"model call failed: {exc}")
        except Exception as exc:
            logger.exception("run %s failed", self.run.pk)
            await self.fail(f"internal error: {type(exc).__name__}: {exc}")

    async def _loop(self) -> None:
        tools = await self.tools()
        by_name = {tool.name: tool for tool in tools}
        await self.event(
            f"run started with {len(tools)} tools",
            tools=[tool.name for tool in tools],
            remotes=sorted({tool.source for tool in tools} - {NATIVE}),
        )
        messages = await self.messages()
        client = openai.AsyncOpenAI(
            base_url=settings.LLM_BASE_URL, api_key=settings.LLM_API_KEY or "unused", max_retries=0
        )
        try:
            for step in range(1, settings.MAX_TOOL_STEPS + 1):
                if await database_sync_to_async(_run_status)(self.run.pk) != Run.Status.RUNNING:
                    await self.event("run stopped: it is no longer running")
                    return
                await self.event(f"model call {step}", step=step, model=settings.LLM_MODEL)
                request: dict[str, Any] = {"model": settings.LLM_MODEL, "messages": messages}
                if tools:
                    request["tools"] = [as_openai(tool) for tool in tools]
                completion = await client.chat.completions.create(**request)
                if not completion.choices:
                    raise openai.OpenAIError("the model returned no choices")
                reply = completion.choices[0].message
                calls = [call for call in (reply.tool_calls or []) if call.type == "function"]
                if not calls:
                    answer = reply.content or ""
                    await self.event("answer", step=step, answer=cap(answer, EVENT_TEXT_MAX))
                    await self.finish(Run.Status.SUCCEEDED, output=answer)
                    return
                messages.append(
                    {
                        "role": "assistant",
                        "content": reply.content,
                        "tool_calls": [
                            {
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.function.name, "arguments": call.function.arguments},
                            }
                            for call in calls
                        ],
                    }
                )
                results = await self.call_tools(by_name, calls)
                if results is None:
                    return
                for call, text in zip(calls, results, strict=True):
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        finally:
            await self.tail.close()
            await client.close()
        await self.fail(f"the model did not finish within {settings.MAX_TOOL_STEPS} steps (DISPATCH_MAX_TOOL_STEPS)")
