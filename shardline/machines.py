"""What kind of machine this is: the name its measured profiles are stored and looked up under.

``machine_kind`` names this machine (``cpu-x86_64-2c``, ``cuda-nvidia-h200``, ``cuda-nvidia-h200-mig-1g.18gb``);
``profile_key`` is a profile's key in the registry (the kind, and a precision variant). The profiles themselves
are measured by ``shardline.build.profiling`` and stored by ``shardline.quality.model_profiles``; the replicas
and batch workers read theirs by this key, and placement (``shardline.placement``) compares machines by it.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess

from shardline.errors import InvalidSetting


CPU_MACHINE = re.compile(r"^cpu-(?P<arch>.+)-(?P<cores>\d+)c$")  # ``machine_kind``'s name of a CPU machine


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._]+", "-", text.lower()).strip("-") or "unknown"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def gpu_name() -> str | None:
    """The name of the first visible NVIDIA GPU (with its MIG profile), or None without one."""
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    mig = re.search(r"MIG (\S+)\s+Device\s+\d+: \(UUID: (MIG-[^)]+)\)", listing)
    gpu = re.search(r"GPU \d+: (.+?) \(UUID", listing)
    if gpu is None:
        return None
    if mig is not None and (visible.startswith("MIG-") or mig.group(2) in visible):
        return f"{gpu.group(1)} mig {mig.group(1)}"
    return gpu.group(1)


def machine_kind(device: str = "cpu", *, gpu: str | None = None, cores: int | None = None, arch: str | None = None) -> str:
    """A stable name for a kind of machine: 'cpu-<arch>-<cores>c' or 'cuda-<gpu name>'.

    Args:
        device: the device the model runs on ('cpu' or 'cuda'), e.g. ``runtime.device``.
        gpu: the GPU's name; looked up with ``nvidia-smi`` when left out.
        cores: usable cores; this process's CPU affinity when left out.
        arch: CPU architecture; ``platform.machine()`` when left out.
    """
    if device == "cuda":
        return f"cuda-{_slug(gpu or gpu_name() or 'unknown')}"
    if device != "cpu":
        raise InvalidSetting(f"device {device!r} has no machine kind; use 'cpu' or 'cuda'")
    return f"cpu-{_slug(arch or platform.machine())}-{cores or usable_cores()}c"


def profile_key(machine: str, variant: str | None = None) -> str:
    """The registry key of a profile: the machine kind, then '.variant' for a precision variant."""
    return machine if variant is None else f"{machine}.{variant}"
