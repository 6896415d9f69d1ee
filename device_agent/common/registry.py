"""Things registered by name, from this project's own modules or another package's entry points.

A registry is filled by registration, never by a list to edit: a strategy's server class and its
client program each register under their names when their module is imported. The first lookup
imports every module of the registry's package (so a new file is found) and then every entry point
of its group (so another installed package can add strategies). A plugin that fails to import, or a
name registered twice, is an error naming both.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import threading
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """A registration that cannot stand: a name taken twice, or a plugin that does not load."""


def _origin(item: object) -> str:
    return f"{getattr(item, '__module__', '?')}.{getattr(item, '__qualname__', item)}"


class Registry(Mapping[str, T], Generic[T]):
    """``what`` by name; filled by :meth:`register`, loaded from ``package`` and entry points ``group``."""

    def __init__(self, what: str, package: str, group: str) -> None:
        self.what, self.package, self.group = what, package, group
        self._items: dict[str, T] = {}
        self._loaded = False
        self._loading = False
        # A worker's devices look up their programs from many threads at once: none may see a half-filled registry.
        self._lock = threading.RLock()

    def register(self, name: str, item: T) -> None:
        current = self._items.get(name)
        if current is not None and current is not item:
            raise RegistryError(f"{self.what} {name!r} is registered twice: by {_origin(current)} and {_origin(item)}")
        self._items[name] = item

    def unregister(self, name: str) -> None:
        self._items.pop(name, None)

    def __setitem__(self, name: str, item: T) -> None:
        """Replace what ``name`` stands for (a test's double); registering a new name goes through :meth:`register`."""
        self.load()
        self._items[name] = item

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def load(self) -> None:
        """Import the package's modules, then the entry points' (once; registering is their side effect).

        Other threads wait until it is done; a lookup made by a module being imported sees what is
        registered so far. A plugin that fails is reported once.
        """
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self._loading:
                return
            self._loading = True
            try:
                self._import_all()
            finally:
                self._loading = False
                self._loaded = True

    def _import_all(self) -> None:
        package = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__, f"{self.package}."):
            importlib.import_module(module.name)
        for entry in importlib.metadata.entry_points(group=self.group):
            try:
                entry.load()
            except Exception as exc:
                raise RegistryError(
                    f"the {self.what} plugin {entry.name!r} ({entry.value}, entry point group {self.group!r}) "
                    f"failed to load: {type(exc).__name__}: {exc}"
                ) from exc

    def reload(self) -> None:
        """Look at the entry points again (a package installed since the first lookup)."""
        with self._lock:
            self._loaded = False
            self.load()

    def __getitem__(self, name: str) -> T:
        self.load()
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        self.load()
        return iter(sorted(self._items))

    def __len__(self) -> int:
        self.load()
        return len(self._items)


__all__ = ["Registry", "RegistryError"]
