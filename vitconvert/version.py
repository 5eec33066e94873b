"""vitconvert's version, its one home (pyproject reads it; the package, folders and the CLI print it)."""

__version__ = "0.1.0"
