"""Hardware choice: where and how to run a model, decided from its measured profiles.

``choose_placement(workload, candidates, policy)`` is a pure function: measured
candidates in (device, variant, batch size, p99 latency, rows/s, cost per hour),
one ``Placement`` out, or ``NoPlacement`` saying the best that was found. The
policy, with its table of cases, is written up in ``docs/placement.md``:

- online (a p99 target at an expected request rate): the cheapest option whose
  estimated p99 (measured call p99 + the time to fill its batch) meets the target
  and whose replicas, each kept at most ``max_utilization`` busy, cover the rate;
  a CPU option that meets it is taken even at up to ``cpu_premium`` times that cost.
- batch (a rate, or rows by a deadline): the highest rows/s per unit of cost; as
  many replicas as the rate needs.
- a model that needs only part of a GPU takes a MIG slice (a candidate of its own,
  measured on the slice) or a share of a GPU (time-slicing/MPS, in
  ``gpu_share_steps`` steps, assumed ``shared_latency_factor`` slower at p99).

``candidates_from_profiles`` turns the profiles that ``shardline.build.profiling`` stores
in the registry into candidates, pricing each machine kind with the function it is given (the price
table's ``shardline.capacity.prices.PriceTable.per_machine_hour``: the kernel does not read the table).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.errors import InvalidSetting, ShardlineError

DeviceKind = Literal["cpu", "cuda", "mig"]


class NoPlacement(ShardlineError, ValueError):
    """No measured candidate meets a workload's target."""

    def __init__(self, message: str, best: "Placement | None") -> None:
        super().__init__(message)
        self.best = best


class Candidate(BaseModel):
    """One measured way to run a model: a device kind, a variant and a batch size."""

    model_config = ConfigDict(frozen=True)

    machine: str = Field(description="Machine kind the profile was measured on, e.g. 'cpu-x86_64-8c'.")
    device: DeviceKind = Field(description="cpu, a whole GPU (cuda) or a MIG slice (mig).")
    variant: str = Field(default="fp32", description="Precision variant: fp32, int8, fp16.")
    batch_size: int = Field(ge=1)
    p99_ms: float = Field(gt=0, description="Measured p99 latency of one call at this batch size.")
    rows_per_s: float = Field(gt=0, description="Measured rows per second of one device at this batch size.")
    cost_per_hour: float = Field(gt=0, description="Price of one device (machine, GPU or MIG slice) per hour.")

    @property
    def label(self) -> str:
        """A short name for messages: machine, variant, batch size."""
        return f"{self.machine} {self.variant} batch {self.batch_size}"


class OnlineWorkload(BaseModel):
    """Requests answered one by one: a p99 latency target at an expected rate."""

    kind: Literal["online"] = "online"
    p99_ms: float = Field(gt=0, description="Latency target per request, p99, milliseconds.")
    rps: float = Field(gt=0, description="Expected requests per second (at peak).")
    rows_per_request: int = Field(default=1, ge=1)

    @property
    def rows_per_s(self) -> float:
        """Rows per second the requests bring."""
        return self.rps * self.rows_per_request


class BatchWorkload(BaseModel):
    """Rows scored in bulk: a rate to sustain, or rows to finish by a deadline."""

    kind: Literal["batch"] = "batch"
    rows_per_s: float | None = Field(default=None, gt=0, description="Throughput to sustain.")
    rows: int | None = Field(default=None, ge=1, description="Rows of the job (with deadline_s).")
    deadline_s: float | None = Field(default=None, gt=0, description="Seconds the job may take (with rows).")

    @model_validator(mode="after")
    def _one_target(self) -> "BatchWorkload":
        if (self.rows is None) != (self.deadline_s is None):
            raise ValueError("give rows and deadline_s together (rows to finish by a deadline)")
        return self

    @property
    def required_rows_per_s(self) -> float:
        """The rate it needs: the larger of the rate asked and rows / deadline; 0 if neither."""
        by_deadline = self.rows / self.deadline_s if self.rows and self.deadline_s else 0.0
        return max(self.rows_per_s or 0.0, by_deadline)


Workload = OnlineWorkload | BatchWorkload


class PlacementPolicy(BaseModel):
    """The knobs of the placement policy (see docs/placement.md)."""

    max_utilization: float = Field(
        default=0.7, gt=0, le=1, description="Online: keep each replica at most this busy (queueing headroom)."
    )
    cpu_premium: float = Field(
        default=1.25, ge=1,
        description="Online: take the cheapest CPU option that meets the target if it costs at most this many "
        "times the cheapest option of all (1.0: plain cheapest).",
    )
    allow_gpu_sharing: bool = Field(default=True, description="Let a model take part of a GPU (time-slicing/MPS).")
    gpu_share_steps: int = Field(default=4, ge=1, description="A shared GPU is split in this many equal shares.")
    shared_latency_factor: float = Field(
        default=1.5, ge=1, description="Online: p99 on a shared GPU is assumed this many times the measured one."
    )
    max_replicas: int = Field(default=64, ge=1, description="Most devices one model may take.")


class Placement(BaseModel):
    """The decision: a candidate, how many devices (or what share of one), cost and headroom."""

    candidate: Candidate
    replicas: int = Field(description="Devices (machines, GPUs or MIG slices); 1 when sharing a GPU.")
    gpu_share: float | None = Field(default=None, description="Fraction of one GPU when shared, else None.")
    cost_per_hour: float
    capacity_rows_per_s: float = Field(description="Rows/s the placement sustains (online: at max utilization).")
    expected_p99_ms: float | None = Field(default=None, description="Online: estimated p99 per request.")
    reason: str

    @property
    def mode(self) -> str:
        """'dedicated', 'shared-gpu' or 'mig-slice'."""
        if self.gpu_share is not None:
            return "shared-gpu"
        return "mig-slice" if self.candidate.device == "mig" else "dedicated"


Pricing = Callable[[str], float]  # machine kind -> price of one device per hour (``PriceTable.per_machine_hour``)


def device_of(machine: str, device: str) -> DeviceKind:
    """The device kind of a profile: 'mig' for a MIG slice of a GPU, else its device."""
    if device == "cuda":
        return "mig" if "-mig-" in machine else "cuda"
    if device == "cpu":
        return "cpu"
    raise InvalidSetting(f"profile of {machine!r} ran on device {device!r}; expected 'cpu' or 'cuda'")


def candidates_from_profiles(profiles: Mapping[str, Mapping[str, Any]], price: Pricing) -> list[Candidate]:
    """Every (machine, variant, batch size) the stored profiles measured, priced (pure).

    Args:
        profiles: the registry's profiles of a version (``ModelRegistry.profiles``).
        price: the price of one device of a machine kind per hour (the price table's ``per_machine_hour``).
    """
    found = []
    for key, profile in sorted(profiles.items()):
        machine = str(profile.get("machine", key))
        kind = device_of(machine, str(profile.get("device", "cpu")))
        for row in profile.get("batches", []):
            found.append(Candidate(
                machine=machine, device=kind, variant=profile.get("variant") or "fp32",
                batch_size=int(row["batch_size"]), p99_ms=float(row["p99_ms"]),
                rows_per_s=float(row["rows_per_s"]), cost_per_hour=price(machine),
            ))
    return found


class VariantFacts(Protocol):
    """What placement reads of a version's precision variant (the registry's ``Variant``)."""

    @property
    def score(self) -> float | None: ...  # its golden-set score (None: never scored against fp32)

    @property
    def device(self) -> str: ...  # where it is meant to run: cpu or cuda


def placeable(candidates: Sequence[Candidate], variants: Mapping[str, VariantFacts]) -> tuple[list[Candidate], list[str]]:
    """The candidates placement may pick, and a note per variant left out (pure).

    fp32 is always placeable. A variant is left out where the version has no such variant, where it was never
    scored against fp32 on a golden set (an unscored int8 may answer anything: placement never trades accuracy
    the manifest did not allow), and on a CPU where it was made for GPUs (fp16: a CPU has no float16 kernels,
    whatever a profile measured there).
    """
    kept: list[Candidate] = []
    notes: dict[str, str] = {}
    for c in candidates:
        if c.variant == "fp32":
            kept.append(c)
            continue
        record = variants.get(c.variant)
        if record is None:
            notes.setdefault(c.variant, f"{c.variant} left out: the version has no such variant")
        elif record.score is None:
            notes.setdefault(c.variant, f"{c.variant} left out: never scored against fp32 (no golden set)")
        elif record.device == "cuda" and c.device == "cpu":
            notes.setdefault(f"{c.variant} cpu", f"{c.variant} left out on CPUs: made for GPUs")
        else:
            kept.append(c)
    return kept, list(notes.values())


def _share(need: float, policy: PlacementPolicy) -> float | None:
    """The share of a GPU to take for a need below one GPU, or None to take whole ones."""
    if not policy.allow_gpu_sharing or need >= 1:
        return None
    steps = policy.gpu_share_steps
    share = max(1, math.ceil(need * steps - 1e-9)) / steps
    return share if share < 1 else None


def _online_options(workload: OnlineWorkload, c: Candidate, policy: PlacementPolicy) -> list[Placement]:
    """Dedicated devices, and a GPU share when the need is below one GPU."""
    usable = c.rows_per_s * policy.max_utilization
    need = workload.rows_per_s / usable
    replicas = max(1, math.ceil(need - 1e-9))
    options = []
    shares: list[float | None] = [None]
    if c.device == "cuda" and (share := _share(need, policy)) is not None:
        shares.append(share)
    for share in shares:
        devices = 1 if share is not None else replicas
        per_device_rows = workload.rows_per_s / devices
        fill_ms = max(0, c.batch_size - workload.rows_per_request) / per_device_rows * 1e3
        call_ms = c.p99_ms * (policy.shared_latency_factor if share is not None else 1.0)
        options.append(Placement(
            candidate=c, replicas=devices, gpu_share=share,
            cost_per_hour=c.cost_per_hour * (share if share is not None else devices),
            capacity_rows_per_s=usable * (share if share is not None else devices),
            expected_p99_ms=call_ms + fill_ms, reason="",
        ))
    return options


class ReplicaCapacity(BaseModel):
    """What one device of a candidate sustains for a workload within its target, and how to batch for it."""

    model_config = ConfigDict(frozen=True)

    rows_per_s: float = Field(description="Rows/s one replica serves within the target (online: at max utilization).")
    expected_p99_ms: float | None = Field(default=None, description="Online: the call p99 plus the batch's fill time.")
    max_wait_ms: float | None = Field(
        default=None,
        description="Online: the batcher's wait for a fuller batch that keeps p99 within the target at any rate up to "
        "the capacity (the time the batch takes to fill at capacity).",
    )


def replica_capacity(workload: Workload, c: Candidate, policy: PlacementPolicy | None = None) -> ReplicaCapacity | None:
    """One device of ``c`` for ``workload``: its rows/s within the target, or None when it cannot meet it (pure).

    Online, a replica is kept at most ``max_utilization`` busy and its batch fills at that rate; with the
    batcher's wait set to that fill time, a replica that receives less waits no longer, so its p99 stays at most
    the call p99 plus that fill time. Batch: the measured rows/s (a batch job runs flat out).
    """
    policy = policy or PlacementPolicy()
    if isinstance(workload, BatchWorkload):
        return ReplicaCapacity(rows_per_s=c.rows_per_s)
    usable = c.rows_per_s * policy.max_utilization
    fill_ms = max(0, c.batch_size - workload.rows_per_request) / usable * 1e3
    if c.p99_ms + fill_ms > workload.p99_ms:
        return None
    return ReplicaCapacity(rows_per_s=usable, expected_p99_ms=c.p99_ms + fill_ms, max_wait_ms=fill_ms)


def _devices(p: Placement) -> str:
    """How many of what, for messages: '3 x cpu', '1 MIG slice(s)', 'a 0.25 share of one GPU'."""
    if p.gpu_share is not None:
        return f"a {p.gpu_share:g} share of one GPU"
    return f"{p.replicas} MIG slice(s)" if p.mode == "mig-slice" else f"{p.replicas} x {p.candidate.device}"


def _explain_online(p: Placement, workload: OnlineWorkload) -> str:
    c = p.candidate
    return (
        f"{c.label} on {_devices(p)}: estimated p99 {p.expected_p99_ms:.2f} ms <= {workload.p99_ms:g} ms, capacity "
        f"{p.capacity_rows_per_s:,.0f} rows/s for {workload.rows_per_s:,.0f}, {p.cost_per_hour:.3f}/h"
    )


def _choose_online(workload: OnlineWorkload, candidates: list[Candidate], policy: PlacementPolicy) -> Placement:
    options = [o for c in candidates for o in _online_options(workload, c, policy)]
    within = [o for o in options if o.replicas <= policy.max_replicas]
    meeting = [o for o in within if (o.expected_p99_ms or 0.0) <= workload.p99_ms]
    if not meeting:
        best = min(within, key=lambda o: (o.expected_p99_ms, o.cost_per_hour)) if within else min(
            options, key=lambda o: o.replicas
        )
        raise NoPlacement(_online_failure(workload, best, policy, bool(within)), best)
    cheapest = min(o.cost_per_hour for o in meeting)
    on_cpu = [o for o in meeting if o.candidate.device == "cpu" and o.cost_per_hour <= cheapest * policy.cpu_premium]
    pool = on_cpu or meeting
    chosen = min(pool, key=lambda o: (o.cost_per_hour, o.expected_p99_ms, -o.capacity_rows_per_s, o.candidate.label))
    return chosen.model_copy(update={"reason": _explain_online(chosen, workload)})


def _online_failure(workload: OnlineWorkload, best: Placement, policy: PlacementPolicy, fits: bool) -> str:
    target = f"p99 <= {workload.p99_ms:g} ms at {workload.rps:g} requests/s"
    if not fits:
        return (
            f"no candidate meets {target} within {policy.max_replicas} replicas: the best, {best.candidate.label}, "
            f"needs {best.replicas}; measure a faster device or variant, or raise max_replicas"
        )
    return (
        f"no candidate meets {target}: the best found is {best.candidate.label} with {best.replicas} "
        f"replica(s), estimated p99 {best.expected_p99_ms:.2f} ms (measured call p99 {best.candidate.p99_ms:.2f} ms); "
        "profile a faster device or variant (`shardline model profile`), a smaller batch size, or relax the target"
    )


def _choose_batch(workload: BatchWorkload, candidates: list[Candidate], policy: PlacementPolicy) -> Placement:
    rate = workload.required_rows_per_s
    options = []
    for c in candidates:
        need = rate / c.rows_per_s
        share = _share(need, policy) if c.device == "cuda" and rate > 0 else None
        replicas = 1 if share is not None else max(1, math.ceil(need - 1e-9))
        scale = share if share is not None else replicas
        options.append(Placement(
            candidate=c, replicas=replicas, gpu_share=share, cost_per_hour=c.cost_per_hour * scale,
            capacity_rows_per_s=c.rows_per_s * scale, reason="",
        ))
    within = [o for o in options if o.replicas <= policy.max_replicas]
    if not within:
        best = min(options, key=lambda o: o.replicas)
        raise NoPlacement(
            f"no candidate sustains {rate:,.0f} rows/s within {policy.max_replicas} replicas: the best, "
            f"{best.candidate.label} ({best.candidate.rows_per_s:,.0f} rows/s each), needs {best.replicas}; "
            "measure a faster device or variant, give the job a later deadline, or raise max_replicas",
            best,
        )
    chosen = min(within, key=lambda o: (
        -o.candidate.rows_per_s / o.candidate.cost_per_hour, -o.candidate.rows_per_s, o.candidate.label,
    ))
    c = chosen.candidate
    reason = (
        f"{c.label}: {c.rows_per_s / c.cost_per_hour:,.0f} rows/s per unit of cost/h, the most of "
        f"{len(candidates)} candidates; {_devices(chosen)} for {rate:,.0f} rows/s"
    )
    return chosen.model_copy(update={"reason": reason})


def choose_placement(
    workload: Workload, candidates: list[Candidate], policy: PlacementPolicy | None = None
) -> Placement:
    """Choose device, variant, batch size and replicas for a workload (pure; see docs/placement.md).

    Raises:
        NoPlacement: no candidate meets the target (the message and ``best`` say what
            came closest), or there are no candidates.
    """
    policy = policy or PlacementPolicy()
    if not candidates:
        raise NoPlacement(
            "there are no measured candidates to choose from; profile the model on the machines it may "
            "run on (`shardline model profile REF`) and price them in the cost table",
            None,
        )
    if isinstance(workload, OnlineWorkload):
        return _choose_online(workload, candidates, policy)
    return _choose_batch(workload, candidates, policy)
