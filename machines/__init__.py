"""Machines: shims on users' computers, routing, device login and audit (to come)."""
