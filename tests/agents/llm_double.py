"""A test double of the model, and only of the model: a tiny OpenAI-compatible Chat
Completions server (``POST /v1/chat/completions``) on a free loopback port.

It answers each request with the next scripted reply — ``tool_calls(...)`` or
``answer(...)``, or a function of the request returning one — and records every request
it got (``requests``: the JSON bodies, so the tools offered and the messages sent).
Start it by hand for the walkthrough: ``python -m tests.agents.llm_double`` prints its URL.
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

    def __init__(self, script: list[Script] | None = None) -> None:
        self.script: list[Script] = list(script or [])
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
            step = self.script.pop(0) if self.script else answer("(script exhausted)")
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


if __name__ == "__main__":  # pragma: no cover - a manual helper
    import time

    double = LlmDouble().start()
    print(f"DISPATCH_LLM_BASE_URL={double.url}  (answers '(script exhausted)' to every prompt)")
    while True:
        time.sleep(3600)
