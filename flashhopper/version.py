"""flashhopper's version: one place (pyproject.toml reads it; the kernel cache keys on it)."""

__version__ = "0.1.0"
