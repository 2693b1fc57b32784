"""Machines: the shims on users' computers (``machines.shim``, Django-free), device login,
routing of operations across a session's machines, and their audit (docs/shim-protocol.md)."""
