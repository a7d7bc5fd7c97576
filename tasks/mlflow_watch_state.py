"""What the mlflow-watch flow has seen: one small JSON file per MLflow tracking store and registered model.

``<home>/mlflow-watch/<tracking key>/<name>.json`` (``shardline.build.mlflow_watch``: the key is 16 hex digits of the
tracking URI's sha256, the name percent-encoded) holds a ``WatchState``: the versions imported or refused, the
watched aliases' last positions. Each write replaces the whole file atomically (storage/fs.py), so a reader
never sees half a state and a run that dies leaves the last good one. One run at a time writes a model's file
(the deployment's concurrency limit); a second watcher at once could import a version twice, which the
registry answers with the version it has (the same bytes: no new version, no second event).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from shardline.build.mlflow_import import shown_uri
from shardline.build.mlflow_watch import WatchState, state_file_name, tracking_key
from shardline.errors import InvalidSetting
from shardline.storage.fs import atomic_write_bytes, join, open_fs


class WatchStates:
    """The watch states under a Shardline home (any fsspec URL)."""

    def __init__(self, home: str, storage_options: dict[str, Any] | None = None) -> None:
        self.fs, self.root = open_fs(join(home, "mlflow-watch"), storage_options)

    def path(self, tracking_uri: str, mlflow_name: str) -> str:
        """Where the state of ``mlflow_name`` in the store at ``tracking_uri`` lives."""
        return join(self.root, tracking_key(tracking_uri), state_file_name(mlflow_name))

    def read(self, tracking_uri: str, mlflow_name: str) -> WatchState:
        """The state kept for a model; an empty one when the watch has not seen it.

        Raises:
            InvalidSetting: the file is there but is not a watch state (edited by hand?).
        """
        path = self.path(tracking_uri, mlflow_name)
        if not self.fs.exists(path):
            return WatchState(tracking_uri=shown_uri(tracking_uri), model=mlflow_name)
        with self.fs.open(path, "rb") as f:
            data = f.read()
        try:
            return WatchState.model_validate_json(data)
        except ValidationError as e:
            problem = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'the file'}: {err['msg']}"
                                for err in e.errors()[:3])
            raise InvalidSetting(f"the mlflow-watch state of {mlflow_name!r} at {path} cannot be read ({problem}); "
                                 "remove it to start over (its versions are then imported again: the registry keeps "
                                 "the versions it has)") from e

    def write(self, tracking_uri: str, state: WatchState) -> None:
        """Replace a model's state as a whole (atomic)."""
        folder = join(self.root, tracking_key(tracking_uri))
        atomic_write_bytes(self.fs, self.path(tracking_uri, state.model), state.model_dump_json(indent=2).encode(),
                           join(folder, "_staging"))
