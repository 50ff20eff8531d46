"""An import-only placeholder for torchvision, for the SGLang engine tests (issue 15).

SGLang 0.5.23 imports torchvision at start (a vision model's preprocessing, through its model
config registry), and no torchvision on PyPI loads on torch 2.13's CPU build. SGLang's
HiCache storage, host pool and cache controller never use it. This package answers any import
of `torchvision` or `torchvision.*` and any attribute with an inert object; calling into it does
nothing useful, so a test that reached vision code would fail, not pass by accident."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+placeholder"


class _Inert:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __getattr__(self, name: str) -> _Inert:
        return _Inert()

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


def __getattr__(name: str) -> _Inert:
    return _Inert()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.insert(0, _Finder())
