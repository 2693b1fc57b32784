"""Dispatch: the project package — settings, URLs, ASGI and websocket routing, the list of
background services, the ``serve``/``dispatch_worker`` commands, and the edges over several
apps (``/mcp`` in ``dispatch.mcp``, the ``/ws`` session in ``dispatch.ws``). See docs/architecture.md."""
