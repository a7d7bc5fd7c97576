"""Races for tests: the same call from many threads, released at once."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def at_once(count: int, call: Callable[[int], T], catch: tuple[type[BaseException], ...] = ()) -> list[T | BaseException]:
    """``call(i)`` for i in range(count), each on its own thread, all released by one barrier.

    Returns:
        Each call's result, or the exception it raised when that is one of ``catch``, in order of i.
    """
    start = threading.Barrier(count)
    outcomes: list[T | BaseException | None] = [None] * count

    def racer(i: int) -> None:
        start.wait()
        try:
            outcomes[i] = call(i)
        except catch as e:
            outcomes[i] = e

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes  # type: ignore[return-value]
