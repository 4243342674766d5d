"""Griffe extension for the docs site: pshard docstrings title their doctests ``Example:``
(Google style); griffe only reads ``Examples:`` as an examples section (rendered as code)."""

from __future__ import annotations

import re

import griffe

_TITLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(r"\1Examples:", obj.docstring.value)
