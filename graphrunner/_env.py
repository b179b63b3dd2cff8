"""On/off switches read from the environment: one spelling for every ``GRAPHRUNNER_*`` flag.

``1``/``true``/``yes``/``on`` (any case, surrounding spaces ignored) mean on;
unset, empty, ``0``/``false``/``no``/``off`` mean off. Shared by the tape's
``GRAPHRUNNER_TAPE_POISON``, ``GRAPHRUNNER_DISABLE`` and ``GRAPHRUNNER_DEBUG``.
"""

from __future__ import annotations

import os

__all__ = ["TRUE", "FALSE", "env_flag"]

#: The values that turn a switch on.
TRUE = ("1", "true", "yes", "on")
#: The values that leave it off (unset reads as ``""``).
FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str, hint: str) -> bool:
    """``$name`` as a switch: ``True`` for :data:`TRUE`, ``False`` when unset or :data:`FALSE`;
    anything else raises ``ValueError("{name}={value!r} is not understood: {hint}")``, where
    ``hint`` says what to set (read at each call, so a test suite can set it once)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not understood: {hint}")
