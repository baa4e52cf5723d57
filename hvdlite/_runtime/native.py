"""The native extension hvdlite._core, imported in one place with a message that says how to
build it when it is missing or broken. Other modules import ``_core`` from here."""

import importlib

import torch  # noqa: F401  (the extension links against torch's libraries: load them first)

try:
    # Not `from . import _core`: that would ask the package's lazy __getattr__, which sends
    # `_core` here (Note [Lazy exports] in __init__.py).
    _core = importlib.import_module("hvdlite._core")
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "hvdlite's native extension hvdlite._core could not be imported "
        f"({exc}). Build it against the installed torch with "
        "'pip install --no-build-isolation .' (or '-e .' in a checkout), with torch installed first."
    ) from exc

__all__ = ["_core"]
