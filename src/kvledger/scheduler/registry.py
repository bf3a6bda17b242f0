"""Named choices: one registry per kind of policy, the single source of every choice list.

Configuration validates against a registry, the CLI builds its ``click.Choice`` from ``names()``, and a
new policy is added by registering it -- no list elsewhere has to learn its name.
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

    def register(self, name: str, value: T, help: str = "") -> T:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ConfigError(f"a {self.kind} needs a non-empty name without surrounding spaces, got {name!r}")
        if name in self._entries:
            raise ConfigError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = Entry(name, value, help)
        return value

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
