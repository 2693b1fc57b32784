"""Dispatch: the project package and the core app (tokens, presence, agents to come)."""
