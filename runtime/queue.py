"""The global task queue (Algorithm 1, line 2): in place of the paper's Michael and Scott queue, a deque,
whose ``append`` and ``popleft`` are atomic under the GIL. Waiting for work is the engine's business.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Iterable, TypeVar

T = TypeVar("T")


class TaskQueue(Generic[T]):
    """A FIFO that never blocks: ``get`` returns None when empty."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[T] = deque()

    def put(self, item: T) -> None:
        self._items.append(item)

    def put_front(self, item: T) -> None:
        """Put ``item`` first (re-queued work that others may depend on)."""
        self._items.appendleft(item)

    def put_many(self, items: Iterable[T]) -> None:
        self._items.extend(items)

    def peek(self) -> T | None:
        """The head item without taking it (another thread may take it first); None when empty."""
        try:
            return self._items[0]
        except IndexError:
            return None

    def get(self) -> T | None:
        try:
            return self._items.popleft()
        except IndexError:
            return None

    def remove_if(self, pred) -> list[T]:
        """Take out every item matching ``pred`` (a failed call's tasks), keeping the others' order."""
        kept, taken = [], []
        while (item := self.get()) is not None:
            (taken if pred(item) else kept).append(item)
        # Anything put meanwhile went to the back; put the survivors in front of it.
        self._items.extendleft(reversed(kept))
        return taken

    def __len__(self) -> int:
        return len(self._items)
