"""The user's source line: which stack frames are graphrunner's or torch's, and which are a library's.

One rule, used by every message that names "your line" (capture-unsafe ops,
drift, ``graphrunner check``, ``runner.compare``): a frame is *internal* when
its file is inside torch, inside the graphrunner package or a frozen module
(all other code is the user's); the user's line is the innermost frame that is
not internal. A frame is a *library* frame when its file is installed
(``site-packages`` / ``dist-packages``) or in the standard library: code the
user cannot decorate with ``@no_graph``.
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig

import torch

__all__ = ["is_internal", "is_library", "library_name", "user_frame", "where"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PKG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIRS = tuple(
    sorted(
        {
            os.path.abspath(p) + os.sep
            for p in (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib"))
            if p
        }
    )
)

_internal_cache: dict = {}


def is_internal(code) -> bool:
    """True for the code object of torch, of the graphrunner package and of
    frozen modules: never the line a user should edit. Cached per code object."""
    hit = _internal_cache.get(code)
    if hit is None:
        fn = code.co_filename
        path = os.path.abspath(fn)
        hit = fn.startswith("<frozen") or path.startswith(_TORCH_DIR) or path.startswith(_PKG_DIR)
        _internal_cache[code] = hit
    return hit


def is_library(filename: str) -> bool:
    """True when ``filename`` is installed code (under ``site-packages`` or
    ``dist-packages``) or the standard library: code the user does not edit."""
    path = os.path.abspath(filename)
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    return path.startswith(_STDLIB_DIRS)


def library_name(filename: str) -> str:
    """The top-level package of installed ``filename`` (``"transformers"``),
    or ``"the standard library"``; ``"a library"`` when neither is found."""
    parts = os.path.abspath(filename).split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            i = len(parts) - 1 - parts[::-1].index(marker)
            if i + 1 < len(parts):
                name = parts[i + 1]
                return name[:-3] if name.endswith(".py") else name
    if os.path.abspath(filename).startswith(_STDLIB_DIRS):
        return "the standard library"
    return "a library"


def user_frame(frame=None) -> tuple[str, int, str] | None:
    """``(filename, lineno, function)`` of the innermost frame at or above
    ``frame`` (default: the caller's) that is not :func:`internal
    <is_internal>`, or ``None``."""
    f = frame if frame is not None else sys._getframe(1)
    while f is not None:
        if not is_internal(f.f_code):
            return f.f_code.co_filename, f.f_lineno, f.f_code.co_name
        f = f.f_back
    return None


def where(loc: tuple[str, int, str] | None) -> str:
    """``"file:line in function: `source`"`` for a :func:`user_frame`
    result, ``"<unknown location>"`` for ``None``."""
    if loc is None:
        return "<unknown location>"
    fn, line, func = loc
    src = linecache.getline(fn, line).strip()
    return f"{fn}:{line} in {func}" + (f": `{src}`" if src else "")
