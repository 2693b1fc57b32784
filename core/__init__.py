"""The kernel every Dispatch app uses and that imports no app (docs/architecture.md)."""
