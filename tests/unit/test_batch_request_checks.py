"""The checks `batch run` and `batch resume` make before a flow run: every refusal the flow would make before it
writes, made without Prefect and without writing (``shardline.cli.batch_jobs.check_request``).

The CLI side (one line, exit 2, no flow run in the Prefect API) is tests/e2e/test_cli_user_errors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import yaml

from shardline.build.examples import write_shards
from shardline.cli.batch_jobs import JobRequest, check_request, refused
from shardline.errors import (
    AccessDenied,
    EmptyInput,
    InvalidInput,
    InvalidSetting,
    ModelNotFound,
    OutputInUse,
    OutputNotWritable,
    QuotaExceeded,
)
from shardline.settings import BatchSettings
from shardline.storage.lease import LeaseTerms, OutputLease
from shardline.storage.output import PartRecord

pytestmark = pytest.mark.usefixtures("local_registry")


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    write_shards(tmp_path / "in", 2, 50)
    return tmp_path / "in"


def request(shards: Path, output: Path | str, **changes: object) -> JobRequest:
    fields: dict[str, object] = dict(model="breast-cancer@prod", input_uri=str(shards), output_uri=str(output))
    fields.update(changes)
    return JobRequest(**fields)  # type: ignore[arg-type]


def test_a_right_request_passes_and_nothing_is_written(shards: Path, tmp_path: Path) -> None:
    check_request(request(shards, tmp_path / "out"))
    assert refused(request(shards, tmp_path / "out", sla="2h", priority="low")) is None
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes, error, message", [
    ({"model": "churn@prod"}, ModelNotFound, "model 'churn' is not in the registry"),
    ({"model": "breast-cancer@staging"}, ModelNotFound, "has no alias 'staging'"),
    ({"model": "breast-cancer:7"}, ModelNotFound, "has no version 7"),
    ({"variant": "int8"}, ModelNotFound, "breast-cancer:1 has no variant 'int8'"),
    ({"sla": "2x"}, InvalidSetting, "SLA '2x' is not a duration"),
    ({"sla": "2h", "deadline": "2030-01-01T00:00Z"}, InvalidSetting, "give one: a duration or a time"),
    ({"deadline": "2020-01-01T00:00Z"}, InvalidSetting, "is already past"),
    ({"priority": "urgent"}, InvalidSetting, "priority 'urgent' is not one of high, normal, low"),
    ({"input_uri": "/nowhere/in"}, InvalidSetting, "the input '/nowhere/in' does not exist"),
    ({"input_uri": "/tmp/in?x=1"}, InvalidSetting, "holds '?' or '#'"),
    ({"passthrough": ["id", "label"]}, InvalidInput,
     "have the names of model outputs; rename them or leave them out of --passthrough"),
])
def test_a_wrong_request_is_refused_before_anything_starts(
    shards: Path, tmp_path: Path, changes: dict[str, object], error: type, message: str
) -> None:
    with pytest.raises(error, match=message.replace("?", r"\?").replace("(", r"\(")):
        check_request(request(shards, tmp_path / "out", **changes))
    assert not (tmp_path / "out").exists()


def test_a_resume_keeps_its_recorded_deadline_even_when_it_has_passed(shards: Path, tmp_path: Path) -> None:
    check_request(request(shards, tmp_path / "out", deadline="2020-01-01T00:00Z", resume=True))


def test_an_input_with_no_shard_or_two_shards_for_one_part_is_refused(shards: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyInput, match="holds no shard"):
        check_request(request(tmp_path / "empty", tmp_path / "out"))
    (shards / "part-00000.pq").write_bytes((shards / "part-00000.parquet").read_bytes())
    with pytest.raises(InvalidInput, match="would both write 'part-00000.parquet'"):
        check_request(request(shards, tmp_path / "out"))


def test_an_output_that_is_a_file_or_lies_in_the_input_is_refused(shards: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "scores.parquet"
    a_file.write_bytes(b"not a folder")
    with pytest.raises(OutputNotWritable, match="is a file, not a folder; running again will not help"):
        check_request(request(shards, a_file))
    with pytest.raises(OutputNotWritable, match="is a file, not a folder"):
        check_request(request(shards, a_file / "deeper"))
    with pytest.raises(InvalidSetting, match="lies inside the input"):
        check_request(request(shards, shards / "out"))
    assert a_file.read_bytes() == b"not a folder"


def test_an_output_inside_another_jobs_output_is_refused_naming_that_folder(shards: Path, tmp_path: Path) -> None:
    # a reader of the outer folder would read the inner job's parts as its own rows
    for marker in ("_manifest.json", "_ledger", "_job.json", "_parts"):  # a `batch openai` job's folder too
        outer = tmp_path / f"outer-{marker}"
        outer.mkdir()
        (outer / marker).mkdir() if marker in ("_ledger", "_parts") else (outer / marker).write_text("{}")
        with pytest.raises(OutputInUse, match=f"the output {outer}/more/scored is inside {outer}, another job's "
                                              "output folder .*: choose an --output outside it"):
            check_request(request(shards, outer / "more" / "scored"))
        assert not (outer / "more").exists()


def test_an_output_holding_parquet_files_no_job_wrote_is_refused_and_a_jobs_own_parts_are_not(
    shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    (out / "old").mkdir(parents=True)
    (out / "old" / "scores.parquet").write_bytes((shards / "part-00000.parquet").read_bytes())
    with pytest.raises(OutputInUse, match=f"the output {out} holds 1 Parquet file no Shardline job wrote "
                                          r"\(first: old/scores.parquet\); .*choose an empty folder for --output, "
                                          "or move them out"):
        check_request(request(shards, out))

    # a part of this input's shard whose ledger record was not written yet (a crash between the two) is the job's:
    # a resume writes it again
    (out / "old" / "scores.parquet").unlink()
    (out / "part-00001.parquet").write_bytes((shards / "part-00001.parquet").read_bytes())
    check_request(request(shards, out))


def test_an_output_another_job_runs_on_is_refused(shards: Path, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    lease = OutputLease.acquire(fsspec.filesystem("file"), str(busy), str(busy), "job-elsewhere", "bc:1", LeaseTerms())
    try:
        with pytest.raises(OutputInUse, match=f"the output {busy} is in use by job job-elsewhere"):
            check_request(request(shards, busy))
    finally:
        lease.release()
    check_request(request(shards, busy))  # released: free again


def test_an_output_holding_another_models_parts_is_refused(shards: Path, tmp_path: Path) -> None:
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / "_manifest.json").write_text(json.dumps(
        {"job_id": "0123abcd", "job_key": "another-key", "model": {"pinned": "churn:2", "digest": "d"}}))
    with pytest.raises(OutputInUse, match=r"holds the parts of job 0123abcd \(model churn:2; its manifest is there\)"):
        check_request(request(shards, finished))

    unfinished = tmp_path / "unfinished"
    (unfinished / "_ledger").mkdir(parents=True)
    record = PartRecord(shard="/x/a.parquet", relative="a.parquet", fingerprint="f", job_key="another-key",
                        status="committed", part="/y/a.parquet", rows_in=1, rows_out=1)
    (unfinished / "_ledger" / "a.parquet.json").write_text(record.model_dump_json())
    with pytest.raises(OutputInUse, match="holds 1 parts settled by another model or passthrough"):
        check_request(request(shards, unfinished))


def test_tenancy_is_checked_the_tenant_its_prefixes_and_its_gpu_hours(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [
        {"name": "acme", "batch": {"storage_prefixes": [str(tmp_path)], "gpu_hours_per_day": 0}},
        {"name": "globex", "batch": {"storage_prefixes": ["/elsewhere"]}},
    ]}))
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", str(tenants))
    with pytest.raises(AccessDenied, match="tenant 'initech' is not in the tenants file"):
        check_request(request(shards, tmp_path / "out", tenant="initech"))
    with pytest.raises(AccessDenied, match="tenant .globex. may not use .* as its input: it is not under its storage"):
        check_request(request(shards, tmp_path / "out", tenant="globex"))
    check_request(request(shards, tmp_path / "out", tenant="acme"))  # on CPU its GPU-hours do not count
    monkeypatch.setenv("SHARDLINE_RUNTIME_DEVICE", "cuda")
    with pytest.raises(QuotaExceeded, match="tenant 'acme' has used 0.00 of its 0 GPU-hours"):
        check_request(request(shards, tmp_path / "out", tenant="acme"))


def test_a_bad_setting_is_one_line_naming_the_variable(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDLINE_BATCH_BATCH_ROWS", "many")
    outcome = refused(request(shards, tmp_path / "out"))
    assert outcome is not None and outcome.code == 2 and outcome.summary is None
    assert outcome.error is not None and "\n" not in outcome.error
    assert outcome.error.startswith("a setting is not valid: SHARDLINE_BATCH_BATCH_ROWS: Input should be a valid "
                                    "integer") and "(got 'many')" in outcome.error


@pytest.mark.parametrize("port", ["abc", "65536"])
def test_a_bad_batch_metrics_port_says_that_0_or_off_turns_the_listener_off(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, port: str
) -> None:
    monkeypatch.setenv("SHARDLINE_BATCH_METRICS_PORT", port)
    outcome = refused(request(shards, tmp_path / "out"))
    assert outcome is not None and outcome.code == 2 and outcome.error is not None and "\n" not in outcome.error
    assert outcome.error.startswith("a setting is not valid: SHARDLINE_BATCH_METRICS_PORT: Input should be ")
    assert f"give a port from 1 to 65535, or 0 or 'off' for no metrics listener (got '{port}')" in outcome.error


def test_off_turns_the_batch_metrics_listener_off() -> None:
    assert BatchSettings(metrics_port="off").metrics_port == 0
