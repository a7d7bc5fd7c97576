"""A wrong request to `shardline batch run`, `batch resume` or `batch openai` is refused before any flow run:
one `error:` line on stderr (no INFO line, no progress bar, no traceback), nothing on stdout, exit code 2, and
no flow run in the session's Prefect API (the UI does not fill with Failed runs). The checks run in the
command when no warm batch runner runs yet, in the runner when one does, and in the command on the cold path.

The flow checks the same again when it runs (a deployment's run, or what changed in between): its user
errors are one line too (tests/integration/test_batch_bad_input.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import fsspec
import httpx
import pytest

from shardline.build.examples import write_shards
from shardline.build.llm_build import package_tiny_llm
from shardline.cli.batch_runner import find
from shardline.storage.lease import LeaseTerms, OutputLease
from shardline.storage.registry import ModelRegistry
from tests.support.batch_process import read_only
from tests.support.budgets import spend, write_prices
from tests.tensor_models import breast_cancer_bundle

Shardline = Callable[..., subprocess.CompletedProcess[str]]
RUN = ("batch", "run", "--model")


def flow_runs(prefect_api: str) -> int:
    """How many flow runs the session's Prefect API holds."""
    answer = httpx.post(f"{prefect_api}/flow_runs/count", json={}, timeout=30)
    answer.raise_for_status()
    return int(answer.json())


def assert_one_error_line(run: subprocess.CompletedProcess[str], message: str) -> None:
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert "Traceback" not in run.stderr, run.stderr
    assert lines[-1].startswith("error: ") and message in lines[-1], run.stderr
    assert [line for line in lines if line.startswith("error: ") or message in line] == [lines[-1]], run.stderr
    assert not [line for line in lines if "| ERROR" in line], run.stderr


def assert_refused(run: subprocess.CompletedProcess[str], message: str, stdout: str = "") -> None:
    """Exit 2, and stderr exactly one `error:` line holding ``message`` (nothing before it: no INFO line, no
    progress bar); stdout ``stdout`` (nothing, for `batch run`)."""
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], run.stderr[-3000:]
    assert run.stdout == stdout, run.stdout[-3000:]


def refused_before_any_flow_run(shardline: Shardline, prefect_api: str,
                                cases: list[tuple[tuple[str, ...], dict[str, str], str]]) -> None:
    """Run each (args, environment, message) case: one error line each, and no flow run made by any."""
    before = flow_runs(prefect_api)
    for args, env, message in cases:
        assert_refused(shardline(*args, **env), message)
    assert flow_runs(prefect_api) == before


@pytest.fixture
def wrong_requests(tmp_path: Path, shardline_home: Path) -> list[tuple[tuple[str, ...], dict[str, str], str]]:
    """Every kind of wrong `batch run` request (README.md's exit code 2 list), with what its line must say."""
    shards = tmp_path / "input"
    write_shards(shards, 1, 100)
    empty, a_file, in_use, other_model = (tmp_path / name for name in ("empty", "scores.parquet", "busy", "other"))
    empty.mkdir()
    a_file.write_bytes(b"not a folder")
    other_model.mkdir()
    (other_model / "_manifest.json").write_text(json.dumps(
        {"job_id": "0123abcd", "job_key": "another-model", "model": {"pinned": "churn:2", "digest": "d"}}))
    other_columns = tmp_path / "other-columns"  # the same model's parts, with other passthrough columns
    other_columns.mkdir()
    (other_columns / "_manifest.json").write_text(json.dumps(
        {"job_id": "4567cdef", "job_key": "other-columns", "model": {"pinned": "breast-cancer:1", "digest": "d"}}))
    not_ours = tmp_path / "not-ours"  # Parquet that no job's ledger records
    not_ours.mkdir()
    (not_ours / "scores.parquet").write_bytes(b"PAR1")
    twins = tmp_path / "twins"
    write_shards(twins, 1, 10)
    (twins / "part-00000.pq").write_bytes((twins / "part-00000.parquet").read_bytes())
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: acme\n    batch: {{storage_prefixes: ['{tmp_path / 'acme'}']}}\n"
                       f"  - name: spent\n    batch: {{storage_prefixes: ['{tmp_path}']}}\n"
                       "    budget: {monthly: 1000.0, warn_at: 0.8, soft_at: 0.9}\n")
    write_prices(shardline_home)
    # past its soft limit: a job of its runs at low priority, said in a line; a wrong priority is still refused
    # (it was made 'low' and run), and alone: the budget's line is for a job that runs
    spend(shardline_home, "spent", 950.0)
    out = str(tmp_path / "out")
    bc = ("breast-cancer@prod", "--input", str(shards))
    return [
        ((*RUN, "churn@prod", "--input", str(shards), "--output", out), {}, "model 'churn' is not in the registry"),
        ((*RUN, "breast-cancer@canary", "--input", str(shards), "--output", out), {}, "has no alias 'canary'"),
        ((*RUN, "breast-cancer:7", "--input", str(shards), "--output", out), {}, "has no version 7"),
        ((*RUN, *bc, "--output", out, "--variant", "int8"), {}, "breast-cancer:1 has no variant 'int8'"),
        ((*RUN, "breast-cancer@prod", "--input", str(tmp_path / "nowhere"), "--output", out), {}, "does not exist"),
        ((*RUN, "breast-cancer@prod", "--input", str(empty), "--output", out), {},
         f"the input '{empty}' holds no shard"),
        ((*RUN, "breast-cancer@prod", "--input", f"{shards}?v=2", "--output", out), {}, "holds '?' or '#'"),
        ((*RUN, "breast-cancer@prod", "--input", str(twins), "--output", out), {}, "would both write"),
        ((*RUN, *bc, "--output", str(a_file)), {}, f"the output {a_file} is a file, not a folder"),
        ((*RUN, *bc, "--output", str(shards / "scored")), {}, "lies inside the input"),
        ((*RUN, *bc, "--output", str(in_use)), {}, f"the output {in_use} is in use by job job-elsewhere"),
        ((*RUN, *bc, "--output", str(other_model)), {}, "holds the parts of job 0123abcd (model churn:2"),
        ((*RUN, *bc, "--output", str(other_model / "more")), {},
         f"the output {other_model / 'more'} is inside {other_model}, another job's output folder"),
        ((*RUN, *bc, "--output", str(not_ours)), {}, f"the output {not_ours} holds 1 Parquet file no Shardline job "
         "wrote (first: scores.parquet); a reader of the folder would read their rows with this job's"),
        ((*RUN, *bc, "--output", str(other_columns)), {}, "with other passthrough columns than this job's; parts "
         "with different columns in one folder would corrupt it: give the --passthrough that job had"),
        ((*RUN, *bc, "--output", out, "--passthrough", "label"), {},
         "passthrough columns ['label'] have the names of model outputs; rename them or leave them out"),
        ((*RUN, *bc, "--output", out, "--passthrough", "id", "--passthrough", "idd"), {},
         "passthrough columns ['idd'] are not in the input's first shard part-00000.parquet (its columns: id, "),
        ((*RUN, *bc, "--output", out, "--sla", "2x"), {}, "SLA '2x' is not a duration"),
        ((*RUN, *bc, "--output", out, "--deadline", "2020-01-01T00:00Z"), {}, "is already past"),
        ((*RUN, *bc, "--output", out, "--priority", "urgent"), {}, "priority 'urgent' is not one of high"),
        ((*RUN, *bc, "--output", out, "--tenant", "initech"), {"SHARDLINE_TENANTS_FILE": str(tenants)},
         "tenant 'initech' is not in the tenants file"),
        ((*RUN, *bc, "--output", out, "--tenant", "acme"), {"SHARDLINE_TENANTS_FILE": str(tenants)},
         "tenant 'acme' may not use"),
        ((*RUN, *bc, "--output", out, "--tenant", "spent", "--priority", "urgent"),
         {"SHARDLINE_TENANTS_FILE": str(tenants)}, "priority 'urgent' is not one of high"),
        ((*RUN, *bc, "--output", out), {"SHARDLINE_BATCH_BATCH_ROWS": "many"},
         "a setting is not valid: SHARDLINE_BATCH_BATCH_ROWS"),
        # settings read as JSON: pydantic-settings' own error named the field, not the variable (or was a traceback)
        ((*RUN, *bc, "--output", out), {"SHARDLINE_STORAGE_STORAGE_OPTIONS": '{"endpoint_url": '},
         "a setting is not valid: SHARDLINE_STORAGE_STORAGE_OPTIONS is not valid JSON (Expecting value"),
        ((*RUN, *bc, "--output", out), {"SHARDLINE_DASK_PREEMPTION_NOTICES": "{"},
         "a setting is not valid: SHARDLINE_DASK_PREEMPTION_NOTICES is not valid JSON"),
        # valid JSON the file system refuses when it sets up its client (s3fs: on first use, not when made)
        ((*RUN, *bc, "--output", "s3://bucket/scored"), {"SHARDLINE_STORAGE_STORAGE_OPTIONS": '{"endpointurl": "x"}'},
         "a setting is not valid: SHARDLINE_STORAGE_STORAGE_OPTIONS (keys endpointurl) were refused by the file "
         "system of s3://bucket/scored (TypeError: AioSession.__init__() got an unexpected keyword argument "
         "'endpointurl'); fix or unset the variable"),
        ((*RUN, *bc, "--output", "s3://bucket/scored"),
         {"SHARDLINE_STORAGE_STORAGE_OPTIONS": '{"client_kwargs": {"region_name": 5}}'},
         "a setting is not valid: SHARDLINE_STORAGE_STORAGE_OPTIONS (keys client_kwargs) were refused by the file "
         "system of s3://bucket/scored ("),
    ]


@pytest.fixture
def busy_output(tmp_path: Path) -> Iterator[Path]:
    """``busy``, held by a live job's lease (this test process)."""
    busy = tmp_path / "busy"
    lease = OutputLease.acquire(fsspec.filesystem("file"), str(busy), str(busy), "job-elsewhere", "breast-cancer:1",
                                LeaseTerms())
    try:
        yield busy
    finally:
        lease.release()


@pytest.mark.usefixtures("local_registry", "busy_output")
def test_wrong_requests_are_refused_before_any_flow_run_with_one_line(
    shardline: Shardline, prefect_api: str, wrong_requests: list[tuple[tuple[str, ...], dict[str, str], str]],
    tmp_path: Path, shardline_home: Path,
) -> None:
    """Checked in the command: no batch runner runs yet, and a wrong request does not start one."""
    refused_before_any_flow_run(shardline, prefect_api, wrong_requests)
    assert not (tmp_path / "out").exists() and not (shardline_home / "runner" / "runner.json").exists()


@pytest.mark.usefixtures("local_registry", "busy_output")
def test_wrong_requests_are_refused_by_a_warm_runner_and_on_the_cold_path_alike(
    shardline: Shardline, prefect_api: str, wrong_requests: list[tuple[tuple[str, ...], dict[str, str], str]],
    tmp_path: Path, shardline_home: Path,
) -> None:
    warm_up = tmp_path / "warm-up"
    write_shards(warm_up, 1, 10)
    started = shardline(*RUN, "breast-cancer@prod", "--input", str(warm_up), "--output", str(tmp_path / "warm-out"))
    assert started.returncode == 0, started.stderr[-3000:]
    runner = find(shardline_home)
    assert runner is not None  # the next requests are checked in the runner (those with other settings: here)

    refused_before_any_flow_run(shardline, prefect_api, wrong_requests)
    again = find(shardline_home)
    assert again is not None and again.pid == runner.pid  # not replaced by a request with another setting
    cold = {"SHARDLINE_BATCH_RUNNER_IDLE_S": "0"}  # each run in a supervised child of its own
    refused_before_any_flow_run(shardline, prefect_api, [(args, {**env, **cold}, message)
                                                         for args, env, message in wrong_requests[::3]])
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("local_registry")
def test_an_output_that_cannot_be_written_is_refused_before_any_flow_run(
    shardline: Shardline, prefect_api: str, tmp_path: Path
) -> None:
    shards, archive = tmp_path / "input", tmp_path / "archive"
    write_shards(shards, 1, 100)
    archive.mkdir()
    with read_only(archive):
        refused_before_any_flow_run(shardline, prefect_api, [
            ((*RUN, "breast-cancer@prod", "--input", str(shards), "--output", str(archive)), {},
             f"the output {archive} cannot be written"),
        ])


@pytest.mark.usefixtures("local_registry")
def test_a_resume_whose_request_went_wrong_since_is_refused_before_any_flow_run(
    shardline: Shardline, prefect_api: str, tmp_path: Path
) -> None:
    shards = tmp_path / "input"
    write_shards(shards, 2, 50)
    first = shardline(*RUN, "breast-cancer@prod", "--input", str(shards), "--output", str(tmp_path / "out"), "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    job = json.loads(first.stdout.strip().splitlines()[-1])["job_id"]
    for shard in shards.iterdir():
        shard.unlink()

    before = flow_runs(prefect_api)
    resumed = shardline("batch", "resume", job)
    assert_refused(resumed, f"the input '{shards}' holds no shard",
                          stdout=f"resuming job {job} (completed, 2/2 shards settled)\n")
    assert flow_runs(prefect_api) == before


@pytest.mark.usefixtures("local_registry")
def test_a_wrong_openai_batch_file_is_refused_before_any_flow_run(
    shardline: Shardline, prefect_api: str, tmp_path: Path, shardline_home: Path
) -> None:
    line = {"method": "POST", "url": "/v1/completions", "body": {"model": "tiny@prod", "prompt": "x"}}
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(json.dumps({**line, "custom_id": "a"}) + "\n" for _ in range(2)))
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({**line, "custom_id": "a"}) + "\n")
    out = str(tmp_path / "answers")
    refused_before_any_flow_run(shardline, prefect_api, [
        (("batch", "openai", str(twice), "--output", out), {}, "custom_id 'a'"),
        (("batch", "openai", str(unknown), "--output", out), {}, "model 'tiny' is not in the registry"),
        (("batch", "openai", str(tmp_path / "none.jsonl"), "--output", out), {}, "does not exist"),
    ])
    assert not (tmp_path / "answers").exists()

    # a right file from a tenant at its budget's hard limit: its lines are metered like a batch job's, so it is
    # new work, refused as `batch run` refuses it
    package_tiny_llm(tmp_path / "tiny", name="tiny")
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(tmp_path / "tiny").version or 1)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: spent\n    batch: {{storage_prefixes: ['{tmp_path}']}}\n"
                       "    budget: {monthly: 100.0}\n")
    write_prices(shardline_home)
    spend(shardline_home, "spent", 120.0)
    refused_before_any_flow_run(shardline, prefect_api, [
        (("batch", "openai", str(unknown), "--output", out, "--tenant", "spent"),
         {"SHARDLINE_TENANTS_FILE": str(tenants)},
         "tenant 'spent' is at its budget's hard limit: new work is refused until the month ends or the budget grows "
         "(spent 120.00 USD of 100.00 USD (120%)"),
    ])
    assert not (tmp_path / "answers").exists()


@pytest.mark.usefixtures("local_registry")
def test_batch_run_and_batch_openai_refuse_each_others_output_folders_and_folders_around_them(
    shardline: Shardline, prefect_api: str, tmp_path: Path, shardline_home: Path
) -> None:
    """A finished `batch run` folder and a finished `batch openai` folder: neither command writes into the other's
    folder, nor into a folder inside either, nor into a folder holding either (the two jobs' files would mix), and
    both folders stay as they were. An output that is or holds the job's own input is refused too."""
    shards, jobs = tmp_path / "input", tmp_path / "jobs"
    scored, answers = jobs / "run" / "scored", jobs / "openai" / "answers"
    write_shards(shards, 1, 100)
    package_tiny_llm(tmp_path / "tiny", name="tiny")
    registry = ModelRegistry(str(shardline_home / "registry"))
    registry.set_alias("tiny", "prod", registry.push(tmp_path / "tiny").version or 1)
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "tiny@prod", "prompt": "x", "max_tokens": 2}}) + "\n")
    ran = shardline(*RUN, "breast-cancer@prod", "--input", str(shards), "--output", str(scored))
    assert ran.returncode == 0, ran.stderr[-3000:]
    answered = shardline("batch", "openai", str(requests), "--output", str(answers))
    assert answered.returncode == 0, answered.stderr[-3000:]

    def files() -> set[Path]:
        return {p for p in jobs.rglob("*") if "_lease" not in p.parts}

    before = files()
    bc = ("breast-cancer@prod", "--input", str(shards))
    holds = "another job's output folder (a `{}` job's: it holds {}); this job's readers would read that job's " \
            "files as its own: choose an --output that holds no other job's folder, or move that folder out of it"
    refused_before_any_flow_run(shardline, prefect_api, [
        (("batch", "openai", str(requests), "--output", str(scored)), {},
         f"the output {scored} is a `batch run` job's output folder (its manifest or ledger); two jobs' files in one "
         "folder would mix them: choose another --output"),
        (("batch", "openai", str(requests), "--output", str(scored / "sub")), {},
         f"the output {scored / 'sub'} is inside {scored}, another job's output folder (a `batch run` job's"),
        ((*RUN, *bc, "--output", str(answers)), {},
         f"the output {answers} is a `batch openai` job's output folder (its _job.json or _parts)"),
        ((*RUN, *bc, "--output", str(answers / "sub")), {},
         f"the output {answers / 'sub'} is inside {answers}, another job's output folder (a `batch openai` job's"),
        # an output holding another job's folder: this job's readers would read that job's files as its own
        ((*RUN, *bc, "--output", str(scored.parent)), {},
         f"the output {scored.parent} holds {scored}, " + holds.format("batch run", "its manifest or ledger")),
        (("batch", "openai", str(requests), "--output", str(answers.parent)), {},
         f"the output {answers.parent} holds {answers}, " + holds.format("batch openai", "its _job.json or _parts")),
        ((*RUN, *bc, "--output", str(jobs)), {}, f"the output {jobs} holds {answers}, another job's output folder"),
        (("batch", "openai", str(requests), "--output", str(jobs)), {},
         f"the output {jobs} holds {answers}, another job's output folder"),
        # the job's own input: the output may be neither it nor a folder holding it
        ((*RUN, *bc, "--output", str(shards)), {}, f"the output '{shards}' is the input '{shards}'"),
        ((*RUN, *bc, "--output", str(tmp_path)), {}, f"the output '{tmp_path}' holds the input '{shards}'"),
        (("batch", "openai", str(requests), "--output", str(tmp_path)), {},
         f"the output '{tmp_path}' holds the input '{requests}'"),
    ])
    assert files() == before


@pytest.mark.usefixtures("local_registry")
def test_a_link_in_the_input_out_of_the_tenants_prefixes_is_one_line_and_exit_2(
    shardline: Shardline, tmp_path: Path
) -> None:
    lake = Path(os.path.realpath(tmp_path / "lake"))
    write_shards(lake / "acme" / "in", 1, 100)
    write_shards(lake / "globex" / "in", 1, 100)
    (lake / "acme" / "in" / "theirs.parquet").symlink_to(lake / "globex" / "in" / "part-00000.parquet")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: acme\n    batch: {{storage_prefixes: ['{lake / 'acme'}']}}\n")

    refused = shardline("batch", "run", "--model", "breast-cancer@prod", "--input", str(lake / "acme" / "in"),
                        "--output", str(lake / "acme" / "out"), "--tenant", "acme", SHARDLINE_TENANTS_FILE=str(tenants))

    assert_one_error_line(refused, f"the link '{lake}/acme/in/theirs.parquet' in the input leads to "
                                   f"'{lake}/globex/in/part-00000.parquet', outside the tenant's storage prefixes")
    assert not (lake / "acme" / "out").exists()


@pytest.mark.usefixtures("local_registry")
def test_a_rollout_promotion_or_release_of_what_is_not_there_is_one_line_and_exit_2(shardline: Shardline) -> None:
    """Found before any flow starts: no failed run, no traceback."""
    cases = [
        (shardline("rollout", "start", "breast-cancer", "--candidate", "breast-cancer:7", "--steps", "5,100"),
         "model 'breast-cancer' has no version 7"),
        (shardline("rollout", "start", "breast-cancer", "--candidate", "1", "--steps", "5,100"),
         "breast-cancer:1 is what breast-cancer@prod points at already"),
        (shardline("rollout", "start", "breast-cancer", "--candidate", "1", "--alias", "staging", "--shadow", "5%"),
         "breast-cancer@staging was never set, so there is no baseline"),
        (shardline("rollout", "start", "breast-cancer", "--candidate", "1", "--steps", "50,5"),
         "steps '50,5' are not rising percents"),
        (shardline("rollout", "start", "breast-cancer", "--candidate", "churn:1", "--steps", "5,100"),
         "the candidate 'churn:1' is not a version of 'breast-cancer'; write breast-cancer:VERSION"),
        (shardline("rollout", "start", "breast-cancer", "--candidate", "²", "--steps", "5,100"),
         "the candidate '²' is not a version of 'breast-cancer'"),
        (shardline("rollout", "promote", "breast-cancer"), "no rollout runs on breast-cancer@prod"),
        (shardline("rollout", "abort", "breast-cancer@staging"), "no rollout runs on breast-cancer@staging"),
        (shardline("rollout", "status", "breast-cancer:1"), "'breast-cancer:1' names a version; this command takes an "
                                                            "alias: give the model as breast-cancer or breast-cancer@ALIAS"),
        # an unknown model is said as such by every rollout command, as `rollout start` and `drift check` say it
        (shardline("rollout", "start", "nosuch", "--candidate", "1", "--steps", "5,100"),
         "model 'nosuch' is not in the registry"),
        (shardline("rollout", "status", "nosuch"), "model 'nosuch' is not in the registry"),
        (shardline("rollout", "abort", "nosuch"), "model 'nosuch' is not in the registry"),
        (shardline("rollout", "promote", "nosuch"), "model 'nosuch' is not in the registry"),
        (shardline("model", "promote", "churn:2", "--to", "prod"), "model 'churn' is not in the registry"),
        (shardline("model", "release", "breast-cancer:7"), "model 'breast-cancer' has no version 7"),
        (shardline("model", "release", "breast-cancer"), "the candidate 'breast-cancer' is not name:version"),
        (shardline("model", "release", "breast-cancer:x"), "the version 'x' is not a number"),
    ]
    for finished, message in cases:
        assert_one_error_line(finished, message)


def test_a_rollout_option_out_of_its_range_is_one_line_naming_it_before_any_flow_run(
    shardline: Shardline, prefect_api: str, local_registry: ModelRegistry, tmp_path: Path
) -> None:
    """Each limit said with the option's range (as `--steps 50,25` and `--shadow 200%` are), not a pydantic
    traceback from the steps' warning or from the flow, and no gate, replay or flow run made."""
    assert local_registry.push(breast_cancer_bundle(tmp_path / "v2", "breast-cancer", "logreg")).version == 2
    start = ("rollout", "start", "breast-cancer", "--candidate", "breast-cancer:2")
    canary, shadow = (*start, "--steps", "25,100"), (*start, "--shadow", "10%")
    refused_before_any_flow_run(shardline, prefect_api, [
        ((*canary, "--min-requests", "0"), {}, "--min-requests 0 is out of range: it must be at least 1 (default 50)"),
        ((*canary, "--min-requests", "-5"), {}, "--min-requests -5 is out of range: it must be at least 1"),
        ((*canary, "--max-error-increase", "-1"), {},
         "--max-error-increase -1 is out of range: it must be at least 0 and at most 1 (default 0.01)"),
        ((*canary, "--max-p99-ratio", "0"), {}, "--max-p99-ratio 0 is out of range: it must be at least 1 (default 1.5)"),
        ((*shadow, "--max-disagreement", "2"), {},
         "--max-disagreement 2 is out of range: it must be at least 0 and at most 1 (default 0.01)"),
        ((*start, "--steps", ""), {}, "steps '' are not rising percents in (0, 100]; write e.g. 1,5,25,100"),
        (("model", "release", "breast-cancer:2", "--min-requests", "0"), {}, "--min-requests 0 is out of range"),
    ])
    assert local_registry.current_move("breast-cancer", "prod").rollout is None  # type: ignore[union-attr]
