"""Agents' models: agents, runs, events, messages, agent tokens, the supervisor lease
(docs/agents.md#the-agent-record)."""

from __future__ import annotations

import fnmatch
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

from core.models import ServerProcess  # noqa: F401


def new_agent_id() -> str:
    """``agt_`` + 12 lowercase hex; also the agent's machine session id."""
    return "agt_" + secrets.token_hex(6)


def new_run_id() -> str:
    """``run_`` + 12 lowercase hex."""
    return "run_" + secrets.token_hex(6)


class Agent(models.Model):
    """An agent Dispatch runs and tracks (docs/agents.md#the-agent-record).

    ``status`` changes only through ``agents.services.agent_set_status``, which
    enforces the transition table. ``latest_event_*`` mirror the newest event.
    """

    class Status(models.TextChoices):
        CREATING = "creating"
        RUNNING = "running"
        STOPPING = "stopping"
        STOPPED = "stopped"
        ERROR = "error"
        ARCHIVED = "archived"

    # Statuses in which the agent's token authenticates: an agent that is up (or coming up).
    TOKEN_STATUSES = frozenset({Status.CREATING, Status.RUNNING, Status.STOPPING})

    id = models.CharField(primary_key=True, max_length=16, default=new_agent_id, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="agents")
    name = models.CharField(max_length=100)
    type = models.CharField(max_length=40)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.CREATING)
    cwd = models.CharField(max_length=4096)
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children")
    launched_by = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="launched")
    launched_by_peer = models.JSONField(null=True, blank=True)
    host = models.CharField(max_length=255, blank=True)
    full_access = models.BooleanField(default=False)
    latest_event_type = models.CharField(max_length=20, blank=True)
    latest_event_message = models.TextField(blank=True)
    latest_event_at = models.DateTimeField(null=True, blank=True)
    peer = models.ForeignKey(  # set only on shadow agents (docs/peers.md#shadow-agents)
        "peers.Peer", null=True, blank=True, on_delete=models.SET_NULL, related_name="shadow_agents"
    )
    peer_agent_id = models.CharField(max_length=64, blank=True)  # "" unless a shadow agent
    stale = models.BooleanField(default=False)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    # CLI supervisor state kept in the row so a new lease holder continues (docs/agents.md#the-supervisor):
    # the activity watcher's SHA-256 of the pane's last 100 lines and when it last changed,
    # and when a stop was requested (the grace period and the 60 s limit count from it)
    # and whether the interrupt was sent.
    pane_hash = models.CharField(max_length=64, blank=True)
    pane_changed_at = models.DateTimeField(null=True, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    stop_interrupted = models.BooleanField(default=False)
    # When the CLI's own SessionStart hook reported the current session ready (None until
    # then, and again at each start): messages are pasted only into a ready CLI
    # (docs/agents.md#hooks).
    ready_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "dispatch_agent"  # its name from the `dispatch` app (docs/architecture.md)
        indexes = [models.Index(fields=["owner", "-created_at", "-id"], name="agent_owner_created")]

    def __str__(self) -> str:
        return f"{self.name} ({self.id}, {self.type}, {self.status})"

    def manages(self, other: Agent) -> bool:
        """Whether this agent, calling with its token, may stop, start, archive or cancel
        the runs of ``other``: itself, or an agent it launched (``launched_by``). The agent
        token scope (docs/agents.md#agent-tokens)."""
        return other.pk == self.pk or other.launched_by_id == self.pk


class Run(models.Model):
    """One prompt processed by an agent (docs/agents.md#the-expert-agent).

    ``input`` is ``{"instruction", "input", **options}``; ``claimed_by`` is the
    ``ServerProcess`` id of the process executing it (a plain id: the row may be reaped
    while the run still names it, which is how orphans are found).
    """

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"

    id = models.CharField(primary_key=True, max_length=16, default=new_run_id, editable=False)
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="runs")
    input = models.JSONField(default=dict)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    output = models.TextField(blank=True)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    claimed_by = models.CharField(max_length=40, blank=True)  # "" until claimed

    class Meta:
        db_table = "dispatch_run"  # its name from the `dispatch` app (docs/architecture.md)
        indexes = [
            models.Index(fields=["status", "created_at", "id"], name="run_status_created"),
            models.Index(fields=["agent", "-created_at", "-id"], name="run_agent_created"),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"


class AgentEvent(models.Model):
    """One entry of an agent's append-only timeline (docs/agents.md#the-timeline).

    ``created_at`` is when it happened (a mirrored event keeps the peer's time). Mirrored
    events are unique on ``(agent, created_at, type)`` so a replayed mirror adds nothing;
    local events are never deduplicated.
    """

    class Type(models.TextChoices):
        WORKING = "working"
        BLOCKED = "blocked"
        WAITING_USER = "waiting_user"
        DONE = "done"
        IDLE = "idle"
        SYSTEM = "system"

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="events")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    type = models.CharField(max_length=20, choices=Type.choices)
    message = models.TextField(blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    mirrored = models.BooleanField(default=False)

    class Meta:
        db_table = "dispatch_agentevent"  # its name from the `dispatch` app (docs/architecture.md)
        indexes = [models.Index(fields=["agent", "-created_at", "-id"], name="agentevent_agent_created")]
        constraints = [
            models.UniqueConstraint(
                fields=["agent", "created_at", "type"],
                condition=models.Q(mirrored=True),
                name="agentevent_mirrored_unique",
            )
        ]

    def __str__(self) -> str:
        return f"{self.type}: {self.message[:60]}"


class AgentMessage(models.Model):
    """A message to an agent, from an agent or a user (docs/agents.md#messages-and-their-status)."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        DELIVERED = "delivered"
        FAILED = "failed"
        DEAD = "dead"

    sender_agent = models.ForeignKey(
        Agent, null=True, blank=True, on_delete=models.SET_NULL, related_name="sent_messages"
    )
    sender_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="agent_messages"
    )
    recipient_agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="received_messages")
    # Cross-instance messages (docs/peers.md#the-outbox): a message from a peer names its sender
    # there (sender_peer + sender_address {instance_id, agent_id | null, name}); both sides
    # record the peer and the idempotency key.
    sender_peer = models.ForeignKey(
        "peers.Peer", null=True, blank=True, on_delete=models.SET_NULL, related_name="messages_received"
    )
    sender_address = models.JSONField(null=True, blank=True)
    peer = models.ForeignKey("peers.Peer", null=True, blank=True, on_delete=models.SET_NULL, related_name="messages")
    idempotency_key = models.CharField(max_length=100, blank=True)
    content = models.TextField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    delivered_at = models.DateTimeField(null=True, blank=True)
    # When the text was pasted into a CLI's pane. For a CLI with hooks, pasted is not yet
    # delivered: ``delivered`` waits for the CLI's UserPromptSubmit hook to carry the text
    # (docs/agents.md#hooks).
    pasted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "dispatch_agentmessage"  # its name from the `dispatch` app (docs/architecture.md)
        indexes = [models.Index(fields=["recipient_agent", "-created_at"], name="agentmessage_recipient")]

    def __str__(self) -> str:
        return f"message {self.pk} to {self.recipient_agent_id} ({self.status})"


class AgentToken(models.Model):
    """An agent's ``DISPATCH_MCP_TOKEN`` (docs/agents.md#agent-tokens).

    Minted at each start of a CLI agent, given to it in its environment only, revoked at
    stop and archive. Stored as SHA-256 plus an 8-character display prefix, like
    ``ApiToken``; it authenticates as that agent (its owner's scope, the agent as caller).
    """

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="tokens")
    prefix = models.CharField(max_length=8)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "dispatch_agenttoken"  # its name from the `dispatch` app (docs/architecture.md)

    def __str__(self) -> str:
        return f"agent token {self.prefix}… of {self.agent_id}"


class SupervisorLease(models.Model):
    """The per-host CLI supervisor lease (docs/agents.md#the-supervisor).

    One row per host; the process whose id is ``holder`` supervises that host's CLI agents
    until ``expires_at``. Claimed and renewed with conditional UPDATEs, so a ``serve`` and
    a ``dispatch_worker`` on one host never both correct the same agent.
    """

    host = models.CharField(primary_key=True, max_length=255)
    holder = models.CharField(max_length=40)
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "dispatch_supervisorlease"  # its name from the `dispatch` app (docs/architecture.md)

    def __str__(self) -> str:
        return f"supervisor lease of {self.host} held by {self.holder}"


class TrustedFolder(models.Model):
    """A folder a person trusted for CLI agents (docs/agents.md#folder-trust).

    Claude Code and codex ask before working in a folder they have not seen; Dispatch
    answers that question for them only for folders listed here (or under an admin's
    ``DISPATCH_TRUSTED_ROOTS``), so trusting one stays a person's decision: a launch in a
    new folder is refused until its owner launches there with ``trust_folder`` set.
    ``path`` is absolute and normalised (no trailing ``/``), as the CLIs key it.
    """

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="trusted_folders")
    path = models.CharField(max_length=4096)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "dispatch_trustedfolder"  # its name from the `dispatch` app (docs/architecture.md)
        constraints = [models.UniqueConstraint(fields=["owner", "path"], name="trustedfolder_owner_path")]

    def __str__(self) -> str:
        return f"{self.path} trusted by user {self.owner_id}"


def new_approval_id() -> str:
    """``apr_`` + 12 lowercase hex, like the other agents ids (docs/agents.md#approvals)."""
    return "apr_" + secrets.token_hex(6)


class Approval(models.Model):
    """One permission request of an agent's CLI and its answer (docs/agents.md#approvals).

    Created by the CLI's ``PermissionRequest`` hook (``agents.approvals.approval_request``),
    answered once — by a policy rule, a person, a supervising agent, a linked instance, or
    its timeout (``expired``, with the agent's default ``decision``) — through
    ``agents.approvals`` only. ``tool_input`` is the tool's input as the CLI sent it;
    ``tool_summary`` the one text a rule's pattern is matched on (the command, file, URL);
    ``suggestions`` the CLI's own ``permission_suggestions`` (Claude Code), passed back to it
    on "Always allow this rule". ``answered_by`` is the answerer as the timeline names it
    ("alice", "agent fixer (agt_…)", "policy rule #3", "peer lab"), kept when the answerer's
    row goes; ``timeout_decision`` the decision ``expires_at`` applies.
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        ALLOWED = "allowed"
        DENIED = "denied"
        EXPIRED = "expired"

    class Decision(models.TextChoices):
        NONE = "", "none"
        ALLOW_ONCE = "allow_once"
        ALLOW_ALWAYS = "allow_always"
        DENY = "deny"

    id = models.CharField(primary_key=True, max_length=16, default=new_approval_id, editable=False)
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="approvals")
    tool_name = models.CharField(max_length=200)
    tool_input = models.JSONField(default=dict, blank=True)
    tool_summary = models.TextField(blank=True)
    suggestions = models.JSONField(default=list, blank=True)
    hook_event = models.CharField(max_length=40, default="PermissionRequest")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    decision = models.CharField(max_length=20, choices=Decision.choices, default="", blank=True)
    message = models.TextField(blank=True)
    answered_by_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="approvals_answered"
    )
    answered_by_agent = models.ForeignKey(
        Agent, null=True, blank=True, on_delete=models.SET_NULL, related_name="approvals_answered"
    )
    answered_by_rule = models.ForeignKey(
        "ApprovalRule", null=True, blank=True, on_delete=models.SET_NULL, related_name="decided"
    )
    answered_by_peer = models.ForeignKey(
        "peers.Peer", null=True, blank=True, on_delete=models.SET_NULL, related_name="approvals_answered"
    )
    answered_by = models.CharField(max_length=300, blank=True)
    timeout_decision = models.CharField(max_length=20, choices=Decision.choices, default="deny")
    asked_at = models.DateTimeField(default=timezone.now)
    answered_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "dispatch_approval"
        indexes = [
            models.Index(fields=["agent", "-asked_at"], name="approval_agent_asked"),
            models.Index(fields=["status", "expires_at"], name="approval_status_expires"),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.tool_name} of {self.agent_id} ({self.status})"

    @property
    def allowed(self) -> bool:
        """Whether the tool may run: ``allowed``, or ``expired`` with an allowing default."""
        return self.decision in (self.Decision.ALLOW_ONCE, self.Decision.ALLOW_ALWAYS)


class ApprovalRule(models.Model):
    """A policy rule applied to an agent's permission request before a person is asked
    (docs/agents.md#approvals).

    ``agent`` null: every agent of ``owner``. ``tool``: the tool's exact name as the CLI
    names it (``Bash``, ``Read``, ``mcp__dispatch__list_agents``) or ``*``. ``pattern``: an
    ``fnmatch`` glob matched against the request's ``tool_summary`` (``""`` matches any).
    ``created_by_approval``: the approval whose "Always allow this rule" made it.
    """

    class Action(models.TextChoices):
        ALLOW = "allow"
        ASK = "ask"
        DENY = "deny"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="approval_rules")
    agent = models.ForeignKey(Agent, null=True, blank=True, on_delete=models.CASCADE, related_name="approval_rules")
    tool = models.CharField(max_length=200)
    pattern = models.CharField(max_length=1000, blank=True)
    action = models.CharField(max_length=5, choices=Action.choices)
    created_at = models.DateTimeField(default=timezone.now)
    created_by_approval = models.ForeignKey(
        Approval, null=True, blank=True, on_delete=models.SET_NULL, related_name="rules_created"
    )

    class Meta:
        db_table = "dispatch_approvalrule"
        indexes = [models.Index(fields=["owner", "agent"], name="approvalrule_owner_agent")]

    def __str__(self) -> str:
        scope = self.agent_id or "every agent"
        return f"rule #{self.pk}: {self.action} {self.tool} {self.pattern!r} ({scope})"

    def matches(self, *, tool_name: str, tool_summary: str) -> bool:
        """Whether this rule is about a request for ``tool_name`` whose summary is
        ``tool_summary``: the tool is ``*`` or that exact name, and the pattern is ``""``
        or an ``fnmatch`` glob (case-sensitive, ``*`` crosses ``/``) matching the summary."""
        if self.tool not in ("*", tool_name):
            return False
        return not self.pattern or fnmatch.fnmatchcase(tool_summary, self.pattern)
