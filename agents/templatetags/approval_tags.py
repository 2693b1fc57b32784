"""Template helpers of the approval pages (docs/agents.md#approvals-on-the-pages).

``{% pending_approvals_count user %}``: the nav link's count; ``{{ approval.suggestions|suggested_rules }}``:
the CLI's suggested permission rules as short readable lines.
"""

from __future__ import annotations

import json
from typing import Any

from django import template

from agents.models import Approval

register = template.Library()


@register.simple_tag
def pending_approvals_count(user: Any) -> int:
    """How many approvals of ``user``'s agents on this instance are pending (one query;
    0 for an anonymous user). Those on linked instances are counted on /approvals/ only:
    a nav bar never waits on another instance."""
    if user is None or not getattr(user, "is_authenticated", False):
        return 0
    return Approval.objects.filter(agent__owner=user, status=Approval.Status.PENDING).count()


def _rule_text(rule: Any) -> str:
    if isinstance(rule, dict):
        tool = rule.get("toolName") or rule.get("tool_name") or rule.get("tool") or "?"
        content = rule.get("ruleContent") or rule.get("rule_content") or rule.get("pattern")
        return f"{tool}({content})" if content else str(tool)
    return str(rule)


@register.filter
def suggested_rules(suggestions: Any) -> list[str]:
    """The CLI's ``permission_suggestions`` (Claude Code's shape: ``[{"type": "addRules",
    "rules": [{"toolName", "ruleContent"}], "behavior", "destination"}, {"type":
    "addDirectories", "directories": [...]}, …]``) as lines such as ``allow Bash(ls:*)
    (localSettings)`` or ``add directory /srv/app (session)``; any other entry as its
    JSON text. ``[]`` for anything that is not a list."""
    if not isinstance(suggestions, list):
        return []
    lines: list[str] = []
    for entry in suggestions:
        if not isinstance(entry, dict):
            lines.append(json.dumps(entry, ensure_ascii=False)[:500])
            continue
        where = f" ({entry['destination']})" if entry.get("destination") else ""
        kind = entry.get("type")
        if kind in ("addRules", "replaceRules", "removeRules") and isinstance(entry.get("rules"), list):
            behavior = entry.get("behavior") or "allow"
            verb = "remove" if kind == "removeRules" else str(behavior)
            rules = ", ".join(_rule_text(rule) for rule in entry["rules"])
            lines.append(f"{verb} {rules}{where}")
        elif kind in ("addDirectories", "removeDirectories") and isinstance(entry.get("directories"), list):
            verb = "add" if kind == "addDirectories" else "remove"
            plural = "directories" if len(entry["directories"]) > 1 else "directory"
            lines.append(f"{verb} {plural} {', '.join(map(str, entry['directories']))}{where}")
        elif kind == "setMode" and entry.get("mode"):
            lines.append(f"switch to mode {entry['mode']}{where}")
        else:
            lines.append(json.dumps(entry, ensure_ascii=False)[:500])
    return lines


@register.filter
def pretty_json(value: Any) -> str:
    """``value`` as indented JSON (the tool's full input), non-ASCII kept."""
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        return str(value)
