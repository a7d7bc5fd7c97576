"""The online tier's pure decisions: token buckets, shedding, unloading, tenants, batch limits, the status table."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from shardline.errors import (
    IntegrityError,
    InvalidInput,
    InvalidSetting,
    ModelNotFound,
    NotServed,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    RuntimeUnavailable,
    SchemaMismatch,
    Unauthenticated,
    UnsupportedEncoding,
)
from shardline.online.admission import TokenBucket, admits, asked_timeout_s, drain_seconds, retry_after, should_unload
from shardline.online.errors import error_status
from shardline.online.models import batch_limits, batch_size_from_profile
from shardline.online.tenants import TenantDirectory, hash_api_key, load_tenants
from shardline.settings import ModelServing, OnlineSettings

KEY = "sk-acme-0123456789"


def tenants_config(**overrides: Any) -> dict[str, Any]:
    tenant = {
        "name": "acme",
        "api_keys_sha256": [hash_api_key(KEY)],
        "models": ["breast-cancer@prod", "minilm@prod"],
        "priority": "high",
        "rate": {"requests_per_second": 200, "burst": 400},
        "max_concurrent": 64,
    }
    tenant.update(overrides)
    return {"tenants": [tenant]}


# -- token bucket ---------------------------------------------------------------------------------
def test_a_new_tenant_may_burst_then_waits_for_the_refill() -> None:
    bucket = TokenBucket(rate=2.0, burst=3)
    assert [bucket.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(10.0) == pytest.approx(0.5)  # one token comes back every 1/rate seconds
    assert bucket.take(10.25) == pytest.approx(0.25)
    assert bucket.take(10.5) == 0.0 and bucket.tokens == pytest.approx(0.0)


def test_a_quiet_bucket_refills_only_up_to_its_burst() -> None:
    bucket = TokenBucket(rate=100.0, burst=5)
    assert bucket.take(0.0) == 0.0
    assert bucket.take(3600.0) == 0.0 and bucket.tokens == pytest.approx(4.0)


def test_a_clock_that_steps_back_does_not_mint_tokens() -> None:
    bucket = TokenBucket(rate=1.0, burst=1)
    assert bucket.take(5.0) == 0.0
    assert bucket.take(4.0) == pytest.approx(1.0)
    assert bucket.take(5.5) == pytest.approx(0.5)  # refilled from 5.0, the latest time seen, not from 4.0


def test_a_bucket_without_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="rate > 0 and burst >= 1"):
        TokenBucket(rate=0.0, burst=1)


# -- shedding and unloading -----------------------------------------------------------------------
def test_overload_sheds_low_first_then_normal_and_high_only_when_full() -> None:
    capacity = 100
    assert [admits(q, capacity, "low") for q in (0, 49, 50)] == [True, True, False]
    assert [admits(q, capacity, "normal") for q in (50, 79, 80)] == [True, True, False]
    assert [admits(q, capacity, "high") for q in (80, 99, 100)] == [True, True, False]
    assert admits(0, 1, "low") and not admits(1, 1, "high")  # a tiny queue still takes one request


def test_retry_after_is_whole_seconds_from_the_measured_drain_rate() -> None:
    assert retry_after(drain_seconds(5_000, 2_000.0)) == 3
    assert retry_after(drain_seconds(10, 1e6)) == 1
    assert retry_after(drain_seconds(10, None)) == 1
    assert retry_after(float("inf")) == 60


def test_only_a_loaded_idle_model_past_its_timeout_is_unloaded() -> None:
    assert should_unload(idle_seconds=31, idle_timeout=30, busy=False, loaded=True)
    assert not should_unload(idle_seconds=29, idle_timeout=30, busy=False, loaded=True)
    assert not should_unload(idle_seconds=31, idle_timeout=30, busy=True, loaded=True)
    assert not should_unload(idle_seconds=31, idle_timeout=30, busy=False, loaded=False)
    assert not should_unload(idle_seconds=1e9, idle_timeout=0, busy=False, loaded=True)  # 0: never


# -- tenants --------------------------------------------------------------------------------------
def test_a_key_authenticates_its_tenant_and_nothing_else_does() -> None:
    directory = TenantDirectory.from_config(tenants_config())
    tenant = directory.authenticate(f"Bearer {KEY}")
    assert (tenant.name, tenant.priority, tenant.max_concurrent) == ("acme", "high", 64)
    assert str(tenant.reference_for("breast-cancer")) == "breast-cancer@prod"
    assert tenant.reference_for("churn") is None
    assert directory.authenticate(f"bearer   {KEY}  ").name == "acme"
    with pytest.raises(Unauthenticated, match="no API key was sent"):
        directory.authenticate(None)
    with pytest.raises(Unauthenticated, match="not 'Bearer <key>'"):
        directory.authenticate(f"Basic {KEY}")
    with pytest.raises(Unauthenticated, match="the API key is not valid") as refused:
        directory.authenticate("Bearer sk-acme-0123456780")
    assert "sk-acme" not in str(refused.value)  # a key is never echoed


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"api_keys_sha256": ["sk-plain-key"]}, r"tenants\[0\]\.api_keys_sha256: .*not a hex sha256 digest"),
        ({"priority": "urgent"}, r"tenants\[0\]\.priority: .*'high', 'normal' or 'low'.*got 'urgent'"),
        ({"rate": {"requests_per_second": 0, "burst": 1}}, r"tenants\[0\]\.rate\.requests_per_second: .*greater than 0"),
        ({"rate": {"requests_per_second": 5}}, r"tenants\[0\]\.rate\.burst: Field required"),
        ({"max_concurrent": 0}, r"tenants\[0\]\.max_concurrent: .*greater than or equal to 1"),
        ({"models": ["Bad Name@prod"]}, r"tenants\[0\]\.models: .*entry 0: model name 'Bad Name' is not allowed"),
        ({"models": ["bc@prod", "bc@staging"]}, r"tenants\[0\]\.models: .*names model 'bc' again"),
        ({"modles": ["bc@prod"]}, r"tenants\[0\]\.modles: Extra inputs are not permitted"),
    ],
)
def test_a_bad_tenants_file_is_refused_naming_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSetting, match=message):
        TenantDirectory.from_config(tenants_config(**overrides))


def test_tenant_names_and_keys_are_unique(tmp_path: Any) -> None:
    config = tenants_config()
    config["tenants"].append({**config["tenants"][0], "name": "globex"})
    with pytest.raises(InvalidSetting, match="one API key digest is listed for both 'acme' and 'globex'"):
        TenantDirectory.from_config(config)
    config["tenants"][1] = {**config["tenants"][0], "api_keys_sha256": [hashlib.sha256(b"x").hexdigest()]}
    with pytest.raises(InvalidSetting, match="tenant name 'acme' appears twice"):
        TenantDirectory.from_config(config)


def test_a_tenants_file_that_is_missing_or_not_yaml_says_so(tmp_path: Any) -> None:
    with pytest.raises(InvalidSetting, match="cannot be read .*SHARDLINE_ONLINE_TENANTS_FILE"):
        load_tenants(tmp_path / "missing.yaml")
    (tmp_path / "t.yaml").write_text("tenants: [name: {")
    with pytest.raises(InvalidSetting, match="is not valid YAML"):
        load_tenants(tmp_path / "t.yaml")
    (tmp_path / "t.yaml").write_text("tenants: []\n")
    with pytest.raises(InvalidSetting, match="tenants: List should have at least 1 item"):
        load_tenants(tmp_path / "t.yaml")


# -- batch limits ---------------------------------------------------------------------------------
PROFILE = {"batches": [
    {"batch_size": 1, "p99_ms": 0.05}, {"batch_size": 64, "p99_ms": 0.9},
    {"batch_size": 512, "p99_ms": 6.0}, {"batch_size": 4096, "p99_ms": 40.0},
]}


def test_the_profile_picks_the_largest_batch_within_the_latency_budget() -> None:
    assert batch_size_from_profile(PROFILE, budget_ms=10.0) == 512
    assert batch_size_from_profile(PROFILE, budget_ms=1.0) == 64
    assert batch_size_from_profile(PROFILE, budget_ms=0.01) is None
    assert batch_size_from_profile(None, budget_ms=10.0) is None


def test_an_override_beats_the_profile_which_beats_the_defaults() -> None:
    settings = OnlineSettings(max_batch_size=32, max_batch_wait_ms=2, queue_capacity=100, idle_timeout_s=60,
                              models={"minilm": ModelServing(max_batch_size=8, idle_timeout_s=0)})
    limits, idle = batch_limits("minilm", settings, PROFILE)
    assert (limits.max_batch_size, limits.max_wait_s, limits.queue_capacity, idle) == (8, 0.002, 100, 0)
    limits, idle = batch_limits("breast-cancer", settings, PROFILE)
    assert (limits.max_batch_size, idle) == (512, 60)
    assert batch_limits("breast-cancer", settings, None)[0].max_batch_size == 32


def test_online_settings_refuse_bad_model_names_and_limits() -> None:
    with pytest.raises(ValueError, match="model name 'Not OK' is not allowed"):
        OnlineSettings(models={"Not OK": ModelServing()})
    with pytest.raises(ValueError, match="max_batch_size"):
        OnlineSettings(max_batch_size=0)


# -- the status table -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("error", "status"),
    [
        (Unauthenticated("x"), 401),
        (ModelNotFound("x", "m"), 404),
        (PayloadTooLarge("x", 10), 413),
        (UnsupportedEncoding("x"), 415),
        (SchemaMismatch("x", ["x"]), 400),
        (InvalidInput("x"), 400),
        (NotServed("x"), 501),
        (RuntimeUnavailable("x"), 503),
        (IntegrityError("x", "p", "a", "b"), 500),
        (ValueError("x"), 500),
    ],
)
def test_each_error_has_one_status(error: BaseException, status: int) -> None:
    assert error_status(error) == (status, {})


def test_quota_and_shedding_answers_carry_retry_after() -> None:
    assert error_status(RateLimited("x", "acme", 0.2)) == (429, {"Retry-After": "1"})
    assert error_status(Overloaded("x", 2.5)) == (503, {"Retry-After": "3"})


@pytest.mark.parametrize(("value", "seconds"), [
    ("250", 0.25), ("1.5", 0.0015), (None, None), ("", None), ("0", None), ("-40", None), ("inf", None),
    ("nan", None), ("soon", None),
])
def test_a_timeout_header_asks_for_positive_finite_milliseconds_or_counts_as_absent(
    value: str | None, seconds: float | None
) -> None:
    assert asked_timeout_s(value) == seconds
