"""Machines: device login, machine tokens, live shim connections, routing state, audit.

Protocol: docs/shim-protocol.md. A *machine* is a user's computer known by the ``machine_id`` its shim
generated; a *connection* is one live shim socket (owned by a ``ServerProcess``, so a
dead process's connections are reaped with it); a *machine session* is a routing scope
named by a ``session_id`` string that connections attach to (``sessions`` list or ``*``).
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import models
from django.db.models import Value
from django.db.models.functions import Coalesce, NullIf
from django.utils import timezone
from packaging.version import InvalidVersion, Version

from core.models import ApiToken, ServerProcess


class DeviceAuthorization(models.Model):
    """One RFC 8628 device authorization request (docs/shim-protocol.md#getting-a-token).

    Both codes are stored only as SHA-256 digests. The machine token is minted when the
    shim polls after approval, so no raw token is ever stored.
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        APPROVED = "approved"
        DENIED = "denied"
        CONSUMED = "consumed"

    device_code_digest = models.CharField(max_length=64, unique=True)
    user_code_digest = models.CharField(max_length=64, unique=True)
    machine_id = models.CharField(max_length=64)
    hostname = models.CharField(max_length=255)
    platform = models.CharField(max_length=32)
    arch = models.CharField(max_length=32)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE)
    interval = models.PositiveIntegerField(default=5)  # seconds between polls (RFC 8628 §3.2)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    last_polled_at = models.DateTimeField(null=True, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"device login for {self.hostname} ({self.status})"


class MachineToken(models.Model):
    """A machine token: one user, one ``machine_id``; SHA-256 digest + display prefix only."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="machine_tokens")
    machine_id = models.CharField(max_length=64, db_index=True)
    prefix = models.CharField(max_length=8)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… (machine {self.machine_id})"


def default_allowed_capabilities() -> list[str]:
    """A new machine may use every capability its shim offers until its owner says otherwise."""
    return ["files", "shell"]


class Machine(models.Model):
    """A user's computer as its shim last described it, with its shown status (docs/shim-protocol.md#machine-status)."""

    class Connection(models.TextChoices):
        CONNECTING = "connecting"
        CONNECTED = "connected"
        DISCONNECTED = "disconnected"

    class Health(models.TextChoices):
        OK = "ok"
        OVERLOADED = "overloaded"
        ERROR = "error"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="machines")
    machine_id = models.CharField(max_length=64)
    hostname = models.CharField(max_length=255, blank=True)
    display_name = models.CharField(max_length=255, blank=True)
    platform = models.CharField(max_length=32, blank=True)
    arch = models.CharField(max_length=32, blank=True)
    shim_version = models.CharField(max_length=64, blank=True)
    capabilities = models.JSONField(default=list)  # what the shim advertised
    allowed_capabilities = models.JSONField(default=default_allowed_capabilities)  # the user's setting
    granted_capabilities = models.JSONField(default=list)  # advertised ∩ allowed
    allowed_roots = models.JSONField(default=list)
    hardware_devices = models.JSONField(default=list)
    snapshot = models.JSONField(null=True, blank=True)  # the cached MACHINE_LIST_RESPONSE payload
    connection_status = models.CharField(max_length=12, choices=Connection.choices, default=Connection.DISCONNECTED)
    health = models.CharField(max_length=12, choices=Health.choices, default=Health.OK)
    status_reason = models.CharField(max_length=255, blank=True)
    last_active_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "machine_id"], name="machine_unique_per_user")]
        ordering = ["display_name", "hostname"]

    def __str__(self) -> str:
        return self.name

    @property
    def name(self) -> str:
        """What people call it: the display name, else the host name, else the id."""
        return self.display_name or self.hostname or self.machine_id

    @staticmethod
    def name_expression() -> Coalesce:
        """``name`` as a database expression (the same rule), for a query that shows the
        names of machines it only knows by id (the audit records of the Machines page)."""
        return Coalesce(NullIf("display_name", Value("")), NullIf("hostname", Value("")), "machine_id")

    def shim_older_than(self, version: str) -> bool:
        """Whether this machine's shim (``shim_version``, from its last HELLO) is an older
        release than ``version`` (PEP 440 order: ``0.10.0`` is newer than ``0.9.1``). A
        version that is missing or not PEP 440 is not called older: it cannot be compared."""
        try:
            return Version(self.shim_version) < Version(version)
        except InvalidVersion:
            return False


class MachineConnection(models.Model):
    """One live shim socket: the attachment of a machine to its sessions (docs/shim-protocol.md#machine-sessions).

    ``sessions`` is the HELLO's list (``["*"]`` for every session of the user).
    """

    machine = models.ForeignKey(Machine, on_delete=models.CASCADE, related_name="connections")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    connection_id = models.CharField(max_length=40, unique=True)
    channel_name = models.CharField(max_length=200, unique=True)
    server_process = models.ForeignKey(ServerProcess, on_delete=models.CASCADE, related_name="machine_connections")
    # The credential the connection stands on, so revoking it closes the socket
    # (core.revocation): a machine token, or a user API token (development).
    machine_token = models.ForeignKey(
        "machines.MachineToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    api_token = models.ForeignKey(ApiToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    sessions = models.JSONField(default=list)
    granted_capabilities = models.JSONField(default=list)
    limits = models.JSONField(default=dict)
    protocol_version = models.CharField(max_length=16)
    connected_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.machine} via {self.connection_id}"

    def attached_to(self, session_id: str) -> bool:
        """Whether this connection serves machine session ``session_id``."""
        return "*" in self.sessions or session_id in self.sessions


class DefaultMachine(models.Model):
    """A user's default machine (routing step 3), by ``machine_id``."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="default_machine")
    machine_id = models.CharField(max_length=64)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"default machine {self.machine_id}"


class RoutingCounter(models.Model):
    """The round-robin counter of one user's machine session, shared by every process."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    session_id = models.CharField(max_length=256)
    value = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "session_id"], name="routing_counter_unique")]

    def __str__(self) -> str:
        return f"{self.session_id}: {self.value}"


class PathRecency(models.Model):
    """Which machine last operated on a path in a session (routing step 2, recency)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    session_id = models.CharField(max_length=256)
    path = models.CharField(max_length=1024)
    machine_id = models.CharField(max_length=64)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "session_id", "path"], name="path_recency_unique")]

    def __str__(self) -> str:
        return f"{self.path} → {self.machine_id}"


class AuditRecord(models.Model):
    """One routed operation (docs/shim-protocol.md#audit): never file contents or env values; secrets redacted."""

    ts = models.DateTimeField(default=timezone.now, db_index=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="machine_audit")
    session_id = models.CharField(max_length=256)
    machine_id = models.CharField(max_length=64, blank=True)
    request_id = models.CharField(max_length=64)
    op = models.CharField(max_length=40)
    details = models.JSONField(default=dict)
    result = models.JSONField(default=dict)  # {ok, error_code, exit_code, cancelled, timed_out, duration_ms}
    caller = models.CharField(max_length=200)
    # The request_id of the copy or pipe this record is one step of ("" for an operation of
    # its own): the Machines page shows each copy and pipe as one row (docs/live-operations.md).
    operation_id = models.CharField(max_length=64, blank=True, default="", db_index=True)

    class Meta:
        ordering = ["-ts"]
        indexes = [models.Index(fields=["user", "-ts"])]

    def __str__(self) -> str:
        return f"{self.op} on {self.machine_id or '?'} ({self.outcome})"

    @property
    def outcome(self) -> str:
        """How the operation ended, as the Machines page says it: ``"running"`` (recorded
        before it was sent, no result yet), ``"cancelled"`` (a command stopped by a cancel,
        whether the shim then reported an exit code or not), ``"timed out"`` (a command its
        shim stopped at its ``timeout``), ``"exit N"`` (a command that ran and exited with
        status N other than 0), ``"ok"``, else the error code (``"failed"`` when none was
        recorded)."""
        if self.result.get("pending"):
            return "running"
        if self.result.get("cancelled") or self.result.get("error_code") == "CANCELLED":
            return "cancelled"
        if self.result.get("ok") and self.result.get("timed_out"):
            return "timed out"
        if self.result.get("ok"):
            code = self.result.get("exit_code")
            if isinstance(code, int) and not isinstance(code, bool) and code != 0:
                return f"exit {code}"
            return "ok"
        return str(self.result.get("error_code") or "failed")


class OperationInFlight(models.Model):
    """A live operation in flight: an ``EXECUTE_COMMAND`` (one machine or a fan-out), a
    cross-machine copy or a pipe (docs/live-operations.md#operations-in-flight). Written when the operation is sent,
    deleted when it is answered; FILE_* operations have none.

    ``request_id`` is the caller's id for the operation, unique per user (two users may
    pick the same one), and the id the shims see (a fan-out sends it to every machine; a
    pipe's two commands get their own). ``shim_channels`` are the consumers to send ``CANCEL`` to
    (with their negotiated ``protocol_versions``, in the order of ``machine_ids``);
    ``caller_channel`` is where an ``OperationCancelMessage`` reaches the caller ("" when
    the shims alone are enough). ``call_key`` is the ``core.tools.ToolCall.call_key`` the
    operation runs under. ``server_process`` is the caller's process: when it dies its
    rows go with it (CASCADE), and the reaper first sends ``CANCEL`` for the commands they
    still run (``operations_of_processes_cancelled``, a ``PROCESSES_GONE_HOOKS`` hook).
    """

    class Kind(models.TextChoices):
        COMMAND = "command"
        COPY = "copy"
        PIPE = "pipe"

    request_id = models.UUIDField()
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    session_id = models.CharField(max_length=256)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    op = models.CharField(max_length=40)
    machine_ids = models.JSONField(default=list)
    machine_names = models.JSONField(default=list)
    shim_channels = models.JSONField(default=list)
    protocol_versions = models.JSONField(default=list)
    caller_channel = models.CharField(max_length=200, blank=True)
    caller = models.CharField(max_length=200)
    call_key = models.CharField(max_length=300, blank=True, db_index=True)  # "" outside a tool call
    summary = models.CharField(max_length=500, blank=True)
    server_process = models.ForeignKey(ServerProcess, on_delete=models.CASCADE, related_name="+")
    started_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["user", "session_id"])]
        # A request id is the caller's name for its operation: unique per user, so another
        # user's id neither collides with one's own nor reveals that it is in flight.
        constraints = [models.UniqueConstraint(fields=["user", "request_id"], name="machines_inflight_user_request_id")]

    def __str__(self) -> str:
        return f"{self.kind} {self.request_id} ({self.summary[:60]})"


class CommandRun(models.Model):
    """One long command started through a handle (docs/live-operations.md#long-commands-handles):
    ``local_pc_command_start`` writes it, the starting process's background task keeps it
    current, and any process reads, waits on or cancels it by ``id`` (``cmd_`` + 32 hex).

    ``stdout``/``stderr`` hold the first ``OUTPUT_KEPT_BYTES`` (1 MiB) of UTF-8 of each
    stream (``stdout_bytes``/``stderr_bytes``: how many bytes are kept); past that,
    output is dropped and ``output_truncated`` set. ``request_id`` is the live operation's
    (its audit record and in-flight row); ``call_key`` (``"cmd:<id>"``) is the key its
    ``OperationInFlight`` row carries, so ``machines.services.live.cancel_calls`` stops it
    from any process. ``server_process`` is the process running the task: when it is reaped
    the link is cleared, and a running row whose process is gone or silent reads ``lost``
    (``CommandRun.lost``). Finished rows are deleted after ``COMMAND_RUN_RETENTION``.
    """

    OUTPUT_KEPT_BYTES = 1024 * 1024  # bytes of UTF-8 kept per stream

    class Status(models.TextChoices):
        RUNNING = "running"
        FINISHED = "finished"
        FAILED = "failed"
        CANCELLED = "cancelled"
        LOST = "lost"

    id = models.CharField(primary_key=True, max_length=40)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    session_id = models.CharField(max_length=256)
    machine_id = models.CharField(max_length=64)
    machine_name = models.CharField(max_length=255)
    request_id = models.UUIDField()
    summary = models.CharField(max_length=500, blank=True)  # the redacted argv or command line
    caller = models.CharField(max_length=200)
    call_key = models.CharField(max_length=300)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.RUNNING)
    stdout = models.TextField(blank=True, default="")
    stderr = models.TextField(blank=True, default="")
    stdout_bytes = models.PositiveBigIntegerField(default=0)
    stderr_bytes = models.PositiveBigIntegerField(default=0)
    output_truncated = models.BooleanField(default=False)
    exit_code = models.IntegerField(null=True, blank=True)
    timed_out = models.BooleanField(default=False)
    duration_seconds = models.FloatField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)  # {code, message} of a failed run
    server_process = models.ForeignKey(
        ServerProcess, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["user", "-started_at"])]

    def __str__(self) -> str:
        return f"{self.id} on {self.machine_name} ({self.status})"

    def lost(self, *, alive_after: datetime, current_process_id: str) -> bool:
        """Whether this run still reads ``running`` but nothing will ever finish it: its
        process row is gone (reaped or stopped: the link was cleared), stopped, or its
        heartbeat is older than ``alive_after`` (``DISPATCH_PROCESS_TTL`` ago). A run of
        ``current_process_id`` is not judged by the heartbeat (a process answering is alive);
        ``machines.services.command_runs`` asks it whether its task still follows the run."""
        if self.status != self.Status.RUNNING:
            return False
        if self.server_process_id == current_process_id:
            return False
        process = self.server_process
        return process is None or process.stopped_at is not None or process.heartbeat_at < alive_after
