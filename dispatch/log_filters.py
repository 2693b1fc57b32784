"""How client errors reach the server log (docs/operating.md#logs).

Django logs every 4xx answer on ``django.request`` at WARNING ("Bad Request: …", "Not
Found: …") and a refused ``Host`` header on ``django.security.DisallowedHost`` at ERROR
with its whole traceback. For Dispatch most 4xx answers are the protocol working: a shim's
device login polls ``authorization_pending`` every five seconds, OAuth clients probe
``/.well-known/`` paths this server does not have. These logging filters (installed by
``LOGGING`` in ``dispatch.settings``) keep such answers at DEBUG and make a refused host
one WARNING line that says which setting to change; 5xx answers are left as Django logs
them (ERROR, with the traceback).
"""

from __future__ import annotations

import logging


class ClientErrorsAtDebug(logging.Filter):
    """On ``django.request``: a record about a 4xx answer (``status_code`` 400-499, set by
    Django's ``log_response``) is lowered to DEBUG, and kept only when the logger is
    enabled for DEBUG (``DISPATCH_LOG_LEVEL=DEBUG``). Every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if not isinstance(status, int) or not 400 <= status < 500 or record.levelno <= logging.DEBUG:
            return True
        record.levelno = logging.DEBUG
        record.levelname = logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class DisallowedHostOneLine(logging.Filter):
    """On ``django.security.DisallowedHost``: the record becomes one WARNING line without
    the traceback (the request was answered 400 "Bad Request"; nothing failed here), naming
    the settings an operator changes when the host is a legitimate name of this server."""

    HINT = (
        " If clients reach this server by that name, add it to ALLOWED_HOSTS (environment or .env; default: "
        "localhost, 127.0.0.1, [::1] and the host of DISPATCH_PUBLIC_URL) or set DISPATCH_PUBLIC_URL to the "
        "address clients use (docs/operating.md)."
    )

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "dispatch_one_line", False):
            return True
        # "Invalid HTTP_HOST header: 'x'. You may need to add 'x' to ALLOWED_HOSTS."
        message = record.getMessage().split(" You may need to add", 1)[0]
        record.msg = message + self.HINT
        record.args = None
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        if record.levelno > logging.WARNING:
            record.levelno = logging.WARNING
            record.levelname = logging.getLevelName(logging.WARNING)
        record.dispatch_one_line = True  # a second handler or filter pass leaves it as it is
        return True
