"""GPU metrics: the no-GPU path for real (this machine has no NVML library), and the collector's mapping from
NVML's answers with a stand-in for the pynvml module (a GPU cannot be had here)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from shardline.online import gpu_metrics
from shardline.online.metrics import Metrics


@pytest.fixture(autouse=True)
def fresh_probe() -> Iterator[None]:
    gpu_metrics.forget()
    yield
    gpu_metrics.forget()


def test_without_a_gpu_there_are_no_gpu_metrics_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("pynvml")
    with caplog.at_level(logging.INFO, logger="shardline.online.gpu_metrics"):
        first, second = Metrics(), Metrics()
    text = first.exposition()[0].decode() + second.exposition()[0].decode()
    assert "shardline_gpu_" not in text and "shardline_requests" in text
    lines = [r.getMessage() for r in caplog.records if r.name == "shardline.online.gpu_metrics"]
    assert len(lines) == 1 and lines[0].startswith("no GPU metrics: NVML is not available"), lines


class NVMLError(Exception):
    pass


class FakeNvml:
    """pynvml's answers for GPU 0 (whole, 2 processes) and GPU 1 (MIG on: slots 0 and 2 used, 1 empty)."""

    NVML_DEVICE_MIG_ENABLE = 1
    NVMLError = NVMLError

    def __init__(self) -> None:
        self.inits = 0

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:  # noqa: N802
        return f"gpu{i}"

    def nvmlDeviceGetUUID(self, h: str) -> str | bytes:  # noqa: N802
        uuids: dict[str, str | bytes] = {"gpu0": b"GPU-aaa", "gpu1": "GPU-bbb", "mig0": "MIG-x0", "mig2": "MIG-x2"}
        return uuids[h]

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:  # noqa: N802
        used, total = {"gpu0": (3 << 30, 80 << 30), "gpu1": (10 << 30, 80 << 30),
                       "mig0": (1 << 30, 10 << 30), "mig2": (2 << 30, 20 << 30)}[h]
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:  # noqa: N802
        if h == "gpu1":
            raise NVMLError("Not Supported")  # a GPU in MIG mode
        return SimpleNamespace(gpu=37, memory=5)

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[Any]:  # noqa: N802
        return {"gpu0": [SimpleNamespace(pid=11, usedGpuMemory=1 << 30), SimpleNamespace(pid=12, usedGpuMemory=None)],
                "mig2": [SimpleNamespace(pid=13, usedGpuMemory=512 << 20)]}.get(h, [])

    def nvmlDeviceGetMigMode(self, h: str) -> tuple[int, int]:  # noqa: N802
        if h == "gpu0":
            raise NVMLError("Not Supported")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: str) -> int:  # noqa: N802
        return 3

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: str, slot: int) -> str:  # noqa: N802
        if slot == 1:
            raise NVMLError("Not Found")
        return f"mig{slot}"


def _samples(collector: gpu_metrics.GpuCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    assert generate_latest(registry)  # it renders
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


def test_nvml_answers_become_per_gpu_per_mig_and_per_process_series() -> None:
    nvml = FakeNvml()
    collector = gpu_metrics.collector(nvml)
    assert collector is not None and gpu_metrics.collector(nvml) is collector and nvml.inits == 1
    got = _samples(collector)

    def key(name: str, gpu: str, uuid: str, mig: str = "", **more: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted({"gpu": gpu, "uuid": uuid, "mig": mig, **more}.items()))

    assert got == {
        key("shardline_gpu_utilization_ratio", "0", "GPU-aaa"): 0.37,
        key("shardline_gpu_memory_used_bytes", "0", "GPU-aaa"): 3 << 30,
        key("shardline_gpu_memory_total_bytes", "0", "GPU-aaa"): 80 << 30,
        key("shardline_gpu_process_memory_used_bytes", "0", "GPU-aaa", pid="11"): 1 << 30,
        key("shardline_gpu_memory_used_bytes", "1", "GPU-bbb"): 10 << 30,
        key("shardline_gpu_memory_total_bytes", "1", "GPU-bbb"): 80 << 30,
        key("shardline_gpu_memory_used_bytes", "1", "MIG-x0", "0"): 1 << 30,
        key("shardline_gpu_memory_total_bytes", "1", "MIG-x0", "0"): 10 << 30,
        key("shardline_gpu_memory_used_bytes", "1", "MIG-x2", "2"): 2 << 30,
        key("shardline_gpu_memory_total_bytes", "1", "MIG-x2", "2"): 20 << 30,
        key("shardline_gpu_process_memory_used_bytes", "1", "MIG-x2", "2", pid="13"): 512 << 20,
    }


def test_a_gpu_that_stops_answering_is_left_out_of_the_scrape() -> None:
    nvml = FakeNvml()

    def lost(h: str) -> Any:
        if h == "gpu1":
            raise NVMLError("GPU is lost")
        return FakeNvml.nvmlDeviceGetMemoryInfo(nvml, h)

    nvml.nvmlDeviceGetMemoryInfo = lost  # type: ignore[method-assign]
    collector = gpu_metrics.collector(nvml)
    assert collector is not None
    assert {labels for _, labels in _samples(collector)} == {
        (("gpu", "0"), ("mig", ""), ("uuid", "GPU-aaa")), (("gpu", "0"), ("mig", ""), ("pid", "11"), ("uuid", "GPU-aaa"))}
