"""Agents: the data model's services, selectors and REST API (spec/agents.md)."""
