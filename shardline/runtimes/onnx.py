"""ONNX Runtime: CPU by default, CUDA when the session really got it.

``runtime_config`` of an ONNX bundle may hold:

- ``tensor_inputs``: ``[{"name": "X", "columns": ["a", "b"], "dtype": "float32"}]``,
  feeding the ONNX input ``X`` with those columns stacked side by side. Without it,
  each ONNX input is fed from the column of the same name: a primitive column feeds an
  input ``[N]`` (or ``[N, 1]``), a ``fixed_size_list<T>[k]`` column an input ``[N, k]``
  (nested lists for more dimensions); ``load`` refuses a column whose rows cannot have
  the input's shape.
- ``tensor_outputs``: ``{"onnx_output_name": "column_name"}``; without it, outputs
  keep their ONNX names. Only outputs that the signature lists are returned.
- ``text_inputs``: ``{"column": "text", "tokenizer": "tokenizer.json", "max_length": 256}``,
  tokenizing a string column with the ``tokenizers`` package (a tokenizer.json that
  the manifest lists as an artifact, so its sha256 is checked like the model's) into
  whichever of ``input_ids``, ``attention_mask`` and ``token_type_ids`` the graph
  takes, padded to the longest text of the batch and cut at ``max_length`` tokens.
  Other ONNX inputs are bound as above.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, overload

import numpy as np
import pyarrow as pa

from shardline.arrays import arrow_array, numpy_values, stack_columns
from shardline.bundle import Manifest
from shardline.errors import InvalidBundle, InvalidInput, NotInstalled, RuntimeUnavailable
from shardline.rows import FloatLayout, Rows, SignaturePlan
from shardline.runtimes.base import Answer, Runtime, RuntimeOptions
from shardline.signature import leaf_type, row_shape, tensor_type_name, type_name

log = logging.getLogger(__name__)

_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"
TOKEN_TENSORS = ("input_ids", "attention_mask", "token_type_ids")
_TEXT_KEYS = {"column", "tokenizer", "max_length"}


# Up to this many rows, one C++ call (RecordBatch.to_tensor) beats a numpy copy per
# column; past it the per-column copy is faster, as it casts while it copies (figures: bench/README.md, "Figures behind the code").
_TENSOR_ROWS = 1024

_LOCALE = re.compile(r"Failed to construct locale with name:\s*([^\s:]+)")


def locale_hint(error: BaseException) -> str | None:
    """What to do when onnxruntime cannot load a model because its text normalizer (``StringNormalizer``, which
    skl2onnx's text vectorizers use, en_US.UTF-8 by default) asks for a locale this machine lacks; None for any
    other reason."""
    found = _LOCALE.search(str(error))
    if found is None:
        return None
    return (f"its text normalizer (StringNormalizer) needs the locale {found.group(1)}, which this machine does not "
            "have: install that locale here and wherever the model runs (Debian: the locales package and "
            "locale-gen), or convert the model again with skl2onnx's option {'locale': 'C'} on its text vectorizer")


def _column_matrix(
    batch: pa.RecordBatch | pa.Table, columns: list[str], dtype: np.dtype, positions: list[int] | None = None
) -> np.ndarray:
    """Stack primitive columns into one C-ordered (rows, len(columns)) matrix.

    ``positions``: where ``columns`` sit in ``batch`` (``_ColumnPlan``), or an empty list when
    they are all of its columns in that order; None to look them up by name.
    """
    if batch.num_rows <= _TENSOR_ROWS:
        if positions is None:
            selected: pa.RecordBatch | pa.Table | None = batch.select(columns)
        else:  # selecting by name costs more than by position; the whole batch, nothing
            selected = batch.select(positions) if positions else batch
        if isinstance(selected, pa.Table):  # Table.to_tensor costs more than its batch's on a new table
            chunks = selected.to_batches()
            selected = chunks[0] if len(chunks) == 1 else pa.concat_batches(chunks) if chunks else None
        if selected is not None and selected.num_rows == batch.num_rows:
            try:
                return np.asarray(selected.to_tensor(row_major=True)).astype(dtype, copy=False)
            except (pa.ArrowException, ValueError):
                pass  # mixed or non-numeric types, or nulls: the per-column copy below casts them
    return stack_columns([numpy_values(batch.column(name)) for name in columns], batch.num_rows, dtype)


class _ColumnPlan:
    """Where each feed's columns sit in batches of one schema, worked out once per schema.

    A model is fed batches of few schemas (the online tier builds every request's rows with
    the signature's schema; a batch job reads shards of one layout), so the last few are kept.
    """

    _KEEP = 8

    def __init__(self) -> None:
        self._plans: list[tuple[pa.Schema, list[list[int] | None]]] = []

    def positions(self, schema: pa.Schema, feeds: list[dict[str, Any]]) -> list[list[int] | None]:
        """Per feed: the column positions (``[]``: the whole schema in order), or None (look up by name)."""
        plans = self._plans  # read once: another thread may replace it
        for known, found in plans:
            if known is schema or known.equals(schema):
                return found
        names = schema.names
        found = []
        for feed in feeds:
            columns = feed["columns"]
            if not columns or len(set(names)) != len(names) or not set(columns) <= set(names):
                found.append(None)  # missing or duplicated columns: the by-name path says what is wrong
            elif columns == names:
                found.append([])
            else:
                found.append([names.index(c) for c in columns])
        self._plans = [(schema, found), *plans[: self._KEEP - 1]]
        return found


def column_tensor(column: pa.Array | pa.ChunkedArray, dtype: np.dtype, rank: int | None) -> np.ndarray:
    """One column as the tensor an ONNX input of ``rank`` dimensions takes: ``fixed_size_list<T>[k]``
    (nested for more dimensions) becomes ``(rows, k, ...)``, ``list<T>`` ``(rows, k)`` when every row holds
    k values, strings an object array, and a primitive column ``(rows,)`` (``(rows, 1)`` for rank 2)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        dims = [len(column)]
        values: pa.Array = column
        while pa.types.is_fixed_size_list(values.type):
            dims.append(values.type.list_size)
            values = values.flatten()
        if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
            flat = numpy_values(values)
            return flat.astype(dtype, copy=False).reshape(dims)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        return np.asarray(column.to_pylist(), dtype=dtype)
    values = numpy_values(column)
    if dtype != np.dtype(object):
        values = values.astype(dtype, copy=False)
    return values.reshape(-1, 1) if rank == 2 else values


def _to_arrow(values: Any, dtype: pa.DataType) -> pa.Array:
    """A model output (ndarray) as an Arrow array of the signature's type."""
    values = np.asarray(values)
    if values.ndim == 1:
        return _cast(arrow_array(values), dtype)
    if values.ndim == 2 and pa.types.is_fixed_size_list(dtype):
        flat = _cast(arrow_array(values.ravel()), dtype.value_type)
        return pa.FixedSizeListArray.from_arrays(flat, values.shape[1])
    if values.ndim == 2 and values.shape[1] == 1:
        return _cast(arrow_array(values[:, 0]), dtype)
    return pa.array(list(values)).cast(dtype)


def _cast(array: pa.Array, dtype: pa.DataType) -> pa.Array:
    """``array.cast(dtype)``, skipped when the type is already right (a cast call costs microseconds per output)."""
    return array if array.type == dtype else array.cast(dtype)


def _is_text(dtype: pa.DataType) -> bool:
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype)


class TextBinding:
    """A string column turned into token tensors by a ``tokenizers`` tokenizer.

    Made by ``from_manifest`` (which checks the ``text_inputs`` setting and loads the
    tokenizer); ``bind`` then picks the token tensors the ONNX graph takes. ``encode``
    is safe to call from several threads at once.
    """

    def __init__(self, column: str, tokenizer: Any, model: str) -> None:
        self.column = column
        self.model = model
        self._tokenizer = tokenizer
        self.tensors: dict[str, np.dtype] = {name: np.dtype(np.int64) for name in TOKEN_TENSORS}

    @classmethod
    def from_manifest(cls, bundle_dir: Path, manifest: Manifest) -> "TextBinding":
        """Check ``runtime_config["text_inputs"]`` and load its tokenizer.

        Raises:
            InvalidBundle: the setting is malformed or names a file the manifest does not list.
            RuntimeUnavailable: the ``tokenizers`` package is not installed.
        """
        config = manifest.runtime_config["text_inputs"]
        where = f"{manifest.reference}: runtime_config text_inputs"
        if not isinstance(config, dict) or set(config) != _TEXT_KEYS:
            raise InvalidBundle(
                f"{where} is {config!r}; write it as {{\"column\": \"text\", \"tokenizer\": "
                f"\"tokenizer.json\", \"max_length\": 256}} (exactly the keys {sorted(_TEXT_KEYS)})"
            )
        column, path, max_length = config["column"], config["tokenizer"], config["max_length"]
        if column not in manifest.signature.input_names:
            raise InvalidBundle(
                f"{where} reads column {column!r}, which is not among the signature's inputs "
                f"{manifest.signature.input_names}; make them agree"
            )
        if path not in {a.path for a in manifest.artifacts}:
            raise InvalidBundle(
                f"{where} names tokenizer {path!r}, which is not an artifact of the bundle "
                "(only listed, sha256-checked files are loaded); add it to the manifest's artifacts"
            )
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise InvalidBundle(f"{where}: max_length is {max_length!r}; it must be a positive whole number")
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise NotInstalled(
                f"{manifest.reference} reads text and needs the 'tokenizers' package; "
                "pip install 'shardline[embedding]'"
            ) from e
        try:
            tokenizer = Tokenizer.from_file(str(bundle_dir / path))
        except Exception as e:  # tokenizers raises plain Exception for a bad file
            raise InvalidBundle(f"{where}: {path!r} is not a tokenizer.json the tokenizers package reads ({e})") from e
        padding = tokenizer.padding or {}
        tokenizer.enable_truncation(max_length=max_length)
        tokenizer.enable_padding(  # to the longest text of each batch, with the file's pad token
            direction=padding.get("direction", "right"),
            pad_id=padding.get("pad_id", 0),
            pad_type_id=padding.get("pad_type_id", 0),
            pad_token=padding.get("pad_token", "[PAD]"),
        )
        return cls(column, tokenizer, manifest.reference)

    def bind(self, onnx_inputs: dict[str, Any]) -> None:
        """Keep the token tensors the graph takes, in the graph's integer types."""
        if "input_ids" not in onnx_inputs:
            raise InvalidBundle(
                f"{self.model}: runtime_config text_inputs feeds 'input_ids', but the ONNX graph "
                f"takes {sorted(onnx_inputs)}; export the model with an input named input_ids"
            )
        self.tensors = {
            name: np.dtype(_numpy_type(onnx_inputs[name].type)) for name in TOKEN_TENSORS if name in onnx_inputs
        }

    def texts(self, batch: pa.RecordBatch | pa.Table) -> list[str]:
        """The column's strings; InvalidInput when it is missing, not strings, or has nulls."""
        if batch.schema.get_field_index(self.column) < 0:
            raise InvalidInput(
                f"column {self.column!r} is missing; the model {self.model!r} embeds the text in it"
            )
        column = batch.column(self.column)
        if not _is_text(column.type):
            raise InvalidInput(
                f"column {self.column!r} is {column.type}, the model {self.model!r} expects strings; "
                "cast it to string before scoring"
            )
        if column.null_count:
            raise InvalidInput(
                f"column {self.column!r} holds {column.null_count} null rows of {len(column)}; the "
                f"model {self.model!r} needs a string in every row: fill or drop those rows"
            )
        return column.to_pylist()

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        """Token tensors (rows, longest text's tokens) for the graph's token inputs."""
        encodings = self._tokenizer.encode_batch(texts)
        fields = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
        return {
            name: np.array([getattr(e, fields[name]) for e in encodings], dtype=dtype)
            for name, dtype in self.tensors.items()
        }


class OnnxModel(Runtime):
    """An ONNX model run by onnxruntime."""

    def __init__(self, bundle_dir: Path, manifest: Manifest, options: RuntimeOptions) -> None:
        super().__init__(bundle_dir, manifest, options)
        self._session: Any = None
        self._feeds: list[dict[str, Any]] = []
        self._outputs: list[tuple[str, str, pa.DataType]] = []
        self._text: TextBinding | None = None
        self._plan = _ColumnPlan()
        self._output_schema = pa.schema([])
        self._output_names: list[str] = []
        self._arrays: _ArrayPlan | None = None
        self.fell_back_to_cpu = False  # CUDA chosen ('auto'), the session on the CPU: logged as an error, counted

    def _providers(self, ort: Any) -> list[str]:
        available = ort.get_available_providers()
        wants_cuda = self.options.device in ("auto", "cuda") and "cuda" in self.manifest.hardware.devices
        if self.options.device == "cuda" and _CUDA not in available:
            raise RuntimeUnavailable(
                f"device 'cuda' was asked for {self.manifest.reference}, but this onnxruntime "
                f"offers only {available}; install 'shardline[gpu]' on a machine with a GPU, "
                "or set SHARDLINE_RUNTIME_DEVICE=cpu"
            )
        return [_CUDA, _CPU] if wants_cuda and _CUDA in available else [_CPU]

    def load(self) -> None:
        """Create the inference session and bind columns to tensors."""
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise NotInstalled(
                "onnxruntime is not installed; pip install 'shardline[cpu]' (or [gpu])"
            ) from e
        model_files = [a.path for a in self.manifest.artifacts if a.path.endswith(".onnx")]
        if len(model_files) != 1:
            raise InvalidBundle(
                f"an ONNX bundle holds exactly one .onnx artifact; {self.manifest.reference} "
                f"lists {model_files}"
            )
        if "text_inputs" in self.manifest.runtime_config:
            self._text = TextBinding.from_manifest(self.bundle_dir, self.manifest)
        so = ort.SessionOptions()
        threads = self.options.intra_op_threads or (os.cpu_count() or 1)
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.options.spinning else "0")
        so.log_severity_level = 3
        providers = self._providers(ort)
        try:
            self._session = ort.InferenceSession(str(self.bundle_dir / model_files[0]), sess_options=so,
                                                 providers=providers)
        except Exception as e:  # onnxruntime's own errors (NoSuchFile, InvalidProtobuf, Fail) share no public base
            hint = locale_hint(e)
            raise InvalidBundle(
                f"{self.manifest.reference}: onnxruntime could not load {model_files[0]} from {self.bundle_dir}: {hint}"
                if hint is not None else
                f"{self.manifest.reference}: onnxruntime could not load {model_files[0]} from {self.bundle_dir} "
                f"({e}); check that the file is there and is an ONNX model, or re-package it with `shardline model package`"
            ) from e
        if self.options.device == "cuda" and self.device != "cuda":
            raise RuntimeUnavailable(
                f"{self.manifest.reference} asked for CUDA but the session got "
                f"{self._session.get_providers()}; check the CUDA and cuDNN libraries "
                "(pip install 'onnxruntime-gpu[cuda,cudnn]')"
            )
        if _CUDA in providers and self.device != "cuda":  # 'auto' chose CUDA and onnxruntime quietly fell back
            self.fell_back_to_cpu = True
            log.error("%s: CUDA was offered and chosen, but onnxruntime runs it on %s: the model is scored on the "
                      "CPU; check the CUDA and cuDNN libraries (pip install 'onnxruntime-gpu[cuda,cudnn]'), or set "
                      "SHARDLINE_RUNTIME_DEVICE=cpu to mean it", self.manifest.reference, self._session.get_providers())
        self._bind()

    def _bind(self) -> None:
        config = self.manifest.runtime_config
        onnx_inputs = {i.name: i for i in self._session.get_inputs()}
        if self._text is not None:
            self._text.bind(onnx_inputs)
        tokens = self._text.tensors if self._text is not None else {}
        bindings = config.get("tensor_inputs") or [{"name": n} for n in onnx_inputs if n not in tokens]
        self._feeds = []
        for binding in bindings:
            name = binding["name"]
            if name not in onnx_inputs:
                raise InvalidBundle(
                    f"{self.manifest.reference}: runtime_config binds ONNX input {name!r}, "
                    f"the model's inputs are {sorted(onnx_inputs)}"
                )
            info = onnx_inputs[name]
            if not binding.get("columns"):
                self._check_named_feed(info)
            dtype = np.dtype(binding.get("dtype") or _numpy_type(info.type))
            self._feeds.append(
                {"name": name, "columns": binding.get("columns"), "dtype": dtype, "rank": len(info.shape)}
            )
        rename = config.get("tensor_outputs", {})
        wanted = {c.name: c.arrow_type for c in self.manifest.signature.outputs}
        self._outputs = []
        for output in self._session.get_outputs():
            column = rename.get(output.name, output.name)
            if column in wanted:
                self._outputs.append((output.name, column, wanted[column]))
        self._output_schema = pa.schema([pa.field(c, t) for _, c, t in self._outputs])  # as from_arrays(names=) makes it
        missing = set(wanted) - {c for _, c, _ in self._outputs}
        if missing:
            raise InvalidBundle(
                f"{self.manifest.reference}: the signature lists outputs {sorted(missing)} that "
                f"the ONNX graph does not produce ({[o.name for o in self._session.get_outputs()]})"
            )
        self._output_names = [o for o, _, _ in self._outputs]
        self._arrays = _ArrayPlan.of(self.manifest, self._feeds, self._outputs, self._session.get_outputs(),
                                     self._text is None)

    def _check_named_feed(self, info: Any) -> None:
        """Refuse, at load, an ONNX input fed from the column of its name whose rows cannot have the tensor's shape."""
        specs = {c.name: c for c in self.manifest.signature.inputs}
        spec = specs.get(info.name)
        if spec is None:
            raise InvalidBundle(
                f"{self.manifest.reference}: the ONNX graph takes input {info.name!r}, which is not a signature "
                f"input ({sorted(specs)}); name a signature column after it, or bind it in runtime_config tensor_inputs"
            )
        shape = list(info.shape or [])
        if not shape:
            return  # the graph does not say its rank
        row = row_shape(spec.arrow_type)
        inner = shape[1:]
        if not row:
            fits = len(inner) == 0 or (len(inner) == 1 and (not isinstance(inner[0], int) or inner[0] == 1))
        else:
            fits = len(inner) == len(row) and all(
                not isinstance(d, int) or d < 0 or r < 0 or d == r for d, r in zip(inner, row))
        if not fits:
            want = tensor_type_name(spec.type if not row else type_name(leaf_type(spec.arrow_type)),
                                    [d if isinstance(d, int) else -1 for d in inner])
            raise InvalidBundle(
                f"{self.manifest.reference}: ONNX input {info.name!r} has shape {shape}, but the signature's column "
                f"{spec.name!r} is {spec.type}, whose rows are not of shape {inner}; declare it as {want} "
                "(`shardline model package` does)"
            )

    @property
    def device(self) -> str:
        """'cuda' only when the session really runs on the CUDA provider."""
        if self._session is None:
            return "unloaded"
        return "cuda" if _CUDA in self._session.get_providers() else "cpu"

    @overload
    def predict(self, rows: Rows) -> Answer: ...

    @overload
    def predict(self, rows: pa.RecordBatch | pa.Table) -> pa.RecordBatch: ...

    def predict(self, rows: pa.RecordBatch | pa.Table | Rows) -> Answer:
        """Score rows; returns the signature's output columns (see ``Runtime``).

        Float ``Rows`` (``Rows.arrays``) of this signature's layout feed the session straight from
        numpy and answer numpy columns, a third of the Arrow path's overhead for a row (figures: bench/README.md, "Figures behind the code"). Everything else goes through Arrow.
        """
        if self._session is None:
            raise RuntimeError("predict() before load()")
        if isinstance(rows, Rows):
            plan, arrays = self._arrays, rows.arrays
            if (plan is not None and arrays is not None and arrays[0].shape[0]
                    and (rows.plan is plan.source or rows.plan.layout == plan.layout)):
                return plan.predict(self._session, self._output_names, arrays, self._outputs, self._output_schema)
            return self._predict_arrow(rows.table())
        return self._predict_arrow(rows)

    def _predict_arrow(self, batch: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
        feed = {}
        if self._text is not None:
            if batch.num_rows == 0:  # a graph may not take a (0, 0) token tensor
                return pa.RecordBatch.from_arrays(
                    [pa.array([], type=t) for _, _, t in self._outputs], names=[c for _, c, _ in self._outputs]
                )
            feed.update(self._text.encode(self._text.texts(batch)))
        feeds = self._feeds
        try:
            positions = self._plan.positions(batch.schema, feeds)
            for binding, at in zip(feeds, positions):
                if binding["columns"]:
                    feed[binding["name"]] = _column_matrix(batch, binding["columns"], binding["dtype"], at)
                else:
                    feed[binding["name"]] = column_tensor(
                        batch.column(binding["name"]), binding["dtype"], binding["rank"]
                    )
        except (KeyError, TypeError, ValueError, pa.ArrowException) as e:
            raise InvalidInput(
                f"rows for {self.manifest.reference} could not be turned into tensors: {e}; "
                "check them against the model's signature (`shardline model list`)"
            ) from e
        results = self._session.run(self._output_names, feed)
        arrays = [_to_arrow(values, dtype) for values, (_, _, dtype) in zip(results, self._outputs)]
        return pa.RecordBatch.from_arrays(arrays, schema=self._output_schema)

    def close(self) -> None:
        """Drop the session (and the tokenizer)."""
        self._session = None
        self._text = None


Feed = Callable[[tuple[np.ndarray, ...]], np.ndarray]  # one ONNX input's tensor from float arrays


class _ArrayPlan:
    """How ``predict`` feeds a model from float ``Rows.arrays``: each ONNX input's tensor taken from the
    arrays with numpy alone (worked out at load), and each output's numpy form."""

    def __init__(self, source: SignaturePlan, feeds: list[tuple[str, Feed]],
                 outputs: list[tuple[str, np.dtype, int | None]]) -> None:
        self.source = source
        self.layout = source.layout
        self.feeds = feeds
        self.outputs = outputs  # (column, numpy dtype, list size or None), in the order of the session's outputs

    def predict(self, session: Any, names: list[str], arrays: tuple[np.ndarray, ...],
                outputs: list[tuple[str, str, pa.DataType]], schema: pa.Schema) -> Answer:
        """Run the session on the arrays; numpy columns, or the record batch where an output does not fit."""
        results = session.run(names, {name: make(arrays) for name, make in self.feeds})
        out: dict[str, np.ndarray] = {}
        for values, (column, dtype, width) in zip(results, self.outputs):
            if width is None and values.ndim == 2 and values.shape[1] == 1:
                values = values[:, 0]
            if values.dtype != dtype or values.ndim != (1 if width is None else 2) or (
                    width is not None and values.shape[1] != width):
                converted = [_to_arrow(v, t) for v, (_, _, t) in zip(results, outputs)]
                return pa.RecordBatch.from_arrays(converted, schema=schema)  # what the Arrow path gives
            out[column] = values
        return out

    @classmethod
    def of(cls, manifest: Manifest, feeds: list[dict[str, Any]], outputs: list[tuple[str, str, pa.DataType]],
           graph_outputs: list[Any], no_text: bool) -> "_ArrayPlan | None":
        """The plan, or None when the signature has no float layout or an input cannot be fed from it."""
        source = manifest.signature.plan
        layout = source.layout
        if layout is None or not no_text:
            return None
        made = []
        for binding in feeds:
            make = _array_feed(source, layout, binding)
            if make is None:
                return None
            made.append((binding["name"], make))
        onnx_types = {o.name: o.type for o in graph_outputs}
        planned: list[tuple[str, np.dtype, int | None]] = []
        for onnx_name, column, arrow_type in outputs:
            value_type = arrow_type.value_type if pa.types.is_fixed_size_list(arrow_type) else arrow_type
            if not (pa.types.is_integer(value_type) or pa.types.is_floating(value_type)):
                return None
            dtype = np.dtype(value_type.to_pandas_dtype())
            if np.dtype(_numpy_type(onnx_types[onnx_name])) != dtype or onnx_types[onnx_name] not in _ONNX_NUMPY:
                return None
            planned.append((column, dtype, arrow_type.list_size if pa.types.is_fixed_size_list(arrow_type) else None))
        return cls(source, made, planned)


def _array_feed(source: SignaturePlan, layout: FloatLayout, binding: dict[str, Any]) -> Feed | None:
    """One ONNX input's tensor from the float arrays, or None when the layout cannot give it without Arrow."""
    dtype, rank, positions = binding["dtype"], binding["rank"], source.positions
    columns = binding["columns"]
    if columns:  # several columns stacked side by side (runtime_config tensor_inputs)
        if not set(columns) <= set(positions):
            return None
        at = [positions[c] for c in columns]
        if layout.stacked:
            if at == list(range(len(positions))):
                return lambda arrays: np.ascontiguousarray(arrays[0], dtype=dtype)
            return lambda arrays: np.ascontiguousarray(arrays[0][:, at], dtype=dtype)
        if any(layout.widths[i] for i in at):
            return None  # list columns side by side: the Arrow path's business
        return lambda arrays: np.column_stack([arrays[i] for i in at]).astype(dtype, copy=False)
    j = positions.get(binding["name"])
    if j is None:
        return None
    if layout.stacked:
        if rank == 2:
            return lambda arrays: np.ascontiguousarray(arrays[0][:, j:j + 1], dtype=dtype)
        return lambda arrays: np.ascontiguousarray(arrays[0][:, j], dtype=dtype)
    if layout.widths[j] == 0 and rank == 2:
        return lambda arrays: np.ascontiguousarray(arrays[j], dtype=dtype).reshape(-1, 1)
    return lambda arrays: np.ascontiguousarray(arrays[j], dtype=dtype)


_ONNX_NUMPY = {
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(bool)": "bool",
    "tensor(string)": "object",
}


def _numpy_type(onnx_type: str) -> str:
    return _ONNX_NUMPY.get(onnx_type, "float32")
