"""Models whose inputs are tensors of rank 2 or more: packaged from a same-named list column or from the
ONNX file alone, described to V2 clients as ``[-1, k]``, decoded from one ``[N, k]`` tensor; and the V2
datatypes and ranks taken as strictly as Triton takes them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pytest
import tritonclient.http as triton

from shardline.build.packaging import package_onnx
from shardline.errors import InvalidBundle, InvalidInput
from shardline.online.protocols.kserve_v2 import decode_infer_request, model_metadata
from shardline.rows import float_rows
from shardline.runtimes import RuntimeOptions, create_runtime
from shardline.signature import ColumnSpec, Signature
from tests.tensor_models import (
    cube_model, feature_column, fixed_batch_model, list_classifier, string_pair_model, two_tensor_model,
)


def signature_of(manifest_signature: Signature) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    return ([(c.name, c.type) for c in manifest_signature.inputs], [(c.name, c.type) for c in manifest_signature.outputs])


def scored(bundle: Path, rows: pa.Table) -> pa.RecordBatch:
    from shardline.bundle import read_manifest

    runtime = create_runtime(bundle, read_manifest(bundle), RuntimeOptions(device="cpu", intra_op_threads=1))
    runtime.load()
    try:
        return runtime.predict(rows)
    finally:
        runtime.close()


def test_a_list_column_named_after_a_2d_input_feeds_it_and_is_one_v2_input_of_shape_n_k(tmp_path: Path) -> None:
    onnx_file, estimator, features = list_classifier(tmp_path / "model")
    sample = pa.table({"input": feature_column(features), "target": np.arange(len(features))})

    manifest = package_onnx(onnx_file, tmp_path / "bundle", name="vec", sample=sample, exclude=["target"])

    assert signature_of(manifest.signature) == (
        [("input", "fixed_size_list<float32>[30]")],
        [("label", "int64"), ("probabilities", "fixed_size_list<float32>[2]")])
    assert "tensor_inputs" not in manifest.runtime_config
    metadata = model_metadata("vec", [1], "onnx", manifest.signature)
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 30]}]
    out = scored(tmp_path / "bundle", sample.select(["input"]))
    np.testing.assert_array_equal(out.column("label").to_numpy(), estimator.predict(features))
    np.testing.assert_allclose(np.stack(out.column("probabilities").to_numpy(zero_copy_only=False)),
                               estimator.predict_proba(features), atol=1e-5)


def test_the_list_layout_reaches_the_runtimes_float_path(tmp_path: Path) -> None:
    onnx_file, estimator, features = list_classifier(tmp_path / "model")
    manifest = package_onnx(onnx_file, tmp_path / "bundle", name="vec")
    runtime = create_runtime(tmp_path / "bundle", manifest, RuntimeOptions(device="cpu", intra_op_threads=1))
    runtime.load()
    try:
        answer = runtime.predict(float_rows(manifest.signature.plan, (features[:7].astype(np.float32),), "vec"))
    finally:
        runtime.close()
    assert isinstance(answer, dict)
    np.testing.assert_array_equal(answer["label"], estimator.predict(features[:7]))
    np.testing.assert_allclose(answer["probabilities"], estimator.predict_proba(features[:7]), atol=1e-5)


def test_from_the_onnx_file_alone_the_signature_is_the_models_own_and_no_profile_is_claimed(tmp_path: Path) -> None:
    onnx_file, _, features = list_classifier(tmp_path / "model")
    alone = package_onnx(onnx_file, tmp_path / "alone", name="vec")
    sampled = package_onnx(onnx_file, tmp_path / "sampled", name="vec", sample=pa.table({"input": feature_column(features)}))

    assert signature_of(alone.signature) == signature_of(sampled.signature)
    assert alone.reference_profile is None and alone.lineage.training_data is None


def test_two_2d_inputs_coexist_from_a_sample_or_from_the_file_alone(tmp_path: Path) -> None:
    model = two_tensor_model(tmp_path / "two.onnx")
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=(6, 2)).astype(np.float32)
    sample = pa.table({"id": np.arange(6), "a": feature_column(a), "b": feature_column(b)})

    from_sample = package_onnx(model, tmp_path / "s", name="two", sample=sample, exclude=["id"])
    alone = package_onnx(model, tmp_path / "f", name="two")

    want = ([("a", "fixed_size_list<float32>[3]"), ("b", "fixed_size_list<float32>[2]")],
            [("total", "float32"), ("joined", "fixed_size_list<float32>[5]")])
    assert signature_of(from_sample.signature) == signature_of(alone.signature) == want
    assert [i["shape"] for i in model_metadata("two", [1], "onnx", alone.signature)["inputs"]] == [[-1, 3], [-1, 2]]
    out = scored(tmp_path / "f", sample.select(["a", "b"]))
    np.testing.assert_allclose(out.column("total").to_numpy(), a.sum(1) + b.sum(1), rtol=1e-5)
    assert out.column("joined").to_pylist() == np.hstack([a, b]).tolist()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_rank_3_input_is_a_nested_list_column_and_a_v2_tensor_of_that_rank(tmp_path: Path, binary: bool) -> None:
    manifest = package_onnx(cube_model(tmp_path / "cube.onnx"), tmp_path / "b", name="cube")
    assert signature_of(manifest.signature)[0] == [("x", "fixed_size_list<fixed_size_list<float32>[3]>[2]")]
    assert model_metadata("cube", [1], "onnx", manifest.signature)["inputs"] == [
        {"name": "x", "datatype": "FP32", "shape": [-1, 2, 3]}]
    cubes = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    tensor = triton.InferInput("x", [4, 2, 3], "FP32")
    tensor.set_data_from_numpy(cubes, binary_data=binary)
    body, size = triton.InferenceServerClient.generate_request_body([tensor])

    decoded = decode_infer_request(body, None if size is None else str(size), manifest.signature, "cube:1")

    assert decoded.table.column("x").to_pylist() == cubes.tolist()
    np.testing.assert_allclose(scored(tmp_path / "b", decoded.table).column("total").to_numpy(), cubes.sum((1, 2)))
    wrong = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4, 3, 2], "data": cubes.ravel().tolist()}]})
    with pytest.raises(InvalidInput, match=re.escape("the model takes [-1, 2, 3] (rank 3): send shape [N, 2, 3]")):
        decode_infer_request(wrong, None, manifest.signature, "cube:1")


def refusal(tmp_path: Path, case: str) -> str:
    onnx_file, _, features = list_classifier(tmp_path / "model")
    samples = {
        "primitive column": pa.table({"input": pa.array(features[:, 0])}),
        "wrong width": pa.table({"input": feature_column(features[:, :29])}),
        "strings": pa.table({"input": pa.FixedSizeListArray.from_arrays(pa.array(["x"] * 60), 30)}),
    }
    with pytest.raises(InvalidInput) as refused:
        if case == "missing input":
            package_onnx(two_tensor_model(tmp_path / "two.onnx"), tmp_path / "b", name="two",
                         sample=pa.table({"a": feature_column(np.ones((2, 3)))}))
        elif case == "fixed batch":
            package_onnx(fixed_batch_model(tmp_path / "fixed.onnx"), tmp_path / "b", name="fixed")
        elif case == "excluded typo":  # the label would be taken for a feature
            package_onnx(onnx_file, tmp_path / "b", name="vec", exclude=["targt"],
                         sample=pa.table({"input": feature_column(features), "target": pa.array([0] * len(features))}))
        elif case == "fixed batch, feature columns":  # the sample's 4 columns stacked into x: run on 8 rows
            package_onnx(fixed_batch_model(tmp_path / "fixed.onnx"), tmp_path / "b", name="fixed",
                         sample=pa.table({f"f{i}": pa.array(np.ones(8, np.float32)) for i in range(4)}))
        elif case == "fixed batch of 5, a list column":
            package_onnx(fixed_batch_model(tmp_path / "fixed.onnx", rows=5), tmp_path / "b", name="fixed",
                         sample=pa.table({"x": feature_column(np.ones((8, 4), np.float32))}))
        elif case == "strings a row":
            package_onnx(string_pair_model(tmp_path / "pair.onnx"), tmp_path / "b", name="pair")
        else:
            package_onnx(onnx_file, tmp_path / "b", name="vec", sample=samples[case])
    return str(refused.value)


@pytest.mark.parametrize("case, says", [
    ("primitive column", "sample column 'input' is float32, the model's input 'input' has shape [-1, 30] (30 float32 "
                         "values per row): give it as one fixed_size_list<float32>[30] column"),
    ("wrong width", "sample column 'input' is fixed_size_list<float32>[29], the model's input 'input' has shape "
                    "[-1, 30]: give rows of 30 values (fixed_size_list<float32>[30])"),
    ("strings", "cast the column to fixed_size_list<float32>[30]"),
    ("missing input", "the sample has no column ['b']: name one column after each input"),
    ("fixed batch", "a fixed batch of 1; both tiers feed a model any number of rows: export it with a dynamic "
                    "first dimension"),
    ("excluded typo", "--exclude 'targt' is not a column of the sample (did you mean 'target'? columns: 'input', "
                      "'target'); name the label and id columns as the sample spells them"),
    ("fixed batch, feature columns", "ONNX input 'x' has shape [1, 4], a fixed batch of 1; both tiers feed a "
                                     "model any number of rows"),
    ("fixed batch of 5, a list column", "ONNX input 'x' has shape [5, 4], a fixed batch of 5; both tiers feed a "
                                        "model any number of rows"),
    ("strings a row", "ONNX output 'names' holds several strings a row; bundles hold one string per row"),
])
def test_each_packaging_refusal_says_what_to_do(tmp_path: Path, case: str, says: str) -> None:
    message = refusal(tmp_path, case)
    assert says in message
    assert "the model's input is float32" not in message


def test_a_bundle_whose_column_cannot_take_the_inputs_shape_is_refused_when_it_loads(tmp_path: Path) -> None:
    onnx_file, _, _ = list_classifier(tmp_path / "model")
    flat = Signature(inputs=[ColumnSpec(name="input", type="float32")], outputs=[ColumnSpec(name="label", type="int64")])
    manifest = package_onnx(onnx_file, tmp_path / "b", name="vec", signature=flat)
    runtime = create_runtime(tmp_path / "b", manifest, RuntimeOptions(device="cpu"))
    with pytest.raises(InvalidBundle, match=re.escape("declare it as fixed_size_list<float32>[30]")):
        runtime.load()


# -- V2 requests, decoded as strictly as Triton decodes them ------------------------------------------
LIST = Signature(inputs=[ColumnSpec(name="input", type="fixed_size_list<float32>[4]")],
                 outputs=[ColumnSpec(name="y", type="float32")])
COLUMNS = Signature(inputs=[ColumnSpec(name="x", type="float32"), ColumnSpec(name="n", type="int64")],
                    outputs=[ColumnSpec(name="y", type="float32")])


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclients_n_k_tensor_decodes_to_the_matrix_the_model_is_fed(binary: bool) -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    tensor = triton.InferInput("input", [3, 4], "FP32")
    tensor.set_data_from_numpy(values, binary_data=binary)
    body, size = triton.InferenceServerClient.generate_request_body([tensor])

    decoded = decode_infer_request(body, None if size is None else str(size), LIST, "vec:1")

    arrays = decoded.rows.arrays
    assert arrays is not None and decoded.rows.plan is LIST.plan  # float arrays, checked against this signature
    assert len(arrays) == 1 and arrays[0].shape == (3, 4) and arrays[0].tobytes() == values.tobytes()
    assert decoded.table.column("input").to_pylist() == values.tolist()


def body(*tensors: dict[str, object]) -> bytes:
    return orjson.dumps({"inputs": list(tensors)})


X = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.5, 2.0]}
N = {"name": "n", "datatype": "INT64", "shape": [2], "data": [3, 4]}


@pytest.mark.parametrize("request_body, signature, message", [
    (body({**X, "datatype": "INT32", "data": [1, 2]}, N), COLUMNS, "input 'x' is INT32, the model takes FP32: send datatype FP32"),
    (body({**X, "datatype": "FP64"}, N), COLUMNS, "input 'x' is FP64, the model takes FP32: send datatype FP32"),
    (body(X, {**N, "datatype": "INT32"}), COLUMNS, "input 'n' is INT32, the model takes INT64: send datatype INT64"),
    (body({**X, "shape": [1, 2]}, {**N, "shape": [1, 2]}), COLUMNS,
     "input 'x' has shape [1, 2] (rank 2), the model takes [-1] (rank 1): send shape [N]"),
    (body({"name": "input", "datatype": "FP32", "shape": [8], "data": [0.5] * 8}), LIST,
     "input 'input' has shape [8] (rank 1), the model takes [-1, 4] (rank 2): send shape [N, 4]"),
    (body({"name": "input", "datatype": "FP32", "shape": [2, 3], "data": [0.5] * 6}), LIST,
     "input 'input' has shape [2, 3] (rank 2), the model takes [-1, 4] (rank 2): send shape [N, 4]"),
    (body({"name": "input", "datatype": "FP16", "shape": [1, 4], "data": [0.5] * 4}), LIST,
     "input 'input' is FP16, the model takes FP32: send datatype FP32"),
], ids=["int32-for-fp32", "fp64-for-fp32", "int32-for-int64", "1n-for-n", "flat-for-n-k", "wrong-k", "fp16-for-fp32"])
def test_the_declared_datatype_and_rank_are_required_with_what_to_send(
        request_body: bytes, signature: Signature, message: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        decode_infer_request(request_body, None, signature, "m:1")
    assert str(refused.value) == message


def test_n_by_1_is_read_as_n_for_a_column_of_one_value_a_row() -> None:
    """``[N, 1]`` (an ONNX ``[N, 1]`` input's own shape) is the same values as ``[N]``: read as such."""
    as_rows = decode_infer_request(body({**X, "shape": [2, 1]}, {**N, "shape": [2, 1]}), None, COLUMNS, "m:1")
    assert as_rows.table.equals(decode_infer_request(body(X, N), None, COLUMNS, "m:1").table)


def test_json_numbers_without_a_fraction_are_fp32_values() -> None:
    decoded = decode_infer_request(body({**X, "data": [1, 2]}, N), None, COLUMNS, "m:1")
    assert decoded.table.column("x").to_pylist() == [1.0, 2.0]


@pytest.mark.parametrize("binary", [True, False])
def test_the_tensor_layout_shows_the_stacked_columns_as_the_models_own_input(tmp_path: Path, binary: bool) -> None:
    from sklearn.datasets import load_breast_cancer

    onnx_file, estimator, features = list_classifier(tmp_path / "model")
    names = [str(n) for n in load_breast_cancer().feature_names]
    sample = pa.table({n: features[:, j] for j, n in enumerate(names)})
    columns = package_onnx(onnx_file, tmp_path / "columns", name="vec", sample=sample)
    tensor = package_onnx(onnx_file, tmp_path / "tensor", name="vec", sample=sample, input_layout="tensor")

    assert tensor.signature.input_names == columns.signature.input_names == names  # the rows stay columns
    assert "input_tensor" not in orjson.loads((tmp_path / "columns" / "manifest.json").read_bytes())["signature"]
    assert orjson.loads((tmp_path / "tensor" / "manifest.json").read_bytes())["signature"]["input_tensor"] == "input"
    assert model_metadata("vec", [1], "onnx", columns.signature)["inputs"][0] == {
        "name": "mean radius", "datatype": "FP32", "shape": [-1]}
    assert model_metadata("vec", [1], "onnx", tensor.signature)["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": [-1, 30]}]

    one = triton.InferInput("input", [5, 30], "FP32")
    one.set_data_from_numpy(features[:5], binary_data=binary)
    body, header = triton.InferenceServerClient.generate_request_body([one])
    rows = decode_infer_request(body, str(header) if header else None, tensor.signature, "vec:1").rows
    assert rows.plan is tensor.signature.plan and np.array_equal(rows.arrays[0], features[:5])  # type: ignore[index]
    assert scored(tmp_path / "tensor", rows.table()).column("label").to_pylist() == estimator.predict(features[:5]).tolist()
    with pytest.raises(InvalidInput, match=r"input 'mean radius' is not an input of the model 'vec:1'; it takes \['input'\]"):
        decode_infer_request(orjson.dumps({"inputs": [{"name": "mean radius", "datatype": "FP32", "shape": [1],
                                                       "data": [1.0]}]}), None, tensor.signature, "vec:1")


def test_the_tensor_layout_is_for_float_columns_and_a_known_layout() -> None:
    from shardline.build.packaging import check_input_layout
    from shardline.errors import InvalidSetting

    out = (ColumnSpec(name="y", type="float32"),)
    with pytest.raises(ValueError, match=r"input_tensor 'x': inputs are taken as one tensor only when they are all "
                                         r"float32 \(or all float64\) columns; they are \['float32', 'int64'\]"):
        Signature(inputs=(ColumnSpec(name="a", type="int64"), ColumnSpec(name="b", type="float32")), outputs=out,
                  input_tensor="x")
    with pytest.raises(InvalidSetting, match="input layout 'matrix' is not one of columns, tensor"):
        check_input_layout("matrix")
    from shardline.build.packaging import _signature

    with pytest.raises(InvalidSetting, match=r"the input layout 'tensor' does not apply: input_tensor 'X': inputs are "
                                             r"taken as one tensor only when .* they are \['int64'\]; leave the layout"):
        _signature([ColumnSpec(name="a", type="int64"), ColumnSpec(name="b", type="int64")], out, "X")


def test_a_scikit_learn_model_packaged_with_the_tensor_layout_takes_x(tmp_path: Path) -> None:
    from shardline.build.packaging import package_sklearn

    _, estimator, features = list_classifier(tmp_path / "model")
    manifest = package_sklearn(estimator, tmp_path / "bundle", name="bc", feature_names=[f"f{i}" for i in range(30)],
                               input_layout="tensor")
    assert model_metadata("bc", [1], "onnx", manifest.signature)["inputs"] == [
        {"name": "X", "datatype": "FP32", "shape": [-1, 30]}]
    body = orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [3, 30],
                                     "data": features[:3].tolist()}]})
    rows = decode_infer_request(body, None, manifest.signature, "bc:1").rows
    assert scored(tmp_path / "bundle", rows.table()).column("label").to_pylist() == \
        estimator.predict(features[:3]).tolist()
    nan = features[:3].copy()
    nan[1, 4] = np.nan
    with pytest.raises(InvalidInput, match=r"^input 'X' \(the model's columns in order\): columns \['f4'\] hold NaN"):
        decode_infer_request(json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [3, 30],  # named X, not f4
                                                     "data": nan.tolist()}]}).encode(), None, manifest.signature, "bc:1")


def test_a_scikit_learn_classifier_of_text_classes_is_packaged_with_a_string_label(tmp_path: Path) -> None:
    # package_sklearn declared every label int64: a classifier fitted on names packaged, and then refused every row
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    from shardline.build.packaging import package_sklearn

    iris = load_iris()
    names = [str(n).replace(" (cm)", "").replace(" ", "_") for n in iris.feature_names]
    classes = np.array(iris.target_names)[iris.target]
    estimator = LogisticRegression(max_iter=500).fit(iris.data, classes)

    manifest = package_sklearn(estimator, tmp_path / "bundle", name="iris-names", feature_names=names)

    assert signature_of(manifest.signature)[1] == [("label", "string"), ("probabilities", "fixed_size_list<float32>[3]")]
    rows = pa.table({n: iris.data[:, i].astype(np.float32) for i, n in enumerate(names)})
    out = scored(tmp_path / "bundle", rows)
    assert out.column("label").to_pylist() == estimator.predict(iris.data.astype(np.float32)).tolist()


def _text_classifier(locale: str) -> bytes:
    """skl2onnx's TfidfVectorizer + logistic regression on one text a row (``[None, 1]``), its normalizer in
    ``locale``."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import StringTensorType
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    texts, labels = ["good movie", "bad movie", "great film", "awful film"] * 5, [1, 0, 1, 0] * 5
    pipe = make_pipeline(TfidfVectorizer(), LogisticRegression()).fit(texts, labels)
    options = {id(pipe.steps[0][1]): {"locale": locale}, id(pipe.steps[1][1]): {"zipmap": False}}
    return to_onnx(pipe, initial_types=[("text", StringTensorType([None, 1]))], options=options).SerializeToString()


def test_a_text_model_of_one_text_a_row_takes_tritonclients_n_by_1_and_a_missing_locale_is_said(
    tmp_path: Path, capfd: pytest.CaptureFixture[str],
) -> None:
    """skl2onnx's text models take ``[None, 1]`` strings: packaged from the file alone they are one string column,
    and a tritonclient request of shape ``[N, 1]`` is scored. A normalizer whose locale this machine lacks is
    refused naming the locale and what to do, when packaging and when a bundle loads."""
    (tmp_path / "text.onnx").write_bytes(_text_classifier("C"))
    manifest = package_onnx(tmp_path / "text.onnx", tmp_path / "bundle", name="sentiment")
    assert signature_of(manifest.signature)[0] == [("text", "string")]
    tensor = triton.InferInput("text", [2, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([["a good film"], ["an awful movie"]], dtype=object), binary_data=False)
    body, _ = triton.InferenceServerClient.generate_request_body([tensor])
    rows = decode_infer_request(body, None, manifest.signature, "sentiment:1").table
    assert scored(tmp_path / "bundle", rows).column("label").to_pylist() == [1, 0]

    (tmp_path / "nowhere.onnx").write_bytes(_text_classifier("xx_XX.UTF-8"))
    hint = (r"needs the locale xx_XX.UTF-8, which this machine does not have: install that locale here and wherever "
            r"the model runs .* skl2onnx's option \{'locale': 'C'\}")
    capfd.readouterr()
    with pytest.raises(InvalidInput, match=r"onnxruntime cannot load .*nowhere.onnx: its text normalizer .*" + hint):
        package_onnx(tmp_path / "nowhere.onnx", tmp_path / "refused", name="sentiment")
    assert "onnxruntime" not in capfd.readouterr().err  # said once, in the error: not also in onnxruntime's log
    (tmp_path / "bundle" / "model.onnx").write_bytes((tmp_path / "nowhere.onnx").read_bytes())
    with pytest.raises(InvalidBundle, match=r"sentiment:?\S* onnxruntime could not load model.onnx .*" + hint):
        create_runtime(tmp_path / "bundle", manifest, RuntimeOptions(device="cpu", intra_op_threads=1)).load()
