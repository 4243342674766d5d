"""Moved: :func:`split` lives in :mod:`pshard._microbatch.split`, :func:`merge` in
:mod:`pshard._microbatch.merge`. Re-exported here until ``pshard/__init__.py`` imports them from
there; nothing else imports this module.
"""

from __future__ import annotations

from .merge import merge as merge
from .split import split as split

__all__ = ["merge", "split"]
