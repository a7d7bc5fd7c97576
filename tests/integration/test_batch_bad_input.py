"""Bad input through the whole flow: quarantined with its reason, or refused early."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from shardline.errors import EmptyInput, InvalidSetting, ModelNotFound
from shardline.flows.batch_inference import batch_inference
from shardline.storage.job_records import JobRecords

pytestmark = pytest.mark.usefixtures("on_cluster", "local_registry")


def run(input_uri: Path | str, output_uri: Path | str, model: str = "breast-cancer@prod"):  # type: ignore[no-untyped-def]
    return batch_inference(model=model, input_uri=str(input_uri), output_uri=str(output_uri), return_state=True)


def _write_nulls_shard(input_shards: Path) -> None:
    """``nulls.parquet``: the first shard with a null in row 10 of a feature column (quarantined as a whole)."""
    good = pq.read_table(input_shards / "part-00000.parquet")
    radius = good.column("mean radius").to_pylist()
    radius[10] = None
    index = good.schema.get_field_index("mean radius")
    pq.write_table(good.set_column(index, "mean radius", pa.array(radius)), input_shards / "nulls.parquet")


def test_bad_shards_are_quarantined_and_the_rest_completes(input_shards: Path, tmp_path: Path) -> None:
    good = pq.read_table(input_shards / "part-00000.parquet")
    (input_shards / "corrupt.parquet").write_bytes(b"this is not parquet at all")
    pq.write_table(good.drop_columns(["mean texture"]), input_shards / "wrong-schema.parquet")
    _write_nulls_shard(input_shards)
    out = tmp_path / "out"

    state = run(input_shards, out)

    assert state.is_completed() and state.name == "Quarantined"
    assert "3 of 9 shards quarantined" in (state.message or "")
    summary = state.result()
    assert (summary["shards_committed"], summary["shards_quarantined"]) == (6, 3)
    assert summary["rows_out"] == 12_000 and summary["rows_quarantined"] == 4_000
    assert summary["rows_in"] == summary["rows_out"] + summary["rows_quarantined"]
    manifest = json.loads((out / "_manifest.json").read_text())
    reasons = {Path(q["shard"]).name: q["reason"] for q in manifest["quarantined"]}
    assert reasons["corrupt.parquet"].startswith("CorruptShard:")
    assert "column 'mean texture' is missing" in reasons["wrong-schema.parquet"]
    # the data contract (on the first rows, before scoring) or the per-batch null check names it
    assert "'mean radius'" in reasons["nulls.parquet"] and "null" in reasons["nulls.parquet"]
    # the six good shards are all there, once each; nothing from the bad ones
    scored = ds.dataset(out).to_table()
    assert scored.num_rows == 12_000 and len(set(scored.column("id").to_pylist())) == 12_000
    assert not (out / "nulls.parquet").exists()

    # a re-run settles nothing again: quarantined shards stay quarantined, parts stay
    again = run(input_shards, out)
    assert again.name == "Quarantined" and again.result()["shards_skipped"] == 9


def test_every_shard_quarantined_fails_the_run(input_shards: Path, tmp_path: Path, shardline_home: Path) -> None:
    for shard in input_shards.glob("*.parquet"):
        pq.write_table(pq.read_table(shard).drop_columns(["mean area"]), shard)

    state = run(input_shards, tmp_path / "out")

    assert state.is_failed()
    assert "every shard was quarantined" in (state.message or "")
    summary = state.result(raise_on_failure=False)
    assert summary["rows_out"] == 0
    # `batch status` reads the job record: quarantined (the data; a re-run will not help), not failed (a fault
    # that `batch resume` mends)
    record = JobRecords(str(shardline_home)).read(summary["job_id"])
    assert record.state == "quarantined" and "running again will not help" in (record.message or "")


@pytest.mark.parametrize(
    "model, input_name, error, message",
    [
        ("churn@prod", "input", ModelNotFound, "model 'churn' is not in the registry"),
        ("breast-cancer@canary", "input", ModelNotFound, "has no alias 'canary'"),
        ("breast-cancer@prod", "empty", EmptyInput, "holds no shard"),
        ("breast-cancer@prod", "missing", InvalidSetting, "does not exist; check the path"),
    ],
)
def test_wrong_requests_fail_fast_and_write_nothing(
    input_shards: Path, tmp_path: Path, model: str, input_name: str, error: type, message: str
) -> None:
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"

    state = run(tmp_path / input_name, out, model=model)

    assert state.is_failed()
    raised = state.result(raise_on_failure=False)
    assert isinstance(raised, error) and message in str(raised)
    assert not out.exists()


def test_a_user_error_the_flow_itself_finds_is_one_line_with_its_records_at_debug(
    input_shards: Path, tmp_path: Path
) -> None:
    """`batch run` checks a request before it starts a flow run; the flow checks again (a deployment's run, or
    what changed in between). What it finds then reaches the command as one line, exit 2: Prefect's ERROR
    records of the failed task and flow run (tracebacks) go to DEBUG (``_cli_common.one_line_user_errors``)."""
    import logging

    from shardline.cli.batch_jobs import JobRequest, execute

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    seen = Seen()
    loggers = [logging.getLogger(name) for name in ("prefect.task_runs", "prefect.flow_runs")]
    for logger in loggers:
        logger.addHandler(seen)
    try:
        outcome = execute(JobRequest(model="churn@prod", input_uri=str(input_shards), output_uri=str(tmp_path / "o")))
    finally:
        for logger in loggers:
            logger.removeHandler(seen)

    assert outcome.code == 2 and outcome.summary is None
    assert outcome.error is not None and outcome.error.startswith("model 'churn' is not in the registry")
    assert any("Beginning flow run" in r.getMessage() for r in seen.records)  # the handler hears the run's lines
    assert not [r for r in seen.records if r.levelno >= logging.ERROR], [r.getMessage() for r in seen.records]
    assert not (tmp_path / "o").exists()


def test_a_quarantined_shard_is_not_billed(input_shards: Path, tmp_path: Path, shardline_home: Path) -> None:
    from datetime import datetime, timezone

    from shardline.capacity.prices import load_prices
    from shardline.cost.report import build_report
    from shardline.storage.ledger import LedgerStore

    _write_nulls_shard(input_shards)
    out = tmp_path / "out"

    state = run(input_shards, out)

    assert state.name == "Quarantined" and state.result()["shards_quarantined"] == 1
    records = [json.loads(p.read_text()) for p in (out / "_ledger").rglob("*.json")]
    committed = sum(r["seconds"] for r in records if r["status"] == "committed")
    quarantined = [r for r in records if r["status"] == "quarantined"]
    assert len(quarantined) == 1 and quarantined[0]["seconds"] > 0  # it took time on a worker ...
    month = datetime.now(timezone.utc).strftime("%Y-%m")
    metered = LedgerStore(str(shardline_home)).read(month).to_pylist()
    use = [r for r in metered if r["kind"] == "usage"]
    # ... and is not billed: the ledger holds the committed shards' seconds and rows, no more
    assert [(r["tier"], r["rows"]) for r in use] == [("batch", 12_000)]
    assert use[0]["device_seconds"] == pytest.approx(committed, rel=1e-6)
    assert use[0]["cpu_seconds"] == pytest.approx(committed, rel=1e-6)
    report = build_report(metered, load_prices(), month)  # the chargeback prices those seconds only
    assert [line.spend.device_seconds for line in report.lines] == [pytest.approx(committed, rel=1e-6)]
