"""The real all-MiniLM-L6-v2 bundle served over real HTTP: the official openai client, tritonclient, batch parity."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import tritonclient.http as triton  # noqa: E402

from shardline.online.app import create_app  # noqa: E402
from shardline.online.server import build_plane  # noqa: E402
from shardline.online.tenants import TenantDirectory, hash_api_key  # noqa: E402
from shardline.online.testing import serve_in_thread  # noqa: E402
from shardline.runtimes import RuntimeOptions  # noqa: E402
from shardline.settings import OnlineSettings, RuntimeSettings, StorageSettings  # noqa: E402
from shardline.storage.job_identity import job_key  # noqa: E402
from shardline.storage.registry import ModelRegistry  # noqa: E402
from shardline.storage.scoring import ScoringJob, score_shard  # noqa: E402
from shardline.storage.shards import list_shards  # noqa: E402

from tests.conftest import BuiltModel  # noqa: E402

KEY = "sk-search-team"
TEXTS = [
    "The cat sits on the mat.",
    "A kitten is resting on the rug.",
    "Quarterly revenue grew by eight percent.",
    "Ünïcode, punctuation -- and numbers: 3.14!",
]


@pytest.fixture(scope="module")
def home(breast_cancer_model: BuiltModel, minilm_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A registry with minilm:1 (prod) and breast-cancer:1 (prod)."""
    home = tmp_path_factory.mktemp("online-openai")
    registry = ModelRegistry(str(home / "registry"))
    registry.set_alias("minilm", "prod", registry.push(minilm_bundle).version or 1)
    registry.set_alias("breast-cancer", "prod", registry.push(breast_cancer_model.bundle_dir).version or 1)
    return home


@pytest.fixture(scope="module")
def url(home: Path) -> Iterator[str]:
    tenants = TenantDirectory.from_config({"tenants": [{
        "name": "search", "api_keys_sha256": [hash_api_key(KEY)], "models": ["minilm@prod", "breast-cancer@prod"],
    }]})
    plane = build_plane(OnlineSettings(), StorageSettings(home=str(home)), RuntimeSettings(device="cpu"), tenants)
    with serve_in_thread(create_app(plane)) as base:
        yield base


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def batch_embeddings(home: Path, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The batch tier's embeddings of TEXTS: score_shard on a Parquet shard."""
    work = tmp_path_factory.mktemp("minilm-batch")
    pq.write_table(pa.table({"id": np.arange(len(TEXTS)), "text": TEXTS}), work / "texts.parquet")
    resolved = ModelRegistry(str(home / "registry")).resolve("minilm@prod")
    job = ScoringJob(job_key(resolved.outputs_digest, None), resolved, str(work / "out"), None, 2, str(work / "cache"),
                     runtime=RuntimeOptions("cpu", 2))
    record = score_shard(job, list_shards(str(work / "texts.parquet"))[0])
    assert record.part is not None
    return np.array(pq.read_table(record.part.removeprefix("file://")).column("embedding").to_pylist(), np.float32)


def test_the_openai_client_gets_the_batch_tiers_embeddings(client: openai.OpenAI, batch_embeddings: np.ndarray) -> None:
    default = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks for base64
    floats = client.embeddings.create(model="minilm@prod", input=TEXTS, encoding_format="float")

    assert default.object == "list" and default.model == "minilm:1"
    assert [d.index for d in default.data] == [0, 1, 2, 3]
    got = np.array([d.embedding for d in default.data], np.float32)
    assert got.shape == (4, 384)
    np.testing.assert_allclose(got, batch_embeddings, atol=1e-5)  # batched with other padding: within 1e-5
    np.testing.assert_array_equal(np.array([d.embedding for d in floats.data], np.float32), got)
    assert default.usage.prompt_tokens == default.usage.total_tokens > len(" ".join(TEXTS).split())


def test_one_string_in_one_embedding_out(client: openai.OpenAI, batch_embeddings: np.ndarray) -> None:
    one = client.embeddings.create(model="minilm:1", input=TEXTS[2])
    assert len(one.data) == 1
    np.testing.assert_allclose(one.data[0].embedding, batch_embeddings[2], atol=1e-5)


def test_refusals_come_as_the_openai_client_expects(client: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not available to tenant 'search'"):
        client.embeddings.create(model="gpt-4", input="hi")
    with pytest.raises(openai.BadRequestError, match="breast-cancer:1 is not an embedding model"):
        client.embeddings.create(model="breast-cancer", input="hi")
    with pytest.raises(openai.BadRequestError, match="makes 384-dimensional embeddings and cannot shorten them"):
        client.embeddings.create(model="minilm", input="hi", dimensions=128)
    with pytest.raises(openai.BadRequestError, match=r"field 'input\[0\]' is token ids"):
        client.embeddings.create(model="minilm", input=[[101, 2023]])
    with pytest.raises(openai.AuthenticationError, match="the API key is not valid"):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).embeddings.create(model="minilm", input="x")
    with pytest.raises(openai.BadRequestError, match="minilm:1 does not generate text"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    raw = httpx.post(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, content=b"{oops")
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"


def test_an_empty_text_is_a_400_naming_the_field_as_openai_answers(client: openai.OpenAI, url: str) -> None:
    with pytest.raises(openai.BadRequestError, match="field 'input' is an empty string") as whole:
        client.embeddings.create(model="minilm", input="")
    with pytest.raises(openai.BadRequestError, match=r"field 'input\[3\]' is an empty string") as entry:
        client.embeddings.create(model="minilm", input=["one", "two", "three", "", "five"])
    assert whole.value.status_code == entry.value.status_code == 400
    raw = httpx.post(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "minilm", "input": ["", "x"]})
    assert raw.status_code == 400
    assert raw.json() == {"error": {"message": "field 'input[0]' is an empty string; send the text to embed or leave "
                                    "the entry out", "type": "invalid_request_error", "param": "input[0]",
                                    "code": None}}


@pytest.mark.parametrize("blank", [" ", "\n", "\t \r\n", "\u3000"], ids=["space", "newline", "mixed", "ideographic"])
def test_a_text_of_only_whitespace_is_refused_as_an_empty_one(client: openai.OpenAI, url: str, blank: str) -> None:
    # MiniLM's WordPiece tokenizer drops whitespace: such a text was answered with the empty string's vector
    with pytest.raises(openai.BadRequestError, match="field 'input' is only whitespace; send the text to embed"):
        client.embeddings.create(model="minilm", input=blank)
    raw = httpx.post(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "minilm", "input": ["one", blank]})
    assert raw.status_code == 400
    assert raw.json()["error"]["message"] == ("field 'input[1]' is only whitespace; send the text to embed or leave "
                                              "the entry out") and raw.json()["error"]["param"] == "input[1]"
    assert len(client.embeddings.create(model="minilm", input=[f"{blank}a{blank}"]).data) == 1  # text with blanks


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize(("blank", "kind"), [("", "an empty string"), (" \n", "only whitespace")])
def test_v2_refuses_an_empty_or_blank_text_to_an_embedding_model_naming_the_element(
    url: str, binary: bool, blank: str, kind: str
) -> None:
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    text = triton.InferInput("text", [3], "BYTES")
    text.set_data_from_numpy(np.array([b"one", b"two", blank.encode()], dtype=object), binary_data=binary)
    with pytest.raises(triton.InferenceServerException) as refused:
        client.infer("minilm", [text], headers={"Authorization": f"Bearer {KEY}"})
    client.close()
    assert refused.value.status() == "400"
    assert refused.value.message() == (f"input 'text': element 2 is {kind}; send the text to embed in each element, "
                                       "or leave that one out")


def test_models_lists_what_the_tenant_may_call(client: openai.OpenAI) -> None:
    assert sorted(m.id for m in client.models.list()) == ["breast-cancer", "minilm"]
    # the client's models.retrieve (GET /v1/models/{model}) was a 404 for every model
    assert client.models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not available to tenant 'search'"):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_sends_text_as_bytes_and_gets_the_same_embeddings(
    url: str, batch_embeddings: np.ndarray, binary: bool
) -> None:
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    text = triton.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object), binary_data=binary)
    result = client.infer("minilm", [text], outputs=[triton.InferRequestedOutput("embedding", binary_data=binary)],
                          headers={"Authorization": f"Bearer {KEY}"}, request_compression_algorithm="gzip")
    client.close()

    embeddings = result.as_numpy("embedding").reshape(len(TEXTS), 384)
    np.testing.assert_allclose(embeddings, batch_embeddings, atol=1e-5)
    assert next(o for o in result.get_response()["outputs"])["shape"] == [4, 384]
