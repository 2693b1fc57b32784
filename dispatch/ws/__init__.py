"""The ``/ws`` session edge: one consumer for remotes and agents (spec/sessions-and-remotes.md §1-§2)."""
