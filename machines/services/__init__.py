"""Every write of the machines app, split by concern (CONVENTIONS.md "Shape of an app").

- ``device``: RFC 8628 device login and machine tokens (machines.md §1);
"""
