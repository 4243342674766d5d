"""pshard's version, read from the installed package's metadata (written once, in
``pyproject.toml``)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["version"]

try:
    version = metadata.version("pshard")
except metadata.PackageNotFoundError:  # pragma: no cover - a source tree that is not installed
    version = "0+unknown"
