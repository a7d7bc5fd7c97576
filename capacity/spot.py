"""Spot economics: a finished batch job replayed under preemptions, against the same job on demand.

``simulate(job, setup, seed)`` replays a job's shards (their measured scoring seconds and checkpointed ranges)
on a pool of workers with a discrete-event simulation that does what the platform does:

- a worker scores one shard at a time, taking the next from the queue when free (Dask's scheduler);
- a spot worker gets a preemption notice (Poisson per worker at ``rate_per_hour``, or at the times of a
  trace), stops taking work (``tasks/preemption.py``: closing gracefully) and lets its shard run on for the
  drain (``drain_s``, at most the notice); a shard not finished by then goes back to the queue, keeping the
  ranges its per-range checkpoints saved (``storage/checkpoint.py``; a shard of one range keeps nothing); the
  machine is reclaimed (and its billing ends) ``notice_s`` after the notice, and the cloud brings a replacement
  spot worker ``replace_s`` after that;
- the SLA tracker projects the finish from the settled shards every ``check_s`` (``shardline.sla_projection``,
  the same function) and, when the job turns at-risk or breached, the SLA response adds ``step`` workers
  (``flows/sla_response.py``), ready ``start_s`` later: of the job's own pool, as scaling its dask-kubernetes
  cluster does, or on demand (``Response.capacity``);
- every worker is billed by the second from its start to its reclaim or the job's end, spot ones at the spot
  price, on-demand ones at the on-demand price.

Pure and seeded: no clock, no I/O; the same job, setup and seed give the same run.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Literal, Sequence

from pydantic import BaseModel, Field

from shardline.errors import InvalidSetting
from shardline.sla_projection import ProgressPoint, Sla, project

_EPOCH = datetime(2026, 1, 1, tzinfo=timezone.utc)
_GIVE_UP = 4.0  # a run still unfinished at this many times its deadline is counted as never finishing


class ShardWork(BaseModel):
    """One shard as the job scored it."""

    name: str
    seconds: float = Field(gt=0, description="Its measured scoring seconds.")
    rows: int = Field(default=0, ge=0)
    ranges: int = Field(default=1, ge=1, description="Row-group ranges it was checkpointed in (1: none).")


class JobWork(BaseModel):
    """A finished job as the simulation replays it."""

    job_id: str
    shards: list[ShardWork] = Field(min_length=1)
    workers: int = Field(ge=1, description="Workers the job runs on (spot or on demand).")
    deadline_s: float = Field(gt=0, description="Seconds from the start to the deadline.")
    margin_fraction: float = Field(default=0.1, ge=0, lt=1, description="The SLA's at-risk margin.")
    hardware_class: str = ""

    @property
    def busy_seconds(self) -> float:
        """Scoring seconds of all its shards."""
        return sum(s.seconds for s in self.shards)


class Preemptions(BaseModel):
    """How spot workers are taken away: a rate per worker-hour, or a trace of notice times."""

    rate_per_hour: float = Field(default=0.0, ge=0, description="Notices per spot worker per hour (Poisson).")
    trace_s: tuple[float, ...] | None = Field(default=None, description="Notice times (s from the job's start); "
                                              "each takes one spot worker, chosen by the seed.")
    notice_s: float = Field(default=120.0, ge=0, description="Seconds from a notice to the reclaim (AWS: 120).")
    drain_s: float = Field(default=20.0, ge=0, description="Seconds a noticed worker may finish its shard before it "
                           "hands it back (SHARDLINE_DASK_PREEMPTION_DRAIN_S; at most the notice).")
    replace_s: float = Field(default=180.0, ge=0, description="Seconds from a reclaim to a replacement spot worker.")


class Response(BaseModel):
    """The platform's SLA response as the simulation plays it."""

    check_s: float = Field(default=5.0, gt=0, description="Seconds between SLA projections "
                           "(SHARDLINE_BATCH_SLA_CHECK_INTERVAL_S).")
    window_s: float = Field(default=300.0, gt=0, description="The projection's throughput window "
                            "(SHARDLINE_BATCH_SLA_WINDOW_S).")
    step: int = Field(default=2, ge=0, description="Workers added when the job turns at-risk or breached.")
    start_s: float = Field(default=90.0, ge=0, description="Seconds until an added worker scores.")
    capacity: Literal["same", "on-demand"] = Field(
        default="same", description="same: the job's cluster grows in its own pool (spot for a spot job), as "
        "flows/sla_response.py scales a dask-kubernetes cluster; on-demand: added workers are on demand.")


class Prices(BaseModel):
    """Per worker-hour, on demand and on spot."""

    on_demand: float = Field(gt=0)
    spot: float = Field(gt=0)


class Setup(BaseModel):
    """Everything a run needs besides the job and the seed."""

    prices: Prices
    preemptions: Preemptions = Field(default_factory=Preemptions)
    response: Response = Field(default_factory=Response)
    capacity: Literal["spot", "on-demand"] = "spot"


class RunResult(BaseModel):
    """One run: when it finished, what it cost, and what preemption did to it."""

    finish_s: float = Field(description="Seconds from the start to the last shard settled (inf: never).")
    met: bool
    cost: float
    spot_worker_s: float
    on_demand_worker_s: float
    preemptions: int = 0
    lost_s: float = Field(default=0.0, description="Scoring seconds redone: work in flight at a reclaim, unsaved.")
    saved_s: float = Field(default=0.0, description="Scoring seconds in flight at a reclaim that checkpoints kept.")
    scale_ups: int = 0


@dataclass
class _Worker:
    spot: bool
    started: float
    notice_at: float = math.inf
    reclaim_at: float = math.inf
    ended: float | None = None
    draining: bool = False
    shard: int | None = None
    shard_started: float = 0.0
    token: int = 0


@dataclass
class _State:
    job: JobWork
    setup: Setup
    rng: random.Random
    left: list[list[float]]  # per shard: the seconds of its ranges still to score
    queue: deque[int]
    workers: list[_Worker] = field(default_factory=list)
    events: list[tuple[float, int, str, int]] = field(default_factory=list)
    points: list[ProgressPoint] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    done: int = 0
    finish: float = math.inf
    result: dict[str, float] = field(default_factory=lambda: {"preemptions": 0, "lost": 0.0, "saved": 0.0,
                                                               "scale_ups": 0})
    seq: int = 0
    status: str = "on-track"

    def at(self, when: float, kind: str, who: int = -1) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, who))


def _ranges(shard: ShardWork) -> list[float]:
    return [shard.seconds / shard.ranges] * shard.ranges


def _add_worker(state: _State, now: float, spot: bool) -> None:
    worker = _Worker(spot=spot, started=now)
    state.workers.append(worker)
    index = len(state.workers) - 1
    rate = state.setup.preemptions.rate_per_hour
    if spot and rate > 0 and state.setup.preemptions.trace_s is None:
        state.at(now + state.rng.expovariate(rate / 3600.0), "notice", index)
    state.at(now, "free", index)


def _assign(state: _State, index: int, now: float) -> None:
    worker = state.workers[index]
    if worker.draining or worker.ended is not None or worker.shard is not None or not state.queue:
        return
    shard = state.queue.popleft()
    worker.shard, worker.shard_started = shard, now
    worker.token += 1
    state.at(now + sum(state.left[shard]), "finish", index * 1_000_000 + worker.token)


def _finish(state: _State, payload: int, now: float) -> None:
    index, token = divmod(payload, 1_000_000)
    worker = state.workers[index]
    if worker.ended is not None or worker.token != token or worker.shard is None:
        return  # handed back at the end of a drain first
    state.left[worker.shard] = []
    worker.shard = None
    state.done += 1
    state.points.append(ProgressPoint(_EPOCH + timedelta(seconds=now), state.done))
    state.times.append(now)
    if state.done == len(state.job.shards):
        state.finish = now
        return
    _assign(state, index, now)


def _notice(state: _State, index: int, now: float) -> None:
    worker = state.workers[index]
    if worker.ended is not None or worker.draining:
        return
    worker.draining = True
    worker.notice_at = now
    worker.reclaim_at = now + state.setup.preemptions.notice_s
    state.at(now + min(state.setup.preemptions.drain_s, state.setup.preemptions.notice_s), "retire", index)
    state.at(worker.reclaim_at, "reclaim", index)


def _retire(state: _State, index: int, now: float) -> None:
    """The drain is over: a shard still running goes back to the queue, keeping its checkpointed ranges."""
    worker = state.workers[index]
    if worker.shard is not None:
        shard, ran = worker.shard, now - worker.shard_started
        kept = 0
        while kept < len(state.left[shard]) - 1 and ran >= sum(state.left[shard][:kept + 1]):
            kept += 1  # whole ranges finished and checkpointed before the reclaim
        saved = sum(state.left[shard][:kept])
        state.result["saved"] += saved
        state.result["lost"] += ran - saved
        state.left[shard] = state.left[shard][kept:]
        state.queue.appendleft(shard)  # the scheduler runs it again first
        worker.shard = None
        for other in range(len(state.workers)):
            _assign(state, other, now)


def _reclaim(state: _State, index: int, now: float) -> None:
    """The cloud takes the machine: its billing ends, a replacement is on its way."""
    worker = state.workers[index]
    if worker.ended is not None:
        return
    worker.ended = now
    state.result["preemptions"] += 1
    state.at(now + state.setup.preemptions.replace_s, "replace", index)


def _trace_notice(state: _State, now: float) -> None:
    live = [i for i, w in enumerate(state.workers) if w.spot and w.ended is None and not w.draining]
    if live:
        _notice(state, state.rng.choice(live), now)


def _check(state: _State, now: float, sla: Sla) -> None:
    """The SLA tracker: project, and answer each change to at-risk or to breached (each an event the
    sla-response automation answers) with ``step`` more workers."""
    window = state.setup.response.window_s
    cut = bisect.bisect_right(state.times, now - window)
    trace = [ProgressPoint(_EPOCH, 0)] + state.points[max(0, cut - 1):]
    status = project(trace, len(state.job.shards), sla, _EPOCH + timedelta(seconds=now),
                     window=timedelta(seconds=window)).status
    if status != state.status and status in ("at-risk", "breached") and state.setup.response.step:
        state.result["scale_ups"] += 1
        for _ in range(state.setup.response.step):
            state.at(now + state.setup.response.start_s, "added")
    state.status = status
    state.at(now + state.setup.response.check_s, "check")


def simulate(job: JobWork, setup: Setup, seed: int = 0) -> RunResult:
    """One run of ``job`` on ``setup.capacity`` (pure, seeded).

    Raises:
        InvalidSetting: a trace with a negative time.
    """
    if setup.preemptions.trace_s and min(setup.preemptions.trace_s) < 0:
        raise InvalidSetting("a preemption trace's times are seconds from the job's start; none may be negative")
    state = _State(job, setup, random.Random(seed), [_ranges(s) for s in job.shards],
                   deque(range(len(job.shards))))
    spot = setup.capacity == "spot"
    sla = Sla(deadline=_EPOCH + timedelta(seconds=job.deadline_s), started=_EPOCH,
              margin=timedelta(seconds=job.deadline_s * job.margin_fraction))
    for _ in range(job.workers):
        _add_worker(state, 0.0, spot)
    if spot and setup.preemptions.trace_s is not None:
        for at in setup.preemptions.trace_s:
            state.at(at, "trace")
    state.at(setup.response.check_s, "check")
    give_up = job.deadline_s * _GIVE_UP
    while state.events and state.finish == math.inf:
        now, _, kind, who = heapq.heappop(state.events)
        if now > give_up:
            break
        if kind == "free":
            _assign(state, who, now)
        elif kind == "finish":
            _finish(state, who, now)
        elif kind == "notice":
            _notice(state, who, now)
        elif kind == "retire":
            _retire(state, who, now)
        elif kind == "reclaim":
            _reclaim(state, who, now)
        elif kind == "replace":
            _add_worker(state, now, spot=True)
        elif kind == "added":
            _add_worker(state, now, spot=spot and setup.response.capacity == "same")
        elif kind == "trace":
            _trace_notice(state, now)
        elif kind == "check":
            _check(state, now, sla)
    end = state.finish if state.finish < math.inf else give_up
    spot_s = sum(min(w.ended if w.ended is not None else end, end) - w.started for w in state.workers
                 if w.spot and w.started < end)
    od_s = sum(end - w.started for w in state.workers if not w.spot and w.started < end)
    cost = (spot_s * setup.prices.spot + od_s * setup.prices.on_demand) / 3600.0
    return RunResult(finish_s=state.finish, met=state.finish <= job.deadline_s, cost=cost, spot_worker_s=spot_s,
                     on_demand_worker_s=od_s, preemptions=int(state.result["preemptions"]),
                     lost_s=state.result["lost"], saved_s=state.result["saved"],
                     scale_ups=int(state.result["scale_ups"]))


def with_slack(job: JobWork, setup: Setup, slack: float) -> JobWork:
    """The job with its deadline at its on-demand finish plus ``slack`` of it (0.4: a nightly job with 40% slack).

    Raises:
        InvalidSetting: a negative slack.
    """
    if slack < 0:
        raise InvalidSetting(f"slack is a fraction of the on-demand run (0.4: 40%), not negative; got {slack:g}")
    unhurried = job.model_copy(update={"deadline_s": job.busy_seconds * _GIVE_UP})  # no SLA response fires
    finish = simulate(unhurried, setup.model_copy(update={"capacity": "on-demand"})).finish_s
    return job.model_copy(update={"deadline_s": finish * (1 + slack)})


def parse_trace(text: str, source: str = "the trace file") -> tuple[float, ...]:
    """A preemption trace: one notice time a line, in seconds from the job's start (the first column of a CSV
    line; blank lines, '#' comments and a header line that is not a number are skipped).

    Raises:
        InvalidSetting: a line that is not a time, or a negative one.
    """
    times = []
    for number, line in enumerate(text.splitlines(), start=1):
        field_ = line.split("#", 1)[0].split(",", 1)[0].strip()
        if not field_:
            continue
        try:
            at = float(field_)
        except ValueError:
            if number == 1:
                continue  # a header
            raise InvalidSetting(f"{source} line {number}: {field_!r} is not a time in seconds from the start; "
                                 "write one notice time a line (e.g. 3600.5)") from None
        if at < 0 or not math.isfinite(at):
            raise InvalidSetting(f"{source} line {number}: {field_!r} must be a finite time of 0 or more")
        times.append(at)
    return tuple(sorted(times))


class Summary(BaseModel):
    """Many seeded spot runs at one preemption setting, beside the job on demand."""

    rate_per_hour: float | None
    runs: int
    mean_cost: float
    p95_cost: float
    cost_ratio: float = Field(description="Mean spot cost / on-demand cost.")
    attainment: float = Field(description="Share of runs that met the deadline.")
    mean_finish_s: float
    mean_preemptions: float
    mean_lost_s: float
    mean_saved_s: float
    mean_scale_ups: float


def summarize(job: JobWork, setup: Setup, seeds: Sequence[int], on_demand_cost: float) -> tuple[Summary,
                                                                                               list[RunResult]]:
    """Spot runs of ``job`` over ``seeds``, summed up against the on-demand cost."""
    runs = [simulate(job, setup, seed) for seed in seeds]
    costs = sorted(r.cost for r in runs)
    finite = [r.finish_s for r in runs if r.finish_s < math.inf]
    summary = Summary(
        rate_per_hour=None if setup.preemptions.trace_s is not None else setup.preemptions.rate_per_hour,
        runs=len(runs), mean_cost=statistics.fmean(costs),
        p95_cost=costs[min(len(costs) - 1, math.ceil(0.95 * len(costs)) - 1)],
        cost_ratio=statistics.fmean(costs) / on_demand_cost, attainment=sum(r.met for r in runs) / len(runs),
        mean_finish_s=statistics.fmean(finite) if finite else math.inf,
        mean_preemptions=statistics.fmean(r.preemptions for r in runs),
        mean_lost_s=statistics.fmean(r.lost_s for r in runs), mean_saved_s=statistics.fmean(r.saved_s for r in runs),
        mean_scale_ups=statistics.fmean(r.scale_ups for r in runs),
    )
    return summary, runs


class BreakEven(BaseModel):
    """The preemption rates (notices per worker-hour) up to which spot still pays: at most half the on-demand
    cost, and less than on demand, each while meeting the deadline in ``attainment_target`` of the runs.
    None: it held at every swept rate (up to ``swept_up_to``); 0.0: not even without preemptions."""

    half_cost_until: float | None
    pays_until: float | None
    swept_up_to: float
    attainment_target: float


class Sweep(BaseModel):
    """Spot at increasing preemption rates, and where it stops paying off."""

    on_demand_cost: float
    on_demand_finish_s: float
    points: list[Summary]
    break_even: BreakEven


def _rates(job: JobWork, on_demand_finish_s: float) -> list[float]:
    """Rates per worker-hour from 1/20 to 200 notices per worker over the job's on-demand run (and 0)."""
    hours = on_demand_finish_s / 3600.0
    return [0.0] + [k / hours for k in (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200)]


def sweep(job: JobWork, setup: Setup, seeds: Sequence[int], *, attainment_target: float = 0.95,
          refine: int = 4) -> Sweep:
    """Spot over rising preemption rates (the setup's notice and replacement times), against on demand, up to
    the first rate where it stops paying; the break-even rates each narrowed by ``refine`` bisections
    (geometric) between the grid's points."""
    on_demand = simulate(job, setup.model_copy(update={"capacity": "on-demand"}), 0)
    cost = on_demand.cost
    points: dict[float, Summary] = {}

    def at(rate: float) -> Summary:
        if rate not in points:
            changed = setup.preemptions.model_copy(update={"rate_per_hour": rate, "trace_s": None})
            points[rate] = summarize(job, setup.model_copy(update={"preemptions": changed, "capacity": "spot"}),
                                     seeds, cost)[0]
        return points[rate]

    def pays(s: Summary) -> bool:
        return s.cost_ratio < 1.0 and s.attainment >= attainment_target

    def half(s: Summary) -> bool:
        return s.cost_ratio <= 0.5 and s.attainment >= attainment_target

    grid = []
    for rate in _rates(job, on_demand.finish_s):  # up to the first rate where spot does not pay: none beyond matter
        grid.append(rate)
        if not pays(at(rate)):
            break

    def edge(holds: Callable[[Summary], bool]) -> float | None:
        """The highest rate found to hold before the first swept rate that does not; None: every swept rate
        holds; 0.0: not even without preemptions."""
        failing = [r for r in grid if not holds(points[r])]
        if not failing:
            return None
        first_bad = min(failing)
        holding = [r for r in grid if r < first_bad]
        if not holding:
            return 0.0
        low, high = max(holding), first_bad
        if low > 0.0:
            for _ in range(refine):
                middle = math.sqrt(low * high)
                low, high = (middle, high) if holds(at(middle)) else (low, middle)
        return low

    half_edge, pays_edge = edge(half), edge(pays)
    return Sweep(
        on_demand_cost=cost, on_demand_finish_s=on_demand.finish_s,
        points=sorted(points.values(), key=lambda s: s.rate_per_hour or 0.0),
        break_even=BreakEven(half_cost_until=half_edge, pays_until=pays_edge, swept_up_to=grid[-1],
                             attainment_target=attainment_target),
    )
