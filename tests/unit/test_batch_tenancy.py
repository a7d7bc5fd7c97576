"""The one tenants file's batch side, storage isolation, the metering ledger, GPU quotas and job records."""

from __future__ import annotations

import subprocess
import sys
import uuid
from functools import partial
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardline.errors import AccessDenied, InvalidSetting, QuotaExceeded
from shardline.online.tenants import TenantDirectory, hash_api_key, load_tenants
from shardline.settings import TenancySettings
from shardline.storage.job_records import JobParameters, JobRecord, JobRecords
from shardline.storage.ledger import Holding, LedgerStore
from shardline.tasks.fairness import check_gpu_quota, has_cuda_provider, limit_names, priority_of
from shardline.storage.fs import resolve_location
from shardline.tenants import (
    BatchPolicy,
    BatchTenant,
    batch_tenant,
    check_locations,
    load_tenants_file,
    parse_tenants_file,
)

KEY = "sk-acme-0123456789"


def tenants_file(tmp_path: Path) -> Path:
    config = {"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": ["bc@prod"],
         "batch": {"storage_prefixes": ["s3://lake/acme/", str(tmp_path / "acme")], "max_concurrent_shards": 8}},
        {"name": "globex", "batch": {"storage_prefixes": ["s3://lake/globex"], "priority": "low",
                                     "gpu_hours_per_day": 2}},
        {"name": "online-only", "api_keys_sha256": [hash_api_key("sk-other-0123456789")], "models": ["bc@prod"]},
    ]}
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_one_file_serves_both_tiers(tmp_path: Path) -> None:
    path = tenants_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    # the online tier: the batch-only tenant is accepted and not served; keys still work
    directory = TenantDirectory.from_config(data)
    assert set(directory.tenants) == {"acme", "online-only"}
    assert directory.authenticate(f"Bearer {KEY}").name == "acme"
    # the batch side
    acme = batch_tenant(str(path), "acme")
    assert acme is not None and acme.policy.max_concurrent_shards == 8 and acme.policy.priority == "normal"
    globex = batch_tenant(str(path), "globex")
    assert globex is not None and globex.policy.gpu_hours_per_day == 2
    assert batch_tenant(None, "anyone") is None  # no file: single-tenant development mode


def test_a_tenant_the_file_does_not_allow_to_run_batch_is_refused(tmp_path: Path) -> None:
    path = str(tenants_file(tmp_path))
    with pytest.raises(AccessDenied, match=r"tenant 'initech' is not in the tenants file .*tenants: acme, globex"):
        batch_tenant(path, "initech")
    with pytest.raises(AccessDenied, match="tenant 'online-only' has no batch: section"):
        batch_tenant(path, "online-only")


@pytest.mark.parametrize(("section", "message"), [
    ({}, r"tenants\[0\]\.batch\.storage_prefixes: Field required"),
    ({"storage_prefixes": []}, r"storage_prefixes: .*at least 1"),
    ({"storage_prefixes": ["/"]}, r"entry 0 \('/'\) is empty or the root"),
    ({"storage_prefixes": ["/d"], "priority": "urgent"}, r"batch\.priority: .*got 'urgent'"),
    ({"storage_prefixes": ["/d"], "max_concurrent_shards": 0}, r"max_concurrent_shards: .*greater than or equal to 1"),
    ({"storage_prefixes": ["/d"], "gpu_hours": 3}, r"batch\.gpu_hours: Extra inputs"),
])
def test_a_bad_batch_section_is_refused_naming_the_field(section: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSetting, match=message):
        parse_tenants_file({"tenants": [{"name": "acme", "batch": section}]}, "t.yaml")


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "acme", "batch": {"storage_prefixes": ["/d"], "priority": "urgent"}},
     r"tenants\[0\]\.batch\.priority: .*got 'urgent'"),
    ({"name": "acme", "api_keys_sha256": [hash_api_key(KEY)], "models": ["bc@prod"], "rate": {"burst": 1},
      "batch": {"storage_prefixes": ["/d"]}}, r"tenants\[0\]\.rate\.requests_per_second: Field required"),
])
def test_both_tiers_refuse_a_bad_file_with_the_same_message(tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [entry]}))
    with pytest.raises(InvalidSetting, match=message) as online:
        load_tenants(path)
    with pytest.raises(InvalidSetting, match=message) as batch:
        batch_tenant(str(path), "acme")  # a wrong online field stops a batch job too: one file, one check
    assert str(online.value) == str(batch.value)


def test_one_read_gives_both_views(tmp_path: Path) -> None:
    parsed = load_tenants_file(tenants_file(tmp_path))
    assert [t.name for t in parsed.served()] == ["acme", "online-only"]
    views = parsed.batch_tenants()
    assert views["online-only"] is None and views["globex"] is not None and views["globex"].policy.priority == "low"
    assert set(TenantDirectory.from_file(parsed).tenants) == {"acme", "online-only"}
    with pytest.raises(InvalidSetting, match=r"cannot be read .*SHARDLINE_TENANTS_FILE .*serve --tenants"):
        load_tenants_file(tmp_path / "missing.yaml")


def test_the_online_tier_still_needs_models_for_keys_and_keys_or_batch(tmp_path: Path) -> None:
    with pytest.raises(InvalidSetting, match="models: list at least one model"):
        TenantDirectory.from_config({"tenants": [{"name": "a", "api_keys_sha256": [hash_api_key(KEY)]}]})
    with pytest.raises(InvalidSetting, match="give the tenant an API key, or a batch: section"):
        TenantDirectory.from_config({"tenants": [{"name": "a", "models": ["bc@prod"]}]})


def test_the_batch_setting_falls_back_to_the_online_tenants_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDLINE_ONLINE_TENANTS_FILE", "/etc/shardline/online.yaml")
    assert TenancySettings().tenants_file == "/etc/shardline/online.yaml"
    monkeypatch.setenv("SHARDLINE_TENANTS_FILE", "/etc/shardline/tenants.yaml")
    assert TenancySettings().tenants_file == "/etc/shardline/tenants.yaml"


def test_isolation_names_the_role_and_the_prefixes() -> None:
    acme = BatchTenant("acme", BatchPolicy(storage_prefixes=["s3://lake/acme/"]))
    resolve = partial(resolve_location, storage_options=None)
    assert check_locations(acme, {"input": "s3://lake/acme/in/", "output": "s3a://lake/acme/out"}, resolve) == {
        "input": "s3://lake/acme/in", "output": "s3://lake/acme/out"}
    with pytest.raises(AccessDenied, match=r"tenant 'acme' may not use 's3://lake/globex/out' as its output: .*"
                                           r"storage prefixes \('s3://lake/acme/'\)"):
        check_locations(acme, {"input": "s3://lake/acme/in", "output": "s3://lake/globex/out"}, resolve)


def memory_home() -> str:
    return f"memory://home-{uuid.uuid4().hex[:8]}"


def record(ledger: LedgerStore, tenant: str, job: str, device: str, seconds: float, when: datetime) -> None:
    ledger.record_batch(Holding("batch", device), tenant, "m", "1", job, when, {"device_seconds": seconds},
                        reserved_seconds=seconds, window_seconds=seconds)


def test_metering_sums_device_hours_per_tenant_per_utc_day() -> None:
    ledger = LedgerStore(memory_home())
    day = datetime(2026, 12, 1, 23, 30, tzinfo=timezone.utc)
    record(ledger, "acme", "j1", "gpu", 1800, day)
    record(ledger, "acme", "j2", "h100-mig-3g.40gb", 3600, day)  # a MIG slice is GPU time too
    record(ledger, "acme", "j3", "cpu", 7200, day)
    record(ledger, "acme", "j4", "gpu", 3600, day + timedelta(hours=1))  # the next UTC day
    record(ledger, "globex", "j5", "gpu", 3600, day)
    assert ledger.device_hours("acme", day.date(), "gpu") == 1.5
    assert ledger.device_hours("acme", day.date(), "cpu") == 2.0
    assert ledger.device_hours("acme", (day + timedelta(hours=1)).date()) == 1.0
    assert ledger.device_hours("initech", day.date()) == 0.0
    assert ledger.device_hours("acme", day.date(), "gpu", tier="online") == 0.0


def test_gpu_quota_refuses_with_what_was_used_and_what_to_do() -> None:
    ledger = LedgerStore(memory_home())
    globex = BatchTenant("globex", BatchPolicy(storage_prefixes=["/d"], gpu_hours_per_day=2))
    now = datetime(2026, 12, 1, 12, tzinfo=timezone.utc)
    record(ledger, "globex", "j1", "gpu", 5400, now)
    check_gpu_quota(ledger, globex, "gpu", now)  # 1.5 of 2 h: still allowed
    record(ledger, "globex", "j2", "gpu", 1800, now)
    with pytest.raises(QuotaExceeded, match=r"tenant 'globex' has used 2.00 of its 2 GPU-hours for 2026-12-01 "
                                            r"\(UTC\); the job was not started.*SHARDLINE_RUNTIME_DEVICE=cpu") as e:
        check_gpu_quota(ledger, globex, "gpu", now)
    assert (e.value.used, e.value.limit) == (2.0, 2)
    check_gpu_quota(ledger, globex, "cpu", now)  # CPU jobs do not spend GPU-hours
    check_gpu_quota(ledger, globex, "gpu", now + timedelta(days=1))  # a new day


def test_the_device_of_an_auto_job_is_found_without_importing_onnxruntime(tmp_path: Path) -> None:
    """The process that admits jobs (the warm runner) lives long: it learns whether onnxruntime has CUDA from
    the package's files, as onnxruntime's own provider list says, and does not carry onnxruntime for it."""
    script = ("import sys; from shardline.settings import RuntimeSettings; from shardline.tasks.fairness import "
              "device_kind; kind = device_kind(RuntimeSettings(device='auto')); "
              "imported = 'onnxruntime' in sys.modules; import onnxruntime; "
              "print(kind, imported, onnxruntime.get_available_providers())")
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True).stdout.split(" ", 2)
    assert found[1] == "False"  # onnxruntime was not imported for it
    assert found[0] == ("gpu" if "CUDAExecutionProvider" in found[2] else "cpu")  # and it agrees with onnxruntime
    gpu_build = tmp_path / "onnxruntime"
    (gpu_build / "capi").mkdir(parents=True)
    (gpu_build / "capi" / "libonnxruntime_providers_shared.so").touch()
    assert not has_cuda_provider([str(gpu_build)])
    (gpu_build / "capi" / "libonnxruntime_providers_cuda.so").touch()  # what onnxruntime-gpu carries
    assert has_cuda_provider([str(tmp_path / "elsewhere"), str(gpu_build)])


def test_priority_and_limit_names() -> None:
    globex = BatchTenant("globex", BatchPolicy(storage_prefixes=["/d"], priority="low"))
    assert priority_of(globex, None) == "low" and priority_of(globex, "high") == "high"
    assert priority_of(None, None) == "normal"
    with pytest.raises(InvalidSetting, match="priority 'urgent' is not one of high, normal, low"):
        priority_of(None, "urgent")
    assert limit_names("globex", "low") == ("shardline-batch-priority-low", "shardline-batch-tenant-globex")


def test_job_records_are_found_by_id_or_prefix() -> None:
    records = JobRecords(memory_home())
    now = datetime(2026, 12, 1, 2, tzinfo=timezone.utc)
    for job_id in ("abc123", "abd456"):
        records.write(JobRecord(job_id=job_id, started_at=now, deadline=now + timedelta(hours=2),
                                parameters=JobParameters(model="bc@prod", input_uri="/i", output_uri="/o")))
    assert records.read("abc").job_id == "abc123" and records.read("abd456").job_id == "abd456"
    assert sorted(records.ids()) == ["abc123", "abd456"]
    with pytest.raises(InvalidSetting, match="job 'ab' matches 2 jobs"):
        records.read("ab")
    with pytest.raises(InvalidSetting, match="no job 'zz' under .*known jobs"):
        records.read("zz")
    record = records.read("abc123")
    record.state, record.shards_done = "completed", 7
    records.write(record)
    assert records.read("abc123").shards_done == 7


def test_the_same_input_written_to_two_outputs_is_two_jobs() -> None:
    from shardline.storage.job_identity import job_id
    from shardline.storage.shards import ShardInfo

    shards = [ShardInfo("s3://lake/in/a.parquet", "a.parquet", 10, "10:x")]
    assert job_id("key", shards, "s3://lake/acme/out") == job_id("key", shards, "s3://lake/acme/out/")
    assert job_id("key", shards, "s3://lake/acme/out") != job_id("key", shards, "s3://lake/globex/out")
