"""MkDocs hook: fail the build when a public name of the four packages has no docstring.

Public means: listed in a package's ``__all__`` (recursively for public submodules), and
the public methods and properties a public class defines itself. An override of a
documented base-class method (``Model.fit`` over ``keras.Model.fit``) inherits that
documentation, as ``inspect.getdoc`` and ``help()`` show it. The API reference is made
from these docstrings, so a missing one would be a silent hole in the reference.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType

from mkdocs.exceptions import PluginError

PACKAGES = ("tarantella", "tnt_data", "tnt_comm", "tnt_cli")
# Data, not API: a version string and typing aliases carry no docstring of their own.
NOT_DOCUMENTED = {"__version__"}


def _own_doc(obj: object) -> str | None:
    if inspect.isclass(obj):
        return obj.__dict__.get("__doc__")
    if isinstance(obj, property):
        return obj.fget.__doc__ if obj.fget else None
    return getattr(obj, "__doc__", None)


def _inherited_doc(cls: type, name: str) -> str | None:
    for base in cls.__mro__[1:]:
        if name in vars(base):
            return inspect.getdoc(getattr(base, name))
    return None


def _class_members(cls: type, prefix: str) -> list[str]:
    missing = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if not (inspect.isfunction(member) or isinstance(member, property)):
            continue  # enum members, constants
        if not (_own_doc(member) or _inherited_doc(cls, name) or "").strip():
            missing.append(f"{prefix}.{name}")
    return missing


def missing_docstrings(module: ModuleType, seen: set[int] | None = None) -> list[str]:
    """Dotted names under ``module.__all__`` (recursively) that have no docstring."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return []
    seen.add(id(module))
    missing = [] if (module.__doc__ or "").strip() else [module.__name__]
    for name in getattr(module, "__all__", []):
        if name in NOT_DOCUMENTED:
            continue
        dotted = f"{module.__name__}.{name}"
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            missing += missing_docstrings(obj, seen)
            continue
        if not (_own_doc(obj) or "").strip():
            missing.append(dotted)
        if inspect.isclass(obj):
            missing += _class_members(obj, dotted)
    return missing


def on_pre_build(config) -> None:
    missing = []
    for package in PACKAGES:
        missing += missing_docstrings(importlib.import_module(package))
    if missing:
        raise PluginError(
            "public names without a docstring (the API reference is made from them): "
            + ", ".join(sorted(missing))
        )
