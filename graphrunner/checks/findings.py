"""A check's finding at a source line: :func:`finding_at`."""

from __future__ import annotations

from typing import Any

from graphrunner.recording.hooks import Finding
from graphrunner.recording.ops import Where

__all__ = ["finding_at"]


def finding_at(
    kind: str, what: str, where: Where | None, fix: str, bucket: Any = None, in_library: bool = False
) -> Finding:
    """The :class:`~graphrunner.recording.hooks.Finding` ``kind`` at ``where`` (``(file, line,
    function)`` of the user's source line, or ``None`` when unknown)."""
    file, line, function = where if where is not None else (None, None, None)
    return Finding(kind, what, file, line, function, fix=fix, bucket=bucket, in_library=in_library)
