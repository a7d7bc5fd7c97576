"""Custom model code: a bundle that carries a small Python class with ``load`` and ``predict``.

The way KServe's custom predictors, LitServe's ``LitAPI`` and MLflow's pyfunc work: code plus
artifacts plus a declared environment. The bundle holds the code under ``code/`` (role ``code``),
its files (weights as files: an ONNX graph, a ``.npz``, a JSON of vocabulary; never a pickle), and
``runtime_config``:

- ``entry``: ``"module:Class"``, the class in ``code/module.py`` (``pkg.module:Class`` for
  ``code/pkg/module.py``); other modules of the code are imported relatively (``from . import x``);
- ``requirements``: PEP 508 lines (``["scikit-learn>=1.5"]``) checked against what is installed
  at ``load``: a missing or wrong package stops the load with ``RuntimeUnavailable`` naming it.

The class (written without importing Shardline)::

    class Model:
        def load(self, context):              # once, before any predict; context: ModelContext
            self.session = context.onnx_session("inner.onnx")
        def preprocess(self, rows):           # optional: a pyarrow.Table in, the table predict reads
            ...
        def predict(self, rows):              # the signature's input columns, cast to its types
            return {"label": ..., "score": ...}
        def postprocess(self, answer, rows):  # optional: predict's answer in, the final answer out
            ...

``predict`` may answer a ``pyarrow.Table`` or ``RecordBatch``, a pandas DataFrame, or a dict of
column -> numpy array or list (a ``(rows, k)`` array for a ``fixed_size_list<T>[k]`` output). The
runtime casts it to the signature's output columns and refuses an answer that lacks one or has
another row count (``InferenceFailed``). Calls are serialised by a lock unless the class sets
``thread_safe = True``.

Trust: the code runs inside the platform's processes (batch workers, replicas) with their rights;
it is as trusted as whoever may push to the registry. A tenant may call such a model only when the
tenants file says ``custom_code: true`` for it (off by default; ``shardline.tenants``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, overload

import numpy as np
import pyarrow as pa

from shardline.bundle import Manifest
from shardline.errors import InferenceFailed, InvalidBundle, NotInstalled, RuntimeUnavailable, ShardlineError
from shardline.rows import Rows, check_rows
from shardline.runtimes.base import Answer, Runtime, RuntimeOptions, out_of_memory

CODE_DIR = "code"
_IMPORT_LOCK = threading.Lock()
# The registry's install hint for this runtime (``KNOWN_RUNTIMES``) starts every such message.
REQUIREMENTS_HINT = ("install the packages its requirements list (runtime_config 'requirements': `shardline model show "
                     "NAME:VERSION` prints them) where the model runs, on batch workers and replicas")


@dataclass
class ModelContext:
    """What a custom model's ``load(context)`` gets: its bundle's files and how to run them."""

    bundle_dir: Path
    manifest: Manifest
    options: RuntimeOptions
    artifacts: dict[str, Path] = field(default_factory=dict)

    def path(self, relative: str) -> Path:
        """The local path of one of the bundle's files (its path as the manifest lists it).

        Raises:
            InvalidBundle: the manifest lists no such file.
        """
        try:
            return self.artifacts[relative]
        except KeyError as e:
            raise InvalidBundle(
                f"{self.manifest.reference}'s code asks for file {relative!r}, which the bundle does not list "
                f"({sorted(self.artifacts)}); package it with --file {relative} (`model package --framework python`)"
            ) from e

    @property
    def threads(self) -> int:
        """Threads one call may use (the tier's choice; 0 means every core)."""
        return self.options.intra_op_threads

    def onnx_session(self, relative: str) -> Any:
        """An onnxruntime ``InferenceSession`` for one of the bundle's ONNX files, set up as the ONNX
        runtime sets up its own (the tier's threads, no spinning, CUDA when asked for and present).

        Raises:
            RuntimeUnavailable: onnxruntime is not installed.
            InvalidBundle: the file is not listed or onnxruntime cannot load it.
        """
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise NotInstalled("onnxruntime is not installed; pip install 'shardline[cpu]' (or [gpu])") from e
        path = self.path(relative)
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.options.intra_op_threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.options.spinning else "0")
        so.log_severity_level = 3
        available = ort.get_available_providers()
        wants_cuda = self.options.device in ("auto", "cuda") and "CUDAExecutionProvider" in available
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if wants_cuda else ["CPUExecutionProvider"]
        try:
            return ort.InferenceSession(str(path), sess_options=so, providers=providers)
        except Exception as e:  # onnxruntime's errors share no public base
            raise InvalidBundle(f"{self.manifest.reference}: onnxruntime could not load {relative} ({e}); "
                                "re-package the model with a valid ONNX file") from e


def check_requirements(lines: list[str], model: str) -> None:
    """Refuse requirements (PEP 508 lines) that the installed packages do not meet.

    Raises:
        InvalidBundle: a line is not a requirement.
        RuntimeUnavailable: naming each package missing or of another version, and the pip line to fix it.
    """
    from packaging.requirements import InvalidRequirement, Requirement

    unmet = []
    for line in lines:
        try:
            wanted = Requirement(line)
        except InvalidRequirement as e:
            raise InvalidBundle(f"{model}: requirement {line!r} is not a PEP 508 line ({e}); re-package the model "
                                "with requirements such as 'scikit-learn>=1.5'") from e
        if wanted.marker is not None and not wanted.marker.evaluate():
            continue
        try:
            have = metadata.version(wanted.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{line} (not installed)")
            continue
        if wanted.specifier and not wanted.specifier.contains(have, prereleases=True):
            unmet.append(f"{line} (installed: {have})")
    if unmet:
        quoted = " ".join(f"'{line.split(' (')[0]}'" for line in unmet)
        raise NotInstalled(f"{model}'s code needs {', '.join(unmet)}; pip install {quoted} where the model "
                           "runs (batch workers and replicas)")


def import_entry(code_dir: Path, entry: str, package: str, model: str) -> type:
    """Import the class ``entry`` (``module:Class``) from a bundle's code folder, as package ``package``.

    Raises:
        InvalidBundle: the entry is malformed, or the module or class is not there.
        NotInstalled: the code imports a package that is not installed.
    """
    module_name, colon, class_name = entry.partition(":")
    if not colon or not module_name or not class_name.isidentifier():
        raise InvalidBundle(f"{model}: runtime_config entry {entry!r} is not 'module:Class'; re-package the model "
                            "with --entry model:Model")
    if not (code_dir / (module_name.replace(".", "/") + ".py")).is_file():
        raise InvalidBundle(f"{model}: its code has no module {module_name!r} (no {CODE_DIR}/"
                            f"{module_name.replace('.', '/')}.py in {code_dir.parent}); re-fetch or re-package it")
    with _IMPORT_LOCK:
        root = types.ModuleType(package)
        root.__path__ = [str(code_dir)]  # a package: the code's modules import each other relatively
        sys.modules[package] = root
        try:
            module = importlib.import_module(f"{package}.{module_name}")
        except ImportError as e:
            raise NotInstalled(f"{model}'s code needs a package that is not installed ({e.name or e}); "
                               f"{REQUIREMENTS_HINT}") from e
        except Exception as e:  # noqa: BLE001 - the code's own import-time error, whatever it is
            raise InvalidBundle(f"{model}: importing its code ({module_name}) failed: {type(e).__name__}: {e}; "
                                "fix the code and package it again") from e
        finally:
            for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
                del sys.modules[name]  # each load imports afresh; the class keeps what it needs
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "predict", None)):
        raise InvalidBundle(f"{model}: {entry} is not a class with a predict(rows) method; see docs/custom-models.md")
    return cls


def answer_columns(answer: Any, model: str) -> dict[str, pa.Array]:
    """A custom model's answer as Arrow arrays by column (a ``(rows, k)`` array becomes a fixed-size list).

    Raises:
        InferenceFailed: the answer is not a table, a data frame or a dict of columns.
    """
    if isinstance(answer, pa.RecordBatch):
        return dict(zip(answer.schema.names, answer.columns))
    if isinstance(answer, pa.Table):
        return {name: answer.column(name).combine_chunks() for name in answer.column_names}
    if type(answer).__module__.split(".")[0] == "pandas":
        return answer_columns(pa.Table.from_pandas(answer, preserve_index=False), model)
    if not isinstance(answer, dict):
        raise InferenceFailed(f"{model}'s predict answered a {type(answer).__name__}; answer a pyarrow Table, a pandas "
                              "DataFrame or a dict of column -> array")
    columns = {}
    for name, values in answer.items():
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            columns[str(name)] = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
            continue
        array = np.asarray(values)
        if array.ndim == 2:
            flat = pa.array(np.ascontiguousarray(array).ravel())
            columns[str(name)] = pa.FixedSizeListArray.from_arrays(flat, array.shape[1])
        else:
            columns[str(name)] = pa.array(array if array.dtype != object else list(values))
    return columns


class CustomCodeModel(Runtime):
    """A bundle's own Python class, run behind the rows contract (see the module docstring)."""

    def __init__(self, bundle_dir: Path, manifest: Manifest, options: RuntimeOptions) -> None:
        super().__init__(bundle_dir, manifest, options)
        self._model: Any = None
        self._lock: threading.Lock | None = None
        self._pre: Any = None
        self._post: Any = None

    def load(self) -> None:
        """Check the declared requirements, import the code, and call its ``load(context)``."""
        reference = self.manifest.reference
        config = self.manifest.runtime_config
        code_dir = self.bundle_dir / CODE_DIR
        if not code_dir.is_dir():
            raise InvalidBundle(f"{reference}: the bundle at {self.bundle_dir} has no {CODE_DIR}/ folder; re-fetch "
                                "it, or package it with `shardline model package CODE --framework python`")
        check_requirements(list(config.get("requirements") or []), reference)
        package = f"_shardline_code_{self.manifest.outputs_digest[:16]}"
        cls = import_entry(code_dir, str(config.get("entry") or ""), package, reference)
        files = {a.path: self.bundle_dir / a.path for a in self.manifest.artifacts if a.role != "code"}
        model = cls()
        loader = getattr(model, "load", None)
        if callable(loader):
            try:
                loader(ModelContext(self.bundle_dir, self.manifest, self.options, files))
            except RuntimeUnavailable as e:
                if REQUIREMENTS_HINT in str(e):
                    raise
                raise e.reworded(f"{reference}: {e}; {REQUIREMENTS_HINT}") from e  # NotInstalled stays NotInstalled
            except ShardlineError:
                raise
            except ImportError as e:
                raise NotInstalled(f"{reference}'s code needs a package that is not installed ({e.name or e}); "
                                   f"{REQUIREMENTS_HINT}") from e
            except Exception as e:  # noqa: BLE001 - the code's own error, whatever it is
                raise InvalidBundle(f"{reference}: its code's load() failed ({type(e).__name__}: {e}); its files are "
                                    f"{sorted(files)}: re-fetch the bundle, or fix the code and package it again") from e
        self._pre = getattr(model, "preprocess", None)
        self._post = getattr(model, "postprocess", None)
        self._lock = None if getattr(model, "thread_safe", False) else threading.Lock()
        self._model = model

    @property
    def device(self) -> str:
        """What the class says (a ``device`` attribute of 'cpu' or 'cuda'), else 'cpu'."""
        if self._model is None:
            return "unloaded"
        device = getattr(self._model, "device", "cpu")
        return device if device in ("cpu", "cuda") else "cpu"

    @overload
    def predict(self, rows: Rows) -> Answer: ...

    @overload
    def predict(self, rows: pa.RecordBatch | pa.Table) -> pa.RecordBatch: ...

    def predict(self, rows: pa.RecordBatch | pa.Table | Rows) -> Answer:
        """Score rows with the class's ``predict`` (between its ``preprocess`` and ``postprocess``)."""
        model = self._model
        if model is None:
            raise RuntimeError("predict() before load() or after close()")
        reference = self.manifest.reference
        checked = rows if isinstance(rows, Rows) else check_rows(rows, self.manifest.signature, reference)
        table = checked.table()
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        if self._lock is None:
            answer = self._call(model, table)
        else:
            with self._lock:
                answer = self._call(model, table)
        return self._conform(answer, table.num_rows)

    def _call(self, model: Any, table: pa.Table) -> Any:
        try:
            given = self._pre(table) if self._pre is not None else table
            answer = model.predict(given)
            return self._post(answer, table) if self._post is not None else answer
        except ShardlineError:
            raise
        except Exception as e:  # noqa: BLE001 - the code's own failure: the request's rows had passed the check
            if out_of_memory(e):
                raise  # the tiers split the batch
            raise InferenceFailed(f"{self.manifest.reference}'s code failed on {table.num_rows} rows that passed its "
                                  f"signature check: {type(e).__name__}: {e}") from e

    def _conform(self, answer: Any, rows: int) -> pa.RecordBatch:
        reference = self.manifest.reference
        columns = answer_columns(answer, reference)
        arrays = []
        for spec in self.manifest.signature.outputs:
            if spec.name not in columns:
                raise InferenceFailed(f"{reference}'s predict answered columns {sorted(columns)}, without the "
                                      f"signature's output {spec.name!r}; answer every output column")
            array = columns[spec.name]
            if len(array) != rows:
                raise InferenceFailed(f"{reference}'s predict answered {len(array)} rows of {spec.name!r} for {rows} "
                                      "rows; answer one row per input row, in order")
            if array.type != spec.arrow_type:
                try:
                    array = array.cast(spec.arrow_type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise InferenceFailed(f"{reference}'s predict answered {spec.name!r} as {array.type}, which does "
                                          f"not cast to the signature's {spec.type} ({e})") from e
            arrays.append(array)
        return pa.RecordBatch.from_arrays(arrays, schema=self.manifest.signature.plan.output_schema)

    def close(self) -> None:
        """Drop the model object (and call its ``close()``, if it has one)."""
        model, self._model = self._model, None
        closer = getattr(model, "close", None)
        if callable(closer):
            closer()


__all__ = ["CODE_DIR", "CustomCodeModel", "ModelContext", "answer_columns", "check_requirements", "import_entry"]
