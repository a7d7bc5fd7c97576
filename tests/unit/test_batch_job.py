"""The batch flow's job-level tasks: admission, the manifest and summary types, progress watchers."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

from shardline.errors import InvalidSetting
from shardline.storage.job_identity import JobSummary, summarize
from shardline.storage.job_records import JobParameters
from shardline.storage.output import (
    JobManifest,
    ManifestModel,
    ManifestPart,
    ManifestQuarantine,
    OutputLayout,
    PartRecord,
)
from shardline.tasks import batch as batch_tasks
from shardline.tasks.batch_admission import BatchJobSettings
from shardline.tasks.batch_job import admit_job


def _manifest(**changes: object) -> JobManifest:
    fields: dict[str, object] = dict(
        job_id="j1", job_key="k1", tenant="acme",
        model=ManifestModel(reference="bc@prod", pinned="bc:3", variant="fp32", digest="d" * 64),
        input="/in", output="/out", passthrough="auto",
        totals={"shards": 2, "rows_in": 10}, parts=[ManifestPart(part="a.parquet", shard="/in/a.parquet", rows=7)],
        quarantined=[ManifestQuarantine(shard="/in/b.parquet", rows=None, reason=None)],
    )
    fields.update(changes)
    return JobManifest(**fields)  # type: ignore[arg-type]


def test_the_manifest_file_keeps_its_field_names_and_leaves_out_sections_not_given(tmp_path: Path) -> None:
    layout = OutputLayout(str(tmp_path / "out"), job_id="j1")
    layout.commit_manifest(_manifest())
    plain = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert list(plain) == ["job_id", "job_key", "tenant", "model", "input", "output", "passthrough", "totals",
                           "parts", "quarantined"]
    assert plain["model"] == {"reference": "bc@prod", "pinned": "bc:3", "variant": "fp32", "digest": "d" * 64}
    assert plain["quarantined"] == [{"shard": "/in/b.parquet", "rows": None, "reason": None}]  # nulls kept
    assert plain["passthrough"] == "auto" and (tmp_path / "out" / "_SUCCESS").exists()

    layout.commit_manifest(_manifest(sla={"status": "met"}, priority="low", passthrough=["id"]))
    flowed = layout.read_manifest()  # read back typed
    assert flowed.sla == {"status": "met"} and flowed.priority == "low" and flowed.passthrough == ["id"]
    assert flowed == _manifest(sla={"status": "met"}, priority="low", passthrough=["id"])


def test_the_summary_is_typed_and_its_plain_data_is_what_batch_run_json_prints() -> None:
    summary = JobSummary(job_id="j", model="m:1", tenant="t", output="/o", shards=3, shards_committed=2,
                         shards_skipped=1, shards_quarantined=1, rows_in=30, rows_out=20, rows_quarantined=10,
                         rows_scored=20, steady_seconds=3.0, quarantined={"c.parquet": "CorruptShard: x"})
    data = summary.as_dict()
    assert list(data) == ["job_id", "model", "tenant", "output", "shards", "shards_committed", "shards_skipped",
                          "shards_quarantined", "shards_unreadable", "rows_in", "rows_out", "rows_quarantined",
                          "rows_scored", "steady_seconds", "quarantined", "manifest", "shadowed_columns",
                          "steady_rows_per_second"]
    assert data["steady_rows_per_second"] == 6.7 and json.loads(json.dumps(data))["quarantined"] == {
        "c.parquet": "CorruptShard: x"}
    assert summary.totals() == {"shards": 3, "shards_committed": 2, "shards_skipped": 1, "shards_quarantined": 1,
                                "shards_unreadable": 0, "rows_in": 30, "rows_out": 20, "rows_quarantined": 10,
                                "rows_scored": 20}
    with pytest.raises(ValueError):
        JobSummary.model_validate({**data, "rows_in": "many"})


def test_an_unreadable_shard_counts_as_unreadable_and_its_unknown_rows_in_no_row_total() -> None:
    def record(relative: str, status: str, rows_in: int | None, rows_out: int = 0) -> PartRecord:
        return PartRecord(shard=f"/in/{relative}", relative=relative, fingerprint="f", job_key="k",
                          status=status, rows_in=rows_in, rows_out=rows_out,  # type: ignore[arg-type]
                          rows_quarantined=(rows_in or 0) if status == "quarantined" else 0)

    new = [record("a.parquet", "committed", 10, 10), record("corrupt.parquet", "quarantined", None),
           record("wrong.parquet", "quarantined", 5)]
    summary = summarize(job_id="j", model="m:1", tenant="t", output="/o", total_shards=3, new=new, skipped=[])
    assert (summary.shards_quarantined, summary.shards_unreadable) == (2, 1)
    assert (summary.rows_in, summary.rows_out, summary.rows_quarantined) == (15, 10, 5)
    assert summary.rows_in == summary.rows_out + summary.rows_quarantined  # over the rows that could be read


def test_admission_returns_the_resolved_locations_the_job_then_uses(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "in").symlink_to(tmp_path / "data")
    request = JobParameters(model="bc@prod", input_uri=str(tmp_path / "in"), output_uri=str(tmp_path / "x" / ".." / "out"))
    with pytest.raises(InvalidSetting, match="priority"):
        admit_job.fn(request.model_copy(update={"priority": "urgent"}), "2h", None, BatchJobSettings.read())
    admitted = admit_job.fn(request, "2h", None, BatchJobSettings.read(batch_rows=500))
    assert admitted.request.input_uri == str((tmp_path / "data").resolve())  # the link's target, not the link
    assert admitted.request.output_uri == str((tmp_path / "out").resolve())
    assert admitted.tenant is None and admitted.priority == "normal" and admitted.link_roots is None
    assert (admitted.sla.deadline - admitted.sla.started).total_seconds() == 7200


def test_progress_has_one_mechanism_watchers_passed_down_from_the_flow() -> None:
    from shardline.flows.batch_inference import batch_inference

    assert not hasattr(batch_tasks, "progress_listeners")  # no module-level list to append to
    assert "watchers" in inspect.signature(batch_inference.fn).parameters
    assert "watchers" in inspect.signature(batch_tasks.infer_shards.fn).parameters


def test_the_commands_checks_refuse_wrong_requests_without_importing_prefect(tmp_path: Path) -> None:
    """`batch run` and `batch openai` check a request in the command before any flow run; Prefect's imports
    (~1.4 s on 2 cores) are for the flow, so a refusal comes without them."""
    import subprocess
    import sys

    from shardline.build.examples import write_shards

    write_shards(tmp_path / "input", 1, 10)
    (tmp_path / "batch.jsonl").write_text(json.dumps({
        "custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "churn", "messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    code = (
        "import sys\n"
        "from shardline.cli.batch_jobs import JobRequest, refused\n"
        "from shardline.tasks.openai_batch_survey import OpenAIBatchSettings, check_openai_batch\n"
        "from shardline.errors import ModelNotFound\n"
        "folder = sys.argv[1]\n"
        "outcome = refused(JobRequest(model='churn@prod', input_uri=folder + '/input', output_uri=folder + '/out'))\n"
        "assert outcome is not None and outcome.code == 2 and \"model 'churn' is not\" in outcome.error, outcome\n"
        "try:\n"
        "    check_openai_batch(folder + '/batch.jsonl', folder + '/answers', 100, 'default', OpenAIBatchSettings.read())\n"
        "except ModelNotFound:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('the batch file naming an unknown model passed')\n"
        "assert 'prefect' not in sys.modules, 'the checks imported Prefect'\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDLINE_", "PREFECT_"))}
    env["SHARDLINE_STORAGE_HOME"] = str(tmp_path / "home")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "answers").exists()
