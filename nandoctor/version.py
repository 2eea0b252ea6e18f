"""The package version, in a module of its own: reports and renderers quote it without
importing the package root (whose public names reach up to the Python API)."""

__version__ = "0.1.0"
