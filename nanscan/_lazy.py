"""Public names loaded on first use (module __getattr__, PEP 562), for nanscan and its packages whose names need
torch: `import nanscan` and the subcommands' help must not pay for it (NOTE: [fast help] in nanscan/cli/main.py).

A package calls `lazy_names(__name__, HOMES, __all__)` with a table of public name -> the module defining it, and
keeps a TYPE_CHECKING block importing the same names for editors and type checkers.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Iterable, Mapping


def lazy_names(package: str, homes: Mapping[str, str], names: Iterable[str], *,
               functions_named_like_modules: Iterable[str] = ()) -> None:
    """Give `package` a module __getattr__ that imports each name's home on first use, and a __dir__ listing them.

    functions_named_like_modules: public functions named like the submodule that defines them (nanscan.scan):
    importing the submodule binds the module on the package under that name, which would hide the function, so
    the package refuses that binding (the module stays reachable as sys.modules["<package>.<name>"])."""
    module = sys.modules[package]
    listed = frozenset(names)

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(module, name, value)  # looked up once: later uses are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *listed})

    module.__getattr__ = __getattr__
    module.__dir__ = __dir__
    shadowed = frozenset(functions_named_like_modules)
    if shadowed:
        class Package(types.ModuleType):
            def __setattr__(self, name: str, value: Any) -> None:
                if name in shadowed and isinstance(value, types.ModuleType):
                    return
                super().__setattr__(name, value)

        module.__class__ = Package
