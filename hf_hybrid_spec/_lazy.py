"""Names of a package imported on first use (PEP 562), so that importing the package costs almost nothing."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for a package whose public names (`exports`: name -> submodule, relative) are
    imported when first read; a plain submodule name imports that submodule. `namespace`: the package's globals."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f".{module}", package), name)
            namespace[name] = value  # later lookups skip this function
            return value
        try:
            return importlib.import_module(f".{name}", package)
        except ModuleNotFoundError as err:
            if err.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
