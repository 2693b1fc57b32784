"""A fake model server for the real coding-agent CLIs (tests/agents/real_cli/): one small
HTTP server on a free loopback port that speaks both wire protocols the CLIs use.

* Anthropic Messages (Claude Code, ``ANTHROPIC_BASE_URL=<url>``): ``POST /v1/messages``
  streamed (SSE ``message_start``, ``content_block_start`` / ``content_block_delta`` /
  ``content_block_stop`` for ``text`` and ``tool_use`` with ``input_json_delta``,
  ``message_delta`` with ``stop_reason``, ``message_stop``) or not, and
  ``POST /v1/messages/count_tokens``.
* OpenAI Responses (codex, a ``model_providers`` entry with ``base_url = "<url>/v1"`` and
  ``wire_api = "responses"``): ``POST /v1/responses`` streamed (SSE ``response.created``,
  ``response.output_item.added``, ``response.output_text.delta``,
  ``response.output_item.done``, ``response.completed``; ``function_call`` items for tool
  calls), and ``GET /v1/models``.

The test sets a SCRIPT: a queue of turns (``say(text)`` or ``call(tool, input)``) that
the agent-loop requests (those offering tools) take in order; when the queue is empty, or
for the CLIs' side requests without tools (titles, quota probes), the server answers
``fallback`` text. Every request is recorded (``requests``: method, path, headers, JSON
body) and ``wait_for`` blocks on a condition, not a sleep. Unknown paths are recorded and
answered 404 with a JSON error. Thread-safe: the server is a ``ThreadingHTTPServer``.
"""

from __future__ import annotations

import functools
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One scripted model turn: ``text`` to say, or a tool call (``tool`` with ``input``)."""

    text: str | None = None
    tool: str | None = None
    input: dict[str, Any] = field(default_factory=dict)
    namespace: str | None = None


def say(text: str) -> Turn:
    """A turn answering ``text`` (stop reason ``end_turn``)."""
    return Turn(text=text)


def call(tool: str, input: dict[str, Any], *, namespace: str | None = None) -> Turn:
    """A turn calling ``tool`` with ``input``: Claude's ``Bash`` or ``mcp__<server>__<tool>``;
    codex's ``exec_command`` (``{"cmd": ...}``), or an MCP tool as ``namespace="mcp__<server>"``
    and ``tool="<tool>"`` (codex offers MCP tools as Responses ``namespace`` tools and runs a
    ``function_call`` only when it names the namespace; Claude ignores ``namespace``)."""
    return Turn(tool=tool, input=dict(input), namespace=namespace)


@dataclass
class Request:
    """One request received: ``body`` is the parsed JSON (``{}`` when empty or not JSON)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any

    def text(self) -> str:
        """The whole body as JSON text, to search for a prompt."""
        return json.dumps(self.body, ensure_ascii=False)

    @property
    def agent_loop(self) -> bool:
        """Whether it is a turn of the agent loop (a model request offering tools)."""
        return self.path.split("?")[0].rstrip("/").endswith(("/messages", "/responses")) and bool(
            isinstance(self.body, dict) and self.body.get("tools")
        )


class FakeModel:
    """The server; ``url`` is its root (``http://127.0.0.1:<port>``). Use as a context manager."""

    def __init__(self, script: list[Turn] | None = None, *, fallback: str = "OK.", port: int = 0) -> None:
        self.script: list[Turn] = list(script or [])
        self.fallback = fallback
        self.requests: list[Request] = []
        self.unknown: list[str] = []
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        model = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                model._handle(self, "GET")

            def do_POST(self) -> None:
                model._handle(self, "POST")

            def do_HEAD(self) -> None:
                model._handle(self, "HEAD")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-model", daemon=True)

    # lifecycle -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeModel:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeModel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # script and record -----------------------------------------------------------------
    def queue(self, *turns: Turn) -> None:
        """Append turns to the script (taken in order by agent-loop requests)."""
        with self._cond:
            self.script.extend(turns)

    def received(self, path_suffix: str = "") -> list[Request]:
        """A snapshot of the requests whose path ends with ``path_suffix``."""
        with self._cond:
            return [r for r in self.requests if r.path.split("?")[0].rstrip("/").endswith(path_suffix)]

    def prompts_containing(self, text: str) -> list[Request]:
        """The agent-loop requests whose body contains ``text`` (JSON-escaped as sent)."""
        needle = json.dumps(text, ensure_ascii=False)[1:-1]
        with self._cond:
            return [r for r in self.requests if r.agent_loop and needle in r.text()]

    def wait_for(self, predicate: Callable[[], Any], timeout: float) -> Any:
        """Block until ``predicate()`` is truthy (checked on every request) and return it;
        ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                result = predicate()
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"fake model: condition not met in {timeout} s; paths seen: {self._paths()}")
                self._cond.wait(left)

    def _paths(self) -> list[str]:
        return [f"{r.method} {r.path}" for r in self.requests]

    def _record(self, request: Request) -> Turn | None:
        with self._cond:
            self.requests.append(request)
            turn = self.script.pop(0) if request.agent_loop and self.script else None
            self._cond.notify_all()
            return turn

    # HTTP --------------------------------------------------------------------------------
    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        length = int(handler.headers.get("content-length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else {}
        except ValueError:
            body = {"_raw": raw.decode("utf-8", "replace")}
        path = handler.path.split("?")[0].rstrip("/") or "/"
        request = Request(method, handler.path, {k.lower(): v for k, v in handler.headers.items()}, body)
        if method == "POST" and path == "/_fake/queue":
            # By hand (``main``): queue turns from another shell, a JSON list of
            # ``{"text": ...}`` or ``{"tool": ..., "input": {...}}``.
            turns = [
                Turn(t.get("text"), t.get("tool"), t.get("input") or {}, t.get("namespace"))
                for t in body
                if isinstance(t, dict)
            ]
            self.queue(*turns)
            _send_json(handler, 200, {"queued": len(turns)})
            return
        turn = self._record(request)
        if method == "POST" and path.endswith("/messages/count_tokens"):
            _send_json(handler, 200, {"input_tokens": max(1, len(raw) // 4)})
        elif method == "POST" and path.endswith("/messages"):
            events = _anthropic_events(body, turn or say(self.fallback), next(self._ids))
            if body.get("stream"):
                _send_sse(handler, ((name, data) for name, data in events))
            else:
                _send_json(handler, 200, _anthropic_message(events))
        elif method == "POST" and path.endswith("/responses"):
            _send_sse(handler, _responses_events(body, turn or say(self.fallback), next(self._ids)))
        elif path == "/mcp":
            self._mcp(handler, method, body)
        elif method == "GET" and path.endswith("/models"):
            _send_json(handler, 200, {"object": "list", "data": [], "models": []})
        elif method == "HEAD" or (method == "GET" and path == "/"):
            _send_json(handler, 200, {})
        else:
            with self._cond:
                self.unknown.append(f"{method} {handler.path}")
            _send_json(
                handler, 404, {"type": "error", "error": {"type": "not_found_error", "message": f"no route {path}"}}
            )

    # A minimal MCP server (Streamable HTTP, JSON responses) at /mcp, enough to see how a
    # CLI is wired to one: which headers it sends, that it lists and calls tools. One tool,
    # ``echo``, answering its ``text`` argument.
    def _mcp(self, handler: BaseHTTPRequestHandler, method: str, body: Any) -> None:
        if method != "POST":
            _send_json(handler, 405, {"error": "POST only"})
            return
        if not isinstance(body, dict) or "id" not in body:
            handler.send_response(202)
            handler.send_header("content-length", "0")
            handler.end_headers()
            return
        name = body.get("method")
        params = body.get("params") or {}
        result: dict[str, Any]
        if name == "initialize":
            result = {
                "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "fake-mcp", "version": "1"},
            }
        elif name == "tools/list":
            result = {"tools": [MCP_ECHO_TOOL]}
        elif name == "tools/call":
            text = str((params.get("arguments") or {}).get("text", ""))
            result = {"content": [{"type": "text", "text": f"echo: {text}"}], "isError": False}
        elif name == "ping":
            result = {}
        else:
            _send_json(handler, 200, {"jsonrpc": "2.0", "id": body["id"], "error": {"code": -32601, "message": name}})
            return
        _send_json(handler, 200, {"jsonrpc": "2.0", "id": body["id"], "result": result})


MCP_ECHO_TOOL = {
    "name": "echo",
    "description": "Echo the text back.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
}


def _send_json(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


def _send_sse(handler: BaseHTTPRequestHandler, events: Iterator[tuple[str, dict[str, Any]]]) -> None:
    # One body, closed at the end: no chunked encoding to get wrong, and the CLIs read
    # events as they parse the stream anyway.
    data = b"".join(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode() for name, payload in events)
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.send_header("cache-control", "no-cache")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


# Anthropic Messages (https://docs.anthropic.com/en/api/messages-streaming) ---------------
def _anthropic_events(body: dict[str, Any], turn: Turn, n: int) -> list[tuple[str, dict[str, Any]]]:
    usage = {"input_tokens": 10, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    message = {
        "id": f"msg_fake{n}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "claude-fake"),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": message})]
    if turn.tool is not None:
        block = {"type": "tool_use", "id": f"toolu_fake{n}", "name": turn.tool, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(turn.input)}
        stop_reason = "tool_use"
    else:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": turn.text or ""}
        stop_reason = "end_turn"
    events += [
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": 5},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events


def _anthropic_message(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The non-streaming body equivalent to ``events``."""
    message = dict(events[0][1]["message"])
    block = dict(events[1][1]["content_block"])
    delta = events[2][1]["delta"]
    if block["type"] == "tool_use":
        block["input"] = json.loads(delta["partial_json"])
    else:
        block["text"] = delta["text"]
    message["content"] = [block]
    message["stop_reason"] = events[4][1]["delta"]["stop_reason"]
    return message


# OpenAI Responses (https://platform.openai.com/docs/api-reference/responses-streaming) ---
def _responses_events(body: dict[str, Any], turn: Turn, n: int) -> Iterator[tuple[str, dict[str, Any]]]:
    response: dict[str, Any] = {
        "id": f"resp_fake{n}",
        "object": "response",
        "created_at": int(time.time()),
        "model": body.get("model", "gpt-fake"),
        "status": "in_progress",
        "output": [],
    }
    seq = itertools.count()
    yield "response.created", {"type": "response.created", "sequence_number": next(seq), "response": response}
    if turn.tool is not None:
        item: dict[str, Any] = {
            "type": "function_call",
            "id": f"fc_fake{n}",
            "call_id": f"call_fake{n}",
            "name": turn.tool,
            "arguments": json.dumps(turn.input),
            "status": "completed",
        }
        if turn.namespace:
            item["namespace"] = turn.namespace
        added = {**item, "arguments": "", "status": "in_progress"}
        yield (
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "sequence_number": next(seq),
                "output_index": 0,
                "item": added,
            },
        )
        yield (
            "response.function_call_arguments.delta",
            {
                "type": "response.function_call_arguments.delta",
                "sequence_number": next(seq),
                "item_id": item["id"],
                "output_index": 0,
                "delta": item["arguments"],
            },
        )
    else:
        text = turn.text or ""
        item = {
            "type": "message",
            "id": f"msg_fake{n}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        yield (
            "response.output_item.added",
            {
                "type": "response.output_item.added",
                "sequence_number": next(seq),
                "output_index": 0,
                "item": {**item, "status": "in_progress", "content": []},
            },
        )
        yield (
            "response.content_part.added",
            {
                "type": "response.content_part.added",
                "sequence_number": next(seq),
                "item_id": item["id"],
                "output_index": 0,
                "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []},
            },
        )
        yield (
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "sequence_number": next(seq),
                "item_id": item["id"],
                "output_index": 0,
                "content_index": 0,
                "delta": text,
            },
        )
    yield (
        "response.output_item.done",
        {
            "type": "response.output_item.done",
            "sequence_number": next(seq),
            "output_index": 0,
            "item": item,
        },
    )
    done = {
        **response,
        "status": "completed",
        "output": [item],
        "usage": {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 15,
        },
    }
    yield "response.completed", {"type": "response.completed", "sequence_number": next(seq), "response": done}


def main() -> None:
    """``python -m tests.agents.fake_model [--port N] [--log FILE]``: serve by hand (to try
    a CLI against it), printing the URL and appending every request as a JSON line to FILE."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log", default=None)
    args = parser.parse_args()
    model = FakeModel(port=args.port)
    with model:
        print(model.url, flush=True)
        seen = 0
        while True:
            model.wait_for(functools.partial(_more_than, model, seen), timeout=3600)
            with model._cond:
                fresh = model.requests[seen:]
                seen = len(model.requests)
            for r in fresh:
                line = json.dumps({"method": r.method, "path": r.path, "headers": r.headers, "body": r.body})
                if args.log:
                    with open(args.log, "a") as out:
                        out.write(line + "\n")
                print(f"{r.method} {r.path}", flush=True)


def _more_than(model: FakeModel, count: int) -> bool:
    return len(model.requests) > count


if __name__ == "__main__":
    main()
