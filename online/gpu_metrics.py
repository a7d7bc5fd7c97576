"""GPU metrics from NVML, read at scrape time with the replica's other metrics.

Per GPU (labels ``gpu`` index, ``uuid``, ``mig`` ""), and per MIG instance where MIG is on (``gpu`` its
parent's index, ``uuid`` the instance's, ``mig`` its index):

    shardline_gpu_utilization_ratio        busy fraction of the last sample period (whole GPUs only: NVML
                                           does not report it for a MIG instance; DCGM's
                                           DCGM_FI_PROF_GR_ENGINE_ACTIVE does)
    shardline_gpu_memory_used_bytes / shardline_gpu_memory_total_bytes
    shardline_gpu_process_memory_used_bytes  per compute process (``pid`` besides the device's labels)

NVML is probed once per process (``collector()``): no library, no driver or no GPU leaves the metrics absent
and says so once in the log. A device that stops answering is left out of that scrape.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

LABELS = ["gpu", "uuid", "mig"]
_probed = False
_collector: GpuCollector | None = None
_lock = threading.Lock()


class GpuCollector(Collector):
    """The GPUs NVML reports, read at each scrape (``nvml``: the ``pynvml`` module, initialised)."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def collect(self) -> Iterator[Metric]:
        nvml = self.nvml
        utilization = GaugeMetricFamily("shardline_gpu_utilization_ratio",
                                        "Fraction of the last sample period a kernel ran on the GPU.", labels=LABELS)
        used = GaugeMetricFamily("shardline_gpu_memory_used_bytes", "Device memory in use.", labels=LABELS)
        total = GaugeMetricFamily("shardline_gpu_memory_total_bytes", "Device memory in all.", labels=LABELS)
        process = GaugeMetricFamily("shardline_gpu_process_memory_used_bytes", "Device memory a process uses.",
                                    labels=[*LABELS, "pid"])
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                labels = [str(index), _text(nvml.nvmlDeviceGetUUID(handle)), ""]
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                used.add_metric(labels, memory.used)
                total.add_metric(labels, memory.total)
                try:
                    utilization.add_metric(labels, nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
                except nvml.NVMLError:  # not supported (MIG on: the whole GPU's is not reported)
                    pass
                _processes(nvml, handle, labels, process)
                for mig_labels, mig in _instances(nvml, handle, index):
                    memory = nvml.nvmlDeviceGetMemoryInfo(mig)
                    used.add_metric(mig_labels, memory.used)
                    total.add_metric(mig_labels, memory.total)
                    _processes(nvml, mig, mig_labels, process)
            except nvml.NVMLError as e:  # a device lost or resetting: left out of this scrape
                log.debug("GPU %d did not answer NVML: %s", index, e)
        yield from (utilization, used, total, process)


def _instances(nvml: Any, handle: Any, index: int) -> Iterator[tuple[list[str], Any]]:
    """The MIG instances of a GPU with MIG on, with their labels (none when MIG is off or not supported)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # a GPU without MIG
        return
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        return
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError:  # an empty slot
            continue
        yield [str(index), _text(nvml.nvmlDeviceGetUUID(mig)), str(slot)], mig


def _processes(nvml: Any, handle: Any, labels: list[str], family: GaugeMetricFamily) -> None:
    try:
        running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:
        return
    for proc in running:
        if proc.usedGpuMemory is not None:  # None: not available (e.g. Windows WDDM, or no permission)
            family.add_metric([*labels, str(proc.pid)], proc.usedGpuMemory)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def collector(nvml: Any = None) -> GpuCollector | None:
    """This process's GPU collector, or None when NVML reports no GPU (said once in the log). ``nvml``: a
    stand-in for the ``pynvml`` module (tests); the real one is imported and initialised once."""
    global _probed, _collector
    with _lock:
        if _probed:
            return _collector
        _probed = True
        why = None
        try:
            if nvml is None:
                import pynvml

                nvml = pynvml
            nvml.nvmlInit()
            if nvml.nvmlDeviceGetCount() == 0:
                why = "NVML reports no GPU"
        except ImportError:
            why = "nvidia-ml-py is not installed"
        except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded... (no GPU machine)
            why = f"NVML is not available ({e})"
        if why is not None:
            log.info("no GPU metrics: %s", why)
            return None
        _collector = GpuCollector(nvml)
        log.info("GPU metrics on: %d GPU(s) from NVML", nvml.nvmlDeviceGetCount())
        return _collector


def forget() -> None:
    """Probe again at the next ``collector()`` (tests)."""
    global _probed, _collector
    with _lock:
        _probed, _collector = False, None
