"""A test double of the model, and only of the model: a tiny OpenAI-compatible Chat
Completions server (``POST /v1/chat/completions``) on a free loopback port.

It answers each request with the next scripted reply — ``tool_calls(...)`` or
``answer(...)``, or a function of the request returning one — and records every request
it got (``requests``: the JSON bodies, so the tools offered and the messages sent).
Start it by hand for the walkthrough: ``python -m tests.agents.llm_double --call get_forecast
'{"city": "Rome"}'`` prints its URL and, for every prompt, first calls that tool (when the
run offers it), then answers with the tool's result; without ``--call`` it only answers.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = dict[str, Any]
Script = Reply | Callable[[dict[str, Any]], Reply]


def answer(text: str) -> Reply:
    """A reply without tool calls: the model's final answer."""
    return {"role": "assistant", "content": text}


def tool_calls(*calls: tuple[str, dict[str, Any]]) -> Reply:
    """A reply calling ``(name, arguments)`` tools (several: parallel calls)."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            for index, (name, arguments) in enumerate(calls)
        ],
    }


class LlmDouble:
    """The scripted server; ``url`` is its OpenAI base URL (``http://127.0.0.1:<port>/v1``)."""

    def __init__(self, script: list[Script] | None = None, *, fallback: Script | None = None) -> None:
        self.script: list[Script] = list(script or [])
        self.fallback = fallback
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        double = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                self._send(200, double.complete(body))

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The completion for one request: the next scripted reply (an answer when none is left)."""
        with self.lock:
            self.requests.append(body)
            if self.script:
                step = self.script.pop(0)
            else:
                step = self.fallback if self.fallback is not None else answer("(script exhausted)")
            number = next(self.ids)
        message = step(body) if callable(step) else step
        return {
            "id": f"chatcmpl-{number}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "double"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def tool_names(self, request: int = 0) -> list[str]:
        """The tool names offered in request number ``request``."""
        return [tool["function"]["name"] for tool in self.requests[request].get("tools", [])]

    def tool_results(self, request: int) -> list[str]:
        """The tool results (``role: tool`` contents) sent in request number ``request``."""
        return [m["content"] for m in self.requests[request]["messages"] if m["role"] == "tool"]

    def start(self) -> LlmDouble:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def call_then_answer(name: str, arguments: dict[str, Any]) -> Callable[[dict[str, Any]], Reply]:
    """A stateless responder for the walkthrough: a request whose last message is a tool
    result gets an answer quoting the results; otherwise, if the run offers a tool ending
    in ``name`` (a prefix may have been added), a call to it with ``arguments``; else an
    answer saying the tool was not offered."""

    def respond(body: dict[str, Any]) -> Reply:
        messages = body.get("messages", [])
        if messages and messages[-1].get("role") == "tool":
            results = [m["content"] for m in messages if m.get("role") == "tool"]
            return answer("The tool said: " + " | ".join(results))
        offered = [tool["function"]["name"] for tool in body.get("tools", [])]
        match = next((tool for tool in offered if tool == name or tool.endswith(name)), None)
        if match is None:
            return answer(f"(the tool {name} is not offered to this run; offered: {', '.join(offered) or 'none'})")
        return tool_calls((match, arguments))

    return respond


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - a manual helper
    """``python -m tests.agents.llm_double [--call NAME ARGS_JSON]``: serve until Ctrl-C."""
    import argparse
    import time

    parser = argparse.ArgumentParser(
        prog="python -m tests.agents.llm_double",
        description="A scripted OpenAI-compatible endpoint for trying the expert agent without a model.",
    )
    parser.add_argument(
        "--call",
        nargs=2,
        metavar=("TOOL", "ARGS_JSON"),
        help="for every prompt, call TOOL with these JSON arguments first, then answer with its result",
    )
    options = parser.parse_args(argv)
    fallback: Script | None = None
    what = "answers '(script exhausted)' to every prompt"
    if options.call:
        arguments = json.loads(options.call[1])
        if not isinstance(arguments, dict):
            parser.error("ARGS_JSON must be a JSON object")
        fallback = call_then_answer(options.call[0], arguments)
        what = f"calls {options.call[0]} then answers with its result"
    double = LlmDouble(fallback=fallback).start()
    print(f"DISPATCH_LLM_BASE_URL={double.url}  ({what})", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        double.stop()


if __name__ == "__main__":  # pragma: no cover - a manual helper
    main()
