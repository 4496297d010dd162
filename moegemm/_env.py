"""moegemm's boolean environment variables, read in one place: ``env_flag``; and those that name one of a few
choices (``MOEGEMM_BACKEND``): ``env_choice``.

A value is one of ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off`` (any case, surrounding
blanks ignored); unset or empty is the variable's default; anything else raises ``ValueError`` naming the
variable (``MOEGEMM_CHECK_SPLITS=false`` is off, never on). The C++ side reads its own with the same rule
(``csrc/env_flag.h``).

This file imports nothing (``setup.py`` and ``_build.py``, loaded on their own, use it too)."""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_flag(name: str, value, default: bool) -> bool:
    """``value`` (a string, or None for unset) of the boolean environment variable ``name``."""
    if value is None or value.strip() == "":
        return default
    v = value.strip().lower()
    if v in TRUE:
        return True
    if v in FALSE:
        return False
    raise ValueError(f"environment variable {name}={value!r} is not a boolean: use one of "
                     f"{'/'.join(TRUE)} or {'/'.join(FALSE)} (any case), or leave it unset")


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name`` (``parse_flag``), ``default`` when unset or empty."""
    return parse_flag(name, os.environ.get(name), default)


def env_choice(name: str, choices: tuple):
    """The environment variable ``name`` that names one of ``choices`` (any case, surrounding blanks ignored):
    that choice, None when unset or empty; anything else raises ``ValueError`` naming the variable (a value
    misspelt is an error, never silently the default)."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    v = value.strip().lower()
    if v not in choices:
        raise ValueError(f"environment variable {name}={value!r} must be one of {', '.join(choices)}, or unset")
    return v
