"""A store that is briefly unwell: ``memory://`` whose chosen writes fail once with a transient error.

No real store throttles on cue (moto's S3 never answers SlowDown), so this injects the
failure a real one gives now and then: ``ConnectionResetError`` while opening a file
for writing. Everything else is fsspec's real in-memory file system.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fsspec.implementations.memory import MemoryFileSystem


class FlakyMemoryFileSystem(MemoryFileSystem):
    """``memory://`` where the next write to a path containing a queued marker fails, once per marker."""

    failures: ClassVar[list[str]] = []
    injected: ClassVar[list[str]] = []

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode or "x" in mode:
            for marker in list(type(self).failures):
                if marker in path:
                    type(self).failures.remove(marker)
                    type(self).injected.append(path)
                    raise ConnectionResetError(f"connection reset by peer while writing {path} (injected)")
        return super()._open(path, mode, *args, **kwargs)
