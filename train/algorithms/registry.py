"""A name -> implementation table, so the config's choice lists and the code that runs a choice are
one list: `@REG.register("name")` beside the function, `REG.get(cfg_value)` where it is used,
`REG.names()` where the config is checked."""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named implementations of one kind (e.g. the advantage estimators), in registration order."""

    def __init__(self, kind: str, key: str) -> None:
        self.kind = kind  # what an entry is, for errors: "advantage estimator"
        self.key = key  # the config key that chooses an entry: "adv.estimator"
        self._entries: dict[str, T] = {}
        self._listed: list[str] = []  # the names the config offers; the others are aliases

    def add(self, name: str, entry: T, listed: bool = True) -> None:
        """Register `entry` under `name` (an alias the config does not offer if not `listed`); a name
        is registered once (a second one is a bug, not an override)."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        if listed:
            self._listed.append(name)

    def register(self, name: str, listed: bool = True) -> Callable[[T], T]:
        """Decorator: register the decorated object under `name` and return it unchanged."""
        def decorate(entry: T) -> T:
            self.add(name, entry, listed)
            return entry
        return decorate

    def get(self, name: str) -> T:
        """The entry registered as `name`; an unknown name raises a ValueError listing the valid ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r} ({self.key}); valid: {', '.join(self._entries)}; "
                             f"e.g. {self.key}={next(iter(self._entries), '...')}") from None

    def names(self) -> tuple[str, ...]:
        """The listed names, in registration order: the config's choices."""
        return tuple(self._listed)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
