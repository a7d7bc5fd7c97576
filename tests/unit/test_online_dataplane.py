"""The data plane without any protocol or socket: tenant, reference and Arrow rows in, rows out."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from shardline.errors import InvalidInput, ModelNotFound, NullValues, SchemaMismatch
from shardline.online.dataplane import DataPlane
from shardline.rows import check_rows
from shardline.online.logs import (
    ACCESS_LOGGER,
    CURRENT,
    BufferedLineHandler,
    JsonFormatter,
    RequestInfo,
    log_config,
    request_id_from,
)
from shardline.online.tenants import TenantDirectory, hash_api_key
from shardline.runtimes import RuntimeOptions
from shardline.settings import OnlineSettings
from shardline.storage.model_cache import ModelCache
from shardline.storage.registry import ModelRegistry

from tests.conftest import BuiltModel


def features(model: BuiltModel, rows: slice) -> pa.Table:
    return pa.table({n: model.data.features[rows, j] for j, n in enumerate(model.data.names)})


@pytest.fixture
def plane(local_registry: ModelRegistry, tmp_path: Path) -> DataPlane:
    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key("k")], "models": ["breast-cancer@prod"]},
    ]})
    return DataPlane(OnlineSettings(idle_timeout_s=60), local_registry, ModelCache(tmp_path / "cache"), tenants,
                     RuntimeOptions("cpu", 1))


def test_rows_in_rows_out_by_reference_and_scaled_to_zero_when_idle(plane: DataPlane, breast_cancer_model: BuiltModel) -> None:
    async def scenario() -> tuple[list[pa.Table], list[str], bool]:
        await plane.start()
        try:
            tenant = plane.authenticate("Bearer k")
            answers = await asyncio.gather(*(plane.infer(tenant, "breast-cancer", features(breast_cancer_model, slice(i, i + 5)))
                                             for i in range(0, 50, 5)))
            served = await plane.model(tenant, "breast-cancer")
            served.last_used -= 61  # as if a minute went by
            unloaded = await plane.reap_idle()
            return list(answers), unloaded, plane.is_loaded(served)
        finally:
            await plane.stop()

    answers, unloaded, loaded = asyncio.run(scenario())
    labels = np.concatenate([a.column("label").to_numpy() for a in answers])
    expected, _ = breast_cancer_model.expected(features(breast_cancer_model, slice(0, 50)))
    np.testing.assert_array_equal(labels, expected)
    assert unloaded == ["breast-cancer:1"] and not loaded


def test_a_reference_the_tenant_does_not_hold_is_not_found(plane: DataPlane) -> None:
    async def scenario() -> None:
        await plane.start()
        try:
            tenant = plane.authenticate("Bearer k")
            with pytest.raises(ModelNotFound, match="model 'churn' is not available to tenant 'acme'"):
                await plane.infer(tenant, "churn@prod", pa.table({"x": [1.0]}))
            with pytest.raises(ModelNotFound, match="breast-cancer@canary does not exist; model 'breast-cancer' has versions \\[1\\]"):
                await plane.model_for_reference(tenant, "breast-cancer@canary")
            assert (await plane.model_for_reference(tenant, "breast-cancer:1")).resolved.version == 1
            with pytest.raises(InvalidInput, match="version 'x' of model 'breast-cancer' is not a version number"):
                await plane.model_for_reference(tenant, "breast-cancer:x")
            with pytest.raises(ModelNotFound, match="model 'churn' is not available"):
                await plane.model_for_reference(tenant, "churn:x")  # who may call it is asked first
        finally:
            await plane.stop()

    asyncio.run(scenario())


def test_rows_are_checked_and_cast_before_they_join_a_batch(breast_cancer_model: BuiltModel) -> None:
    signature = breast_cancer_model.manifest.signature
    table = features(breast_cancer_model, slice(0, 3))
    prepared = check_rows(table, signature, "breast-cancer:1").table()
    assert prepared.schema.names == signature.input_names
    assert {f.type for f in prepared.schema} == {pa.float32()}
    with pytest.raises(SchemaMismatch, match="column 'mean radius' is missing"):
        check_rows(table.drop_columns(["mean radius"]), signature, "breast-cancer:1")
    holed = table.set_column(0, "mean radius", pa.array([1.0, None, 2.0]))
    with pytest.raises(NullValues, match="columns \\['mean radius'\\] hold nulls"):
        check_rows(holed, signature, "breast-cancer:1")


def test_log_lines_are_json_with_the_request_id() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("shardline.online.test")
    logger.addHandler(handler)
    logger.propagate = False
    token = CURRENT.set(RequestInfo(request_id_from("trace-1")))
    try:
        logger.warning("something happened", extra={"fields": {"model": "m:1", "rows": 3}})
    finally:
        CURRENT.reset(token)
        logger.removeHandler(handler)
    line: dict[str, Any] = json.loads(stream.getvalue())
    assert line["request_id"] == "trace-1" and line["msg"] == "something happened"
    assert (line["level"], line["model"], line["rows"]) == ("warning", "m:1", 3)
    assert len(request_id_from("bad\nid")) == 32 and len(request_id_from("x" * 200)) == 32


class GatedStream(io.StringIO):
    """A stream whose writes wait for ``gate`` (a disk the kernel holds back), noting who wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.writing = False
        self.writers: set[str] = set()

    def write(self, text: str) -> int:
        self.writing = True
        self.writers.add(threading.current_thread().name)
        self.gate.wait(30)
        self.writing = False
        return super().write(text)


def test_the_access_log_is_written_in_batches_by_its_own_thread_and_nothing_is_lost() -> None:
    config = log_config("info")
    assert config["loggers"][ACCESS_LOGGER]["handlers"] == ["access"]  # the serve config batches only the access log
    logger = logging.getLogger("shardline.online.test-access")
    logger.propagate = False
    logger.setLevel(logging.INFO)

    def lines(stream: io.StringIO) -> list[Any]:
        return [json.loads(line).get("n", "dropped") for line in stream.getvalue().splitlines()]

    def wait_for(check: Any) -> None:
        deadline = time.monotonic() + 10
        while not check() and time.monotonic() < deadline:
            time.sleep(0.01)

    batched, timed = GatedStream(), io.StringIO()
    for stream, interval in ((batched, 60.0), (timed, 0.02)):
        handler = BufferedLineHandler(stream, interval_s=interval, max_bytes=400, max_pending_bytes=4000)
        handler.setFormatter(JsonFormatter())
        logger.addHandler(handler)
        try:
            logger.info("request", extra={"fields": {"n": 0}})
            if stream is batched:
                assert stream.getvalue() == "" and not batched.writers  # pending: no write per line
                for n in range(1, 6):  # past max_bytes: the writing thread is woken, the caller goes on
                    logger.info("request", extra={"fields": {"n": n}})
                wait_for(lambda: batched.writing)
                for n in range(6, 100):  # while the write hangs, lines pile up (to the bound, then dropped)
                    handler.emit_fields(logger.name, "request", {"n": n})
                assert batched.writing and stream.getvalue() == ""  # this thread never waited for the write
                batched.gate.set()
            else:
                wait_for(lambda: bool(stream.getvalue()))
                assert lines(stream) == [0]  # the flushing thread wrote it within interval_s
        finally:
            handler.close()  # writes what is pending
            logger.removeHandler(handler)
    assert batched.writers == {"shardline-log-flush", threading.current_thread().name}  # the thread, then close()
    written = lines(batched)
    assert written[-1] == "dropped" and written[:-1] == list(range(len(written) - 1))  # in order, none twice
    assert 6 < len(written) - 1 < 100
    dropped = json.loads(batched.getvalue().splitlines()[-1])["dropped"]
    assert len(written) - 1 + dropped == 100  # every line written or counted


def test_the_access_logs_fast_line_is_the_formatters_line() -> None:
    import json
    import logging

    stream = io.StringIO()
    handler = BufferedLineHandler(stream, interval_s=60.0)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("shardline.test.fast-line")
    token = CURRENT.set(RequestInfo("req-7"))
    try:
        assert handler.takes_fields()
        fields = {"method": "POST", "status": 200, "ms": 0.412, "tenant": "acme"}
        handler.emit_fields(logger.name, "request", fields)
        handler.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, "request", (), None,
                                         extra={"fields": fields}))
    finally:
        CURRENT.reset(token)
        handler.close()
    fast, slow = (json.loads(line) for line in stream.getvalue().splitlines())
    from datetime import datetime

    stamps = [datetime.strptime(line.pop("ts"), "%Y-%m-%dT%H:%M:%S.%fZ") for line in (fast, slow)]
    assert abs((stamps[1] - stamps[0]).total_seconds()) < 1  # the same format, made microseconds apart
    assert fast == slow == {"level": "info", "logger": logger.name, "msg": "request", "request_id": "req-7", **fields}
    handler.addFilter(lambda record: True)
    assert not handler.takes_fields()  # a filter must see records: the middleware takes the record path


def _count_reads(registry: ModelRegistry) -> tuple[list[str], list[BaseException]]:
    """The real registry with its reads counted (the references read) and a fault on demand (append one)."""
    reads: list[str] = []
    fail: list[BaseException] = []
    resolve = registry.resolve

    def counted(reference: Any) -> Any:
        reads.append(str(reference))
        if fail:
            raise fail.pop()
        return resolve(reference)

    registry.resolve = counted  # type: ignore[method-assign]
    return reads, fail


async def _in_thread(call: Any) -> Any:
    return await asyncio.to_thread(call)


def test_a_known_alias_is_read_again_in_the_background_while_requests_keep_its_version(
    local_registry: ModelRegistry, tmp_path: Path
) -> None:
    from shardline.bundle import ModelRef
    from shardline.build.examples import package_breast_cancer
    from shardline.online.models import ModelDirectory

    package_breast_cancer(tmp_path / "logreg", name="breast-cancer", kind="logreg")

    reads, fail = _count_reads(local_registry)
    clock = [0.0]

    async def scenario() -> list[Any]:
        directory = ModelDirectory(local_registry, _in_thread, alias_refresh_s=5.0, clock=lambda: clock[0])
        prod = ModelRef(name="breast-cancer", alias="prod")
        seen = [(await directory.resolve(prod)).version, len(reads)]  # unknown: read, and waited for
        version_2 = local_registry.push(tmp_path / "logreg").version
        local_registry.set_alias("breast-cancer", "prod", version_2 or 2)
        clock[0] = 4.0
        seen += [(await directory.resolve(prod)).version, len(reads)]  # fresh: no read
        clock[0] = 6.0
        seen += [(await directory.resolve(prod)).version, len(reads)]  # stale: the known version at once, a read queued
        await asyncio.gather(*directory._refreshing.values())
        seen += [(await directory.resolve(prod)).version, len(reads)]  # the moved alias, from the re-read
        clock[0] = 12.0
        fail.append(OSError("registry unreachable"))
        seen += [(await directory.resolve(prod)).version]
        await asyncio.gather(*directory._refreshing.values())
        seen += [(await directory.resolve(prod)).version, len(reads)]  # still the known one, not read again yet
        clock[0] = 18.0
        fail.append(ModelNotFound("breast-cancer@prod does not exist", "breast-cancer@prod"))
        await directory.resolve(prod)
        await asyncio.gather(*directory._refreshing.values())
        with pytest.raises(ModelNotFound):  # forgotten; the registry said missing, and that is trusted for 5 s
            await directory.resolve(prod)
        seen.append(len(reads))
        clock[0] = 24.0
        seen += [(await directory.resolve(prod)).version, len(reads)]  # past it: read (and found) at once
        await directory.close()
        return seen

    assert asyncio.run(scenario()) == [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 4, 2, 5]


def test_a_missing_reference_is_remembered_for_the_refresh_time_not_read_for_every_request(
        local_registry: ModelRegistry) -> None:
    from shardline.bundle import ModelRef
    from shardline.online.models import ModelDirectory

    reads, _ = _count_reads(local_registry)
    clock = [0.0]

    async def scenario() -> list[Any]:
        directory = ModelDirectory(local_registry, _in_thread, alias_refresh_s=5.0, clock=lambda: clock[0])
        messages = []
        for ref in [ModelRef(name="breast-cancer", alias="canary")] * 20 + [ModelRef(name="breast-cancer", version=9)] * 20:
            with pytest.raises(ModelNotFound) as raised:
                await directory.resolve(ref)
            messages.append(str(raised.value))
        seen: list[Any] = [len(reads), sorted(set(messages))]
        local_registry.set_alias("breast-cancer", "canary", 1)
        clock[0] = 4.9
        with pytest.raises(ModelNotFound):
            await directory.resolve(ModelRef(name="breast-cancer", alias="canary"))
        clock[0] = 5.0
        seen += [(await directory.resolve(ModelRef(name="breast-cancer", alias="canary"))).version, len(reads)]
        return seen

    assert asyncio.run(scenario()) == [
        2, ["breast-cancer:9 does not exist; model 'breast-cancer' has versions [1]",
            "breast-cancer@canary does not exist; model 'breast-cancer' has versions [1]"], 1, 3]
