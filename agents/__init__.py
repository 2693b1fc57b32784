"""Agents: CLI coding agents in tmux and the built-in expert agent — their models, lifecycle
services, supervisor, executor, tools, REST API and pages (docs/agents.md)."""
