"""Resource slots: what is built once for an object -- a target model's drafter runners, draft models, datastores and
cost model; a tokenizer's derived tables -- and kept for that object's life.

The resources live on the object itself (in its ``__dict__``), so they go when it goes, and a new object never sees
an old one's: unlike a registry keyed by ``id(obj)`` (ids are reused once an object is freed) or a module-level weak
dictionary (one per kind of resource, each with its own lookup code). One slot per key; each key's resource is built
once even when threads ask together (the build runs under a lock of that key only, so a slow build -- loading a
drafter -- never holds up a fast lookup of another key).

A shallow copy of an object shares its slots (same weights, same resources); a deep copy starts with empty ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")

ATTRIBUTE = "_slots"  # where an object keeps its slots


class Slots:
    """key -> resource, each built on first ask and kept."""

    def __init__(self):
        self._values: dict = {}
        self._locks: dict = {}
        self._guard = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """The resource under ``key``, made by ``build()`` the first time (once, whichever threads ask); a build that
        raises leaves the slot empty."""
        try:
            return self._values[key]
        except KeyError:
            pass
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._values:
                self._values[key] = build()
            return self._values[key]

    def peek(self, key: Hashable):
        """The resource under ``key`` if one was built, else None (builds nothing)."""
        return self._values.get(key)

    def put(self, key: Hashable, value):
        """Put ``value`` under ``key`` (None: empty the slot); returns what was there (None if nothing)."""
        with self._guard:
            previous = self._values.pop(key, None)
            if value is not None:
                self._values[key] = value
        return previous

    def __deepcopy__(self, memo) -> Slots:
        return Slots()  # a deep copy is another object: it builds its own resources

    def __reduce__(self):
        return (Slots, ())  # pickled empty: locks and built resources do not travel


def slots_of(owner) -> Slots | None:
    """``owner``'s slots (made on first use); None for an object that cannot hold attributes."""
    found = getattr(owner, "__dict__", {}).get(ATTRIBUTE)
    if found is None:
        try:
            found = owner.__dict__.setdefault(ATTRIBUTE, Slots())
        except AttributeError:  # no __dict__ (slotted or built-in objects)
            return None
    return found


def shared(owner, key: Hashable, build: Callable[[], T]) -> T:
    """``owner``'s resource under ``key``, built once by ``build()`` and kept for ``owner``'s life. An object that
    cannot hold attributes gets a fresh ``build()`` on every call."""
    slots = slots_of(owner)
    return build() if slots is None else slots.get(key, build)


def set_shared(owner, key: Hashable, value):
    """Put ``value`` in ``owner``'s slot ``key`` (None: empty it); returns what was there."""
    slots = slots_of(owner)
    if slots is None:
        raise TypeError(f"a {type(owner).__name__} cannot hold resources")
    return slots.put(key, value)


class HasSlots:
    """Per-object resources as methods (:class:`~fastforward.model.TargetModel` has them)."""

    def shared(self, key: Hashable, build: Callable[[], T]) -> T:
        """The resource under ``key``, built by ``build()`` on first ask and kept for this object's life."""
        return shared(self, key, build)

    def set_shared(self, key: Hashable, value):
        """Put ``value`` under ``key`` (None: empty the slot); returns what was there."""
        return set_shared(self, key, value)
