"""Whether a scikit-learn model's ONNX conversion answers as scikit-learn does (``packaging.package_sklearn``
given a sample, and so every scikit-learn model ``shardline model import`` brings in from MLflow).

scikit-learn computes in float64 on the rows as given; a bundle fed float32 features sees them rounded to
about 7 significant digits. For most features that changes nothing, but a column large next to its spread
(a Unix timestamp: 1.7e9 + a few seconds) loses what the model reads, and a float32 model then answers
otherwise on rows scikit-learn gets right. So:

- the builder converts with float32 inputs first and checks that bundle (below); where its answers differ, it
  converts with float64 inputs, and ``float32_loss`` says whether rounding the sample's first ``CHECK_ROWS``
  rows to float32 changes scikit-learn's own answers (beyond the tolerance), naming the column that loses the
  most, for the refusal where float64 does not convert or run. It is not asked first: skl2onnx rounds a tree's
  thresholds so that float32 features split as the rows as given do (HistGradientBoosting's answers on
  rounded rows move, its float32 bundle's do not);
- ``check_sklearn`` scores those rows with the bundle as both tiers load it and compares every output with
  scikit-learn's answers on the rows as given (``frameworks._check``: within ``ATOL + RTOL * |expected|``,
  labels equal but at ties).

A feature the sample holds as text (``text_features``: a pipeline's categories) is given to scikit-learn as it is,
in a DataFrame of the features (``given_rows``: a ``ColumnTransformer`` selects columns by name); only the numbers
are rounded.

``float32_loss`` is asked of LightGBM's models too (``lightgbm_check``): their ONNX trees take float32 features
only, so there float32's loss is refused naming the column.

A classifier without ``predict_proba`` (``LinearSVC``, ``RidgeClassifier``, ``SVC`` without ``probability=True``,
``SGDClassifier`` with the hinge loss, ``Perceptron``) answers ``label`` and ``scores``, scikit-learn's
``decision_function``: ``conversion_options`` converts it without the ZipMap its converter may not take, and
``decision_scores`` turns skl2onnx's score tensor into that layout (its binary layout differs between converters:
``[N, 1]``, or two columns, the decision in either one), found by running the conversion; where none matches,
the bundle answers ``label`` only.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from shardline.build.frameworks import ATOL, CHECK_ROWS, RTOL, _check, _features, _matrix, _tie_rows
from shardline.bundle import Manifest
from shardline.errors import InvalidInput
from shardline.signature import is_compatible


def sklearn_answers(estimator: Any, rows: np.ndarray) -> dict[str, np.ndarray]:
    """scikit-learn's answers on ``rows`` under the bundle's output names: ``label`` and ``probabilities`` for a
    classifier, ``label`` and ``scores`` (``decision_function``) for one without ``predict_proba``, ``prediction``
    for a regressor."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "X does not have valid feature names": fitted on a DataFrame
        if not hasattr(estimator, "classes_"):
            return {"prediction": np.asarray(estimator.predict(rows))}
        answers = {"label": np.asarray(estimator.predict(rows))}
        if hasattr(estimator, "predict_proba"):
            answers["probabilities"] = np.asarray(estimator.predict_proba(rows))
        elif hasattr(estimator, "decision_function"):
            answers["scores"] = np.asarray(estimator.decision_function(rows))
        return answers


def conversion_options(estimator: Any) -> dict[Any, dict[str, Any]]:
    """skl2onnx's options for ``estimator``: a classifier's probabilities as a tensor (no ZipMap); for a classifier
    without ``predict_proba``, set on its last step, where its converter takes a ZipMap at all (skl2onnx would
    otherwise give the option to every classifier in a pipeline, and ``LinearSVC``'s converter refuses it). Every
    text vectorizer's normalizer in the C locale: skl2onnx's default, en_US.UTF-8, is missing from many machines
    and images a bundle runs on (onnxruntime then cannot load it). skl2onnx's vectorizers read ASCII words as
    scikit-learn does, in any locale, and others not (a word with an accent): the check against scikit-learn on
    the sample refuses a model those change."""
    from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer

    options: dict[Any, dict[str, Any]] = {kind: {"locale": "C"} for kind in (CountVectorizer, TfidfVectorizer)}
    if hasattr(estimator, "classes_"):  # (by id: this estimator; the vectorizers by type: a ColumnTransformer's copies)
        if hasattr(estimator, "predict_proba"):
            options[id(estimator)] = {"zipmap": False}
        else:
            last = estimator
            while hasattr(last, "steps"):  # a Pipeline, maybe nested
                last = last.steps[-1][1]
            options[id(last)] = {"zipmap": False} if _takes_zipmap(last) else {}
    return options


def _takes_zipmap(classifier: Any) -> bool:
    try:
        from skl2onnx._supported_operators import sklearn_operator_name_map
        from skl2onnx.common._registration import get_converter

        allowed = get_converter(sklearn_operator_name_map[type(classifier)]).get_allowed_options()
    except Exception:  # noqa: BLE001 - skl2onnx's registry moved, or no converter: the conversion says why
        return True
    return "zipmap" in (allowed or {})


def decision_scores(onx: Any, estimator: Any, feeds: dict[str, np.ndarray], given: Any) -> str | None:
    """Make the converted classifier's second output (skl2onnx's scores, for one without ``predict_proba``) the
    graph's output ``scores``, laid out as ``decision_function`` (one value a row for two classes, one per class
    for more), finding the layout by running the graph on probe rows (``feeds``; ``given``, the same rows as
    scikit-learn is given them); returns its signature type. Where no layout matches, the output is taken out of
    the graph and None is returned (the bundle answers labels only)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    output = onx.graph.output[1].name
    options = ort.SessionOptions()
    options.log_severity_level = 3  # RidgeClassifier's converter declares [N, 2] and answers [N, 1]: not a warning
    session = ort.InferenceSession(onx.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"])
    got = np.asarray(session.run([output], feeds)[0], dtype=np.float64)
    del onx.graph.output[1]
    if not hasattr(estimator, "decision_function"):
        return None
    want = sklearn_answers(estimator, given)["scores"]
    got = got.reshape(len(got), -1)
    if want.ndim == 1:
        column = next((j for j in range(got.shape[1]) if _close(got[:, j], want)), None)
        if column is None:
            return None
        index = numpy_helper.from_array(np.array(column, dtype=np.int64), name="scores_column")
        onx.graph.initializer.append(index)
        onx.graph.node.append(helper.make_node("Gather", [output, index.name], ["scores"], axis=1,
                                               name="scores_decision"))
        onx.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N"]))
        return "float32"
    if got.shape != want.shape or not _close(got, want):
        return None
    onx.graph.node.append(helper.make_node("Identity", [output], ["scores"], name="scores_decision"))
    onx.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", want.shape[1]]))
    return f"fixed_size_list<float32>[{want.shape[1]}]"


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return bool((np.abs(got - want) <= ATOL + RTOL * np.abs(want)).all())


def _ties(answers: dict[str, np.ndarray]) -> np.ndarray | None:
    """Rows where either label is right: the two highest probabilities, or decision scores, within the tolerance
    (two classes: a decision near 0)."""
    if "probabilities" in answers:
        return _tie_rows(answers["probabilities"])
    if "scores" in answers:
        scores = answers["scores"]
        return _tie_rows(np.column_stack([-scores, scores]) if scores.ndim == 1 else scores)
    return None


def float32_loss(estimator: Any, sample: pa.Table, features: Sequence[str], framework: str = "scikit-learn"
                 ) -> str | None:
    """Why float32 features lose the answers of ``estimator`` (scikit-learn's, or a scikit-learn-API model's of
    ``framework``: LightGBM's) on the sample, in words naming the column (its magnitude and spread); None where
    rounding the rows to float32 changes no answer beyond the tolerance.

    Raises:
        InvalidInput: the sample lacks a feature, or a feature column is not numbers.
    """
    _features(None, sample, features)  # every feature is there, or InvalidInput naming the missing ones
    # text features (scikit-learn's pipelines only; another framework's are refused by _matrix) are given as they are
    texts = text_features(sample, features) if framework == "scikit-learn" else []
    numbers = [f for f in features if f not in texts]
    if not numbers:
        return None
    given = given_rows(sample, features, CHECK_ROWS, estimator) if texts else _matrix(sample, features, CHECK_ROWS,
                                                                                       np.float64)
    matrix = given[numbers].to_numpy(np.float64) if texts else given
    rounded = matrix.astype(np.float32).astype(np.float64)
    if np.array_equal(matrix, rounded, equal_nan=True) or _same(
            sklearn_answers(estimator, given),
            sklearn_answers(estimator, given.assign(**dict(zip(numbers, rounded.T))) if texts else rounded)):
        return None
    spread = np.nanstd(matrix, axis=0)
    lost = np.nanmax(np.abs(matrix - rounded), axis=0) / np.where(spread > 0, spread, 1.0)
    worst = int(np.nanargmax(lost))
    magnitude = float(np.nanmax(np.abs(matrix[:, worst])))
    return (f"float32 inputs lose precision for column {numbers[worst]!r} (values up to {magnitude:.3g}, spread "
            f"{float(spread[worst]):.3g}): {framework} answers otherwise on the sample rounded to float32")


def _same(want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> bool:
    tie = _ties(want)
    for output, expected in want.items():
        if output == "label":
            if ((got[output] != expected) & ~(tie if tie is not None else False)).any():
                return False
        elif (np.abs(got[output].astype(np.float64) - expected) > ATOL + RTOL * np.abs(expected)).any():
            return False
    return True


def text_features(sample: pa.Table, features: Sequence[str]) -> list[str]:
    """The features the sample holds as text, in any Arrow layout (``string_view``, a pandas ``category``'s
    dictionary): a pipeline's categories, for a ``OneHotEncoder`` in a ``ColumnTransformer``; the rest are
    numbers, or refused as such."""
    return [f for f in features if f in sample.column_names and is_compatible(sample.schema.field(f).type, pa.string())]


def plain_text(sample: pa.Table, texts: Sequence[str]) -> pa.Table:
    """The sample with its text features as ``string`` columns, as the bundle declares and both tiers feed them."""
    for name in texts:
        sample = sample.set_column(sample.column_names.index(name), name, sample.column(name).cast(pa.string()))
    return sample


def given_rows(sample: pa.Table, features: Sequence[str], rows: int, estimator: Any) -> Any:
    """The sample's first ``rows`` rows as scikit-learn is given them: a float64 matrix of the features, or, where
    one is text (``text_features``), a DataFrame of them as given (a ``ColumnTransformer`` selects by name), or,
    for one text feature read by an estimator fitted on no column names (a text vectorizer first), its texts.

    Raises:
        InvalidInput: a feature is neither a number nor text.
    """
    texts = text_features(sample, features)
    if not texts:
        return _matrix(sample, features, rows, np.float64)
    frame = sample.select(list(features)).slice(0, min(rows, sample.num_rows)).to_pandas()
    if texts == list(features) and len(texts) == 1 and not hasattr(estimator, "feature_names_in_"):
        return frame[texts[0]].to_numpy(dtype=object)
    return frame


def check_sklearn(folder: Path, manifest: Manifest, estimator: Any, sample: pa.Table, features: Sequence[str]) -> None:
    """Score the sample's first ``CHECK_ROWS`` rows with the bundle; refuse answers that differ from
    scikit-learn's on those rows as given (float64 features, and text ones as they are).

    Raises:
        InvalidInput: an output differs (naming it, the largest difference and the rows).
    """
    names = list(features)
    answers = sklearn_answers(estimator, given_rows(sample, names, CHECK_ROWS, estimator))
    expected = {name: values for name, values in answers.items() if name in manifest.signature.output_names}
    tie = _ties(answers)
    head = sample.select(names).slice(0, min(CHECK_ROWS, sample.num_rows))
    try:
        _check(folder, manifest, head, expected, tie, "scikit-learn")
    except InvalidInput as e:
        why = _non_ascii_words(estimator, head, text_features(head, names))
        if why is None:
            raise
        raise InvalidInput(f"{e}. {why}") from e


def _non_ascii_words(estimator: Any, head: pa.Table, texts: Sequence[str]) -> str | None:
    """Why a text vectorizer's conversion answers otherwise, where it is the likely cause: the sample's texts hold
    letters outside ASCII, which skl2onnx's vectorizers read otherwise than scikit-learn (any locale)."""
    import pyarrow.compute as pc

    inner = estimator.get_params(deep=True).values() if hasattr(estimator, "get_params") else ()
    if not any(type(part).__name__ in ("CountVectorizer", "TfidfVectorizer") for part in (estimator, *inner)):
        return None
    column = next((t for t in texts if not pc.all(pc.string_is_ascii(head.column(t))).as_py()), None)
    if column is None:
        return None
    return (f"Its text column {column!r} holds letters outside ASCII (accents), which skl2onnx's text vectorizers "
            "read otherwise than scikit-learn does: package the pipeline as custom model code instead, which runs "
            "scikit-learn itself (docs/custom-models.md)")
