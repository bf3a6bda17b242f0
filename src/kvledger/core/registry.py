"""Named choices: one registry type for every kind of choice, the single source of each choice list.

Admission, victim and eviction policies, recovery modes, growth actions, KV formats, trace formats,
attention backends and tier codecs are each one :class:`Registry`. Configuration validates against it,
the CLI builds its choices from ``names()``, and a new entry is added by registering it -- no list
elsewhere has to learn its name. One rule for re-registration: a name already registered is refused
unless the caller says ``replace=True``. A registry reads like a read-only mapping (``reg[name]``,
``get``, ``in``, ``items``), and an unknown name is one :class:`~kvledger.errors.ConfigError` naming the
choices.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Entry(Generic[T]):
    name: str
    value: T
    help: str


class Registry(Generic[T]):
    """Name -> implementation, in registration order (the first one registered is listed first)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, value: T, help: str = "", *, replace: bool = False) -> T:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ConfigError(f"a {self.kind} needs a non-empty name without surrounding spaces, got {name!r}")
        if name in self._entries and not replace:
            raise ConfigError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = Entry(name, value, help)
        return value

    def get(self, name: object, default: T | None = None) -> T | None:
        entry = self._entries.get(name) if isinstance(name, str) else None
        return default if entry is None else entry.value

    def keys(self) -> tuple[str, ...]:
        return self.names()

    def values(self) -> list[T]:
        return [e.value for e in self._entries.values()]

    def items(self) -> list[tuple[str, T]]:
        return [(n, e.value) for n, e in self._entries.items()]

    def copy(self) -> Registry[T]:
        """A registry of the same entries (a test registers into it without touching this one)."""
        other: Registry[T] = Registry(self.kind)
        other._entries = dict(self._entries)
        return other

    def __getitem__(self, name: str) -> T:
        entry = self._entries.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self._entries)}")
        return entry.value

    def check(self, name: object, what: str | None = None) -> str:
        """``name`` if it is registered, else one ConfigError naming ``what`` and the choices."""
        if not isinstance(name, str) or name not in self._entries:
            raise ConfigError(f"{what or self.kind} must be one of {', '.join(self._entries)}; got {name!r}")
        return name

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def help(self, name: str) -> str:
        self[name]
        return self._entries[name].help

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


__all__ = ["Entry", "Registry"]
