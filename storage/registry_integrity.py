"""Whether the registry still holds the bytes a version was pushed with, and the one message when it does not.

A version's artifacts are stored by content (``<name>/blobs/<sha256>``), so a blob whose bytes no longer hash to
its name was changed after `shardline model push` (by hand, by a disk or a copy gone wrong): no run of that version
can load it, and running again will not help; pushing the bundle again rewrites the blob (``ModelRegistry.push``).
`batch run` checks the registry's copy before its flow run starts (:func:`check_stored`, called by
``tasks/batch_survey.py``); the model cache says the same when a copy it fetched does not verify.

Reading every artifact on every run would cost a large model's download: a blob found intact leaves a stamp (its
size and its modification, as the file system reports them: an S3 ETag, a local mtime) in a local folder, and a
blob with the same stamp is not read again. A blob changed since has another stamp and is read again; the model
cache verifies every copy it loads whatever the stamps say.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

from shardline.bundle import Artifact, sha256_of
from shardline.errors import IntegrityError
from shardline.storage.registry import ModelRegistry, ResolvedModel


def damaged_in_registry(model: ResolvedModel, artifact: Artifact, got: str) -> IntegrityError:
    """The error for a version whose stored artifact is not the one pushed (``got``: its sha256, or 'missing')."""
    found = "is missing" if got == "missing" else f"has sha256 {got[:12]}..., its manifest says {artifact.sha256[:12]}..."
    return IntegrityError(
        f"the registry's copy of {model.pinned} is damaged: its artifact {artifact.path!r} {found} (changed after "
        f"`shardline model push`), and no run can load it; push the bundle of {model.pinned} again (`shardline "
        "model push BUNDLE_DIR` rewrites the damaged file, and the version keeps its number)",
        artifact.path, artifact.sha256, got,
    )


def stamps_dir(cache_dir: str | Path) -> Path:
    """Where :func:`check_stored` keeps its stamps: beside the model cache's bundles (a name no model can have)."""
    return Path(cache_dir) / "_registry-checked"


def _stamp(info: dict[str, Any]) -> str | None:
    """A blob's size and modification as its file system reports them, None when it reports no modification."""
    modified = info.get("ETag") or info.get("mtime") or info.get("LastModified")
    return f"{info.get('size')} {modified}" if modified else None


def check_stored(registry: ModelRegistry, model: ResolvedModel, stamps_dir: str | Path | None = None) -> None:
    """Check that the registry holds each artifact of ``model`` (a variant's model file included) as pushed: its
    sha256, unless ``stamps_dir`` holds a stamp of the blob as it is now (see the module docstring).

    Raises:
        IntegrityError: an artifact is missing or its bytes differ (:func:`damaged_in_registry`).
    """
    for artifact in model.manifest.artifacts:
        blob = registry.blob_path(model.name, artifact.sha256)
        try:
            info = registry.fs.info(blob)
        except FileNotFoundError:
            raise damaged_in_registry(model, artifact, "missing") from None
        stamp = _stamp(info)
        memo = Path(stamps_dir) / hashlib.sha256(registry.fs.unstrip_protocol(blob).encode()).hexdigest()[:32] \
            if stamps_dir is not None and stamp is not None else None
        if memo is not None and memo.is_file() and memo.read_text() == stamp:
            continue
        with registry.fs.open(blob, "rb") as f:
            got = sha256_of(f)
        if got != artifact.sha256:
            raise damaged_in_registry(model, artifact, got)
        if memo is not None and stamp is not None:
            memo.parent.mkdir(parents=True, exist_ok=True)
            staged = memo.with_name(f".{memo.name}.{uuid.uuid4().hex}")
            staged.write_text(stamp)
            os.replace(staged, memo)
