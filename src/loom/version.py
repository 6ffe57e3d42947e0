"""loom's version, in a module of its own: what reports it (the server's /version, `loom
--version`) reads it here, not through the `loom` package that re-exports it."""

__version__ = "0.1.0"
