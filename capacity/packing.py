"""Packing replicas onto nodes, whole GPUs and MIG slices at least cost: a pure function, HiGHS under it.

``pack(problem, policy)`` turns a ``PackingProblem`` (models, their offers, the hardware catalogue) into a
``PackingPlan``: how many GPUs of each kind in which MIG layout, which CPU nodes, how many replicas of each model
on each hardware class, and what it costs per hour, beside the LP relaxation's cost (a lower bound no plan can
beat) and beside one model per GPU. The mixed-integer program (docs/cost.md, "Packing replicas onto nodes, GPUs
and MIG slices", "The program"):

- a GPU of kind g is used whole or in one of its maximal MIG layouts: ``y[g, layout]`` GPUs so used;
- a replica of model m takes a slot (whole GPU or slice) it fits in memory: ``x[m, g, slot]`` replicas; the slots
  of a kind are the layouts' slots, ``sum_m x[m, g, s] <= sum_layout count(layout, s) * y[g, layout]``;
- a CPU node of type t is used or not (``u[t, i]``, one per node that may be needed, used in order) and holds
  replicas within its cores and memory: ``sum_m cores_m * x[m, t, i] <= cores_t * u[t, i]``, memory alike;
- every model's replicas sustain its demand within its target, ``sum capacity * x >= demand``, and number at
  least its ``min_replicas``;
- the cost is the GPUs' (or whole GPU nodes') and the CPU nodes' prices per hour.

Slots of one class are alike, so any assignment of the chosen replicas to the chosen slots is valid;
``pack`` writes one down (GPUs in nodes, replicas in slots) and ``check_plan`` verifies a plan against its
problem: no slot, GPU or node holds more than its memory, every layout is a valid MIG layout, every demand met.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Iterable, Literal

from pydantic import BaseModel, Field

from shardline.capacity.hardware import WHOLE, CpuNodeType, GpuKind, Hardware
from shardline.capacity.problem import ModelDemand, Offer, PackingProblem, check_offers, hardware_classes
from shardline.capacity.solver import INF, Program, Solution
from shardline.errors import InvalidSetting

_TOLERANCE = 1e-6


class PackingPolicy(BaseModel):
    """How hard the solver tries, and how many CPU nodes of a type it considers."""

    time_limit_s: float = Field(default=30.0, gt=0, description="Seconds HiGHS may search for the optimum.")
    mip_rel_gap: float = Field(default=1e-4, ge=0, description="Stop when within this fraction of the proven bound.")
    max_cpu_nodes: int = Field(default=48, ge=1, description="CPU nodes of one type the program may use at most.")


class PlanGroup(BaseModel):
    """The replicas of one model on one hardware class, and how each is batched."""

    model: str
    hardware_class: str
    replicas: int
    capacity: float = Field(description="Units/s these replicas sustain within the model's target.")
    offer: Offer


class GpuPlan(BaseModel):
    """One GPU: its layout (``['whole']`` or MIG profiles) and the model in each slot (None: empty)."""

    layout: list[str]
    models: list[str | None]


class NodePlan(BaseModel):
    """One node: its pool (a GPU kind or a CPU node type), its GPUs or CPU replicas, and what it costs."""

    name: str
    pool: str
    kind: Literal["gpu", "cpu"]
    gpus: list[GpuPlan] = Field(default_factory=list)
    replicas: list[str] = Field(default_factory=list, description="CPU nodes: the model of each replica.")
    cores_used: float = 0.0
    memory_used_gb: float = 0.0
    price_per_hour: float = Field(description="What this node costs (its GPUs' price, or the CPU node's).")


class Served(BaseModel):
    """A model's demand beside the capacity the plan gives it."""

    model: str
    unit: str
    demand: float
    capacity: float
    replicas: int


class Baseline(BaseModel):
    """One model per GPU: each model alone on whole GPUs (or, with no GPU offer, its own CPU nodes)."""

    cost_per_hour: float
    gpus: int
    cpu_nodes: int
    groups: list[PlanGroup]


class PackingPlan(BaseModel):
    """The plan: groups of replicas, nodes, cost, the lower bound and the one-model-per-GPU comparison."""

    status: Literal["optimal", "time-limit"]
    cost_per_hour: float
    lower_bound: float = Field(description="The LP relaxation's cost: no plan can cost less.")
    solver_bound: float = Field(description="The bound HiGHS proved for the integer program (>= lower_bound).")
    gpus: dict[str, int] = Field(description="GPUs used, by kind.")
    cpu_nodes: dict[str, int] = Field(description="CPU nodes used, by type.")
    groups: list[PlanGroup]
    nodes: list[NodePlan]
    served: list[Served]
    baseline: Baseline

    @property
    def gpu_count(self) -> int:
        """GPUs used in all."""
        return sum(self.gpus.values())

    @property
    def over_bound(self) -> float:
        """How far the cost is above the lower bound, as a fraction (0.03: 3% above)."""
        return self.cost_per_hour / self.lower_bound - 1 if self.lower_bound > 0 else 0.0


class _Vars:
    """The program's variables, by what they mean."""

    def __init__(self) -> None:
        self.layouts: dict[tuple[str, tuple[str, ...]], int] = {}
        self.gpu_nodes: dict[str, int] = {}
        self.slots: dict[tuple[str, str], int] = {}  # (model, hardware class) -> replicas on GPU slots
        self.cpu_used: dict[tuple[str, int], int] = {}
        self.cpu_replicas: dict[tuple[str, str, int], int] = {}  # (model, node type, node index)


def _cpu_node_bound(problem: PackingProblem, node: CpuNodeType, policy: PackingPolicy) -> int:
    """Nodes of a type that could ever be needed: every model that runs on it, alone, on its own nodes."""
    needed = 0
    for offer in (o for o in problem.offers if o.hardware_class == node.name):
        model = problem.model(offer.model)
        per_node = _per_node(offer, node)
        replicas = max(model.min_replicas, math.ceil(model.demand / offer.capacity - _TOLERANCE))
        needed += math.ceil(replicas / per_node) if per_node else 0
    cap = policy.max_cpu_nodes if node.max_nodes is None else min(node.max_nodes, policy.max_cpu_nodes)
    return min(needed, cap)


def _per_node(offer: Offer, node: CpuNodeType) -> int:
    return int(min(node.cores // offer.cores, node.memory_gb // offer.memory_gb))


def _program(problem: PackingProblem, policy: PackingPolicy) -> tuple[Program, _Vars]:
    program, v = Program(), _Vars()
    capacity: dict[str, dict[int, float]] = defaultdict(dict)
    counts: dict[str, dict[int, float]] = defaultdict(dict)
    classes = hardware_classes(problem.hardware)
    for kind in problem.hardware.gpus:
        _gpu_part(program, v, problem, kind, capacity, counts)
    for node in problem.hardware.cpu_nodes:
        _cpu_part(program, v, problem, node, policy, capacity, counts)
    for model in problem.models:
        program.row(capacity[model.name], lower=model.demand)
        if model.min_replicas:
            program.row(counts[model.name], lower=model.min_replicas)
    assert classes  # every offer's class exists (PackingProblem checked it)
    return program, v


def _gpu_part(program: Program, v: _Vars, problem: PackingProblem, kind: GpuKind,
              capacity: dict[str, dict[int, float]], counts: dict[str, dict[int, float]]) -> None:
    offers = {kind.class_name(s): [o for o in problem.offers if o.hardware_class == kind.class_name(s)]
              for s in kind.slots}
    if not any(offers.values()):
        return
    per_gpu = kind.price_per_hour if kind.billing == "gpu" else 0.0
    upper = INF if kind.max_gpus is None else kind.max_gpus
    for layout in kind.layouts:
        if any(offers[kind.class_name(slot)] for slot in layout):
            v.layouts[(kind.name, layout)] = program.var(cost=per_gpu, upper=upper)
    used = {var: 1.0 for (name, _), var in v.layouts.items() if name == kind.name}
    if kind.max_gpus is not None:
        program.row(used, upper=kind.max_gpus)
    if kind.billing == "node":
        nodes = v.gpu_nodes[kind.name] = program.var(cost=kind.price_per_hour * kind.gpus_per_node)
        program.row({**used, nodes: -float(kind.gpus_per_node)}, upper=0)
    for slot in kind.slots:
        name = kind.class_name(slot)
        supply = {var: -float(layout.count(slot)) for (k, layout), var in v.layouts.items()
                  if k == kind.name and slot in layout}
        takers = {}
        for offer in offers[name]:
            var = v.slots[(offer.model, name)] = program.var()
            takers[var] = 1.0
            capacity[offer.model][var] = offer.capacity
            counts[offer.model][var] = 1.0
        if takers:
            program.row({**takers, **supply}, upper=0)


def _cpu_part(program: Program, v: _Vars, problem: PackingProblem, node: CpuNodeType, policy: PackingPolicy,
              capacity: dict[str, dict[int, float]], counts: dict[str, dict[int, float]]) -> None:
    offers = [o for o in problem.offers if o.hardware_class == node.name and _per_node(o, node) > 0]
    for i in range(_cpu_node_bound(problem, node, policy)):
        used = v.cpu_used[(node.name, i)] = program.var(cost=node.price_per_hour, upper=1)
        cores, memory = {used: -float(node.cores)}, {used: -float(node.memory_gb)}
        for offer in offers:
            var = v.cpu_replicas[(offer.model, node.name, i)] = program.var(upper=_per_node(offer, node))
            cores[var], memory[var] = offer.cores, offer.memory_gb
            capacity[offer.model][var] = offer.capacity
            counts[offer.model][var] = 1.0
        program.row(cores, upper=0)
        program.row(memory, upper=0)
        if i:  # nodes are used in order: no two plans that differ only by which node is which
            program.row({v.cpu_used[(node.name, i - 1)]: 1.0, used: -1.0}, lower=0)


def pack(problem: PackingProblem, policy: PackingPolicy | None = None) -> PackingPlan:
    """The least-cost plan for a problem, beside its lower bound and one model per GPU (pure but for HiGHS).

    Raises:
        InvalidSetting: a model has no offer, or no plan fits the hardware to be had (what to change).
        RuntimeUnavailable: highspy is not installed.
    """
    policy = policy or PackingPolicy()
    check_offers(problem)
    program, v = _program(problem, policy)
    solution = program.solve(time_limit_s=policy.time_limit_s, mip_rel_gap=policy.mip_rel_gap)
    if solution.status == "infeasible":
        raise InvalidSetting(_infeasible(problem))
    relaxed = program.solve(relax=True, time_limit_s=policy.time_limit_s)
    replicas = _trimmed(problem, v, solution)
    nodes = _gpu_nodes(problem.hardware, v, solution, replicas) + _cpu_nodes(problem.hardware, v, solution)
    groups = _groups(problem, replicas, v, solution)
    cost = sum(n.price_per_hour for n in nodes) + _unused_node_gpus(problem.hardware, v, solution)
    status: Literal["optimal", "time-limit"] = "optimal" if solution.status == "optimal" else "time-limit"
    return PackingPlan(
        status=status, cost_per_hour=cost, lower_bound=relaxed.objective, solver_bound=min(solution.bound, cost),
        gpus={k: n for k in (g.name for g in problem.hardware.gpus)
              if (n := sum(solution.count(var) for (name, _), var in v.layouts.items() if name == k))},
        cpu_nodes=dict(Counter(n.pool for n in nodes if n.kind == "cpu")),
        groups=groups, nodes=nodes, served=_served(problem, groups), baseline=one_model_per_gpu(problem),
    )


def _infeasible(problem: PackingProblem) -> str:
    limits = [f"{g.name}: {g.max_gpus} GPUs" for g in problem.hardware.gpus if g.max_gpus is not None]
    limits += [f"{c.name}: {c.max_nodes} nodes" for c in problem.hardware.cpu_nodes if c.max_nodes is not None]
    return (
        f"the demand of {len(problem.models)} models does not fit the hardware to be had"
        f"{' (' + ', '.join(limits) + ')' if limits else ''}; raise max_gpus or max_nodes in the demand file's "
        "hardware, add a hardware kind, or lower a demand"
    )


def _trimmed(problem: PackingProblem, v: _Vars, solution: Solution) -> dict[tuple[str, str], int]:
    """Replicas on GPU slots per (model, class), less any the demand and min_replicas do without (a free slot
    costs nothing, so the solver may fill one for no reason)."""
    replicas = {key: solution.count(var) for key, var in v.slots.items() if solution.count(var)}
    offers = {(o.model, o.hardware_class): o for o in problem.offers}
    cpu: defaultdict[str, float] = defaultdict(float)
    cpu_count: Counter[str] = Counter()
    for (model, node, _), var in v.cpu_replicas.items():
        cpu[model] += solution.count(var) * offers[(model, node)].capacity
        cpu_count[model] += solution.count(var)
    for model in problem.models:
        keys = sorted((k for k in replicas if k[0] == model.name), key=lambda k: offers[k].capacity)
        for key in keys:
            while replicas[key] and _enough(model, replicas, offers, cpu[model.name], cpu_count[model.name], key):
                replicas[key] -= 1
    return {k: n for k, n in replicas.items() if n}


def _enough(model: ModelDemand, replicas: dict[tuple[str, str], int], offers: dict[tuple[str, str], Offer],
            cpu_capacity: float, cpu_count: int, without: tuple[str, str]) -> bool:
    """Whether the model's demand and min_replicas still hold with one replica of ``without`` fewer."""
    mine = [(k, n) for k, n in replicas.items() if k[0] == model.name]
    capacity = cpu_capacity + sum(offers[k].capacity * n for k, n in mine) - offers[without].capacity
    count = cpu_count + sum(n for _, n in mine) - 1
    return capacity >= model.demand * (1 - 1e-9) and count >= model.min_replicas


def _gpu_nodes(hardware: Hardware, v: _Vars, solution: Solution,
               replicas: dict[tuple[str, str], int]) -> list[NodePlan]:
    nodes = []
    for kind in hardware.gpus:
        gpus = [GpuPlan(layout=list(layout), models=[None] * len(layout))
                for (name, layout), var in sorted(v.layouts.items()) if name == kind.name
                for _ in range(solution.count(var))]
        for slot in kind.slots:
            free = [(g, i) for g in gpus for i, s in enumerate(g.layout) if s == slot]
            takers = [m for (m, c), n in sorted(replicas.items()) if c == kind.class_name(slot) for _ in range(n)]
            for (gpu, i), model in zip(free, takers):
                gpu.models[i] = model
        per_gpu = kind.price_per_hour if kind.billing == "gpu" else 0.0
        for start in range(0, len(gpus), kind.gpus_per_node):
            held = gpus[start:start + kind.gpus_per_node]
            price = per_gpu * len(held) if kind.billing == "gpu" else kind.price_per_hour * kind.gpus_per_node
            nodes.append(NodePlan(name=f"{kind.name}-{start // kind.gpus_per_node + 1}", pool=kind.name, kind="gpu",
                                  gpus=held, price_per_hour=price))
    return nodes


def _unused_node_gpus(hardware: Hardware, v: _Vars, solution: Solution) -> float:
    """Whole GPU nodes paid for beyond those holding the plan's GPUs (none: the solver buys no idle node)."""
    extra = 0.0
    for kind in hardware.gpus:
        if kind.billing == "node" and kind.name in v.gpu_nodes:
            used = sum(solution.count(var) for (name, _), var in v.layouts.items() if name == kind.name)
            paid = solution.count(v.gpu_nodes[kind.name])
            extra += max(0, paid - math.ceil(used / kind.gpus_per_node)) * kind.price_per_hour * kind.gpus_per_node
    return extra


def _cpu_nodes(hardware: Hardware, v: _Vars, solution: Solution) -> list[NodePlan]:
    nodes = []
    offers_memory: dict[tuple[str, str], tuple[float, float]] = {}
    for node in hardware.cpu_nodes:
        used = [i for (name, i), var in sorted(v.cpu_used.items()) if name == node.name and solution.count(var)]
        for number, i in enumerate(used, start=1):
            held = [(m, solution.count(var)) for (m, t, j), var in sorted(v.cpu_replicas.items())
                    if t == node.name and j == i and solution.count(var)]
            if not held:
                continue
            nodes.append(NodePlan(name=f"{node.name}-{number}", pool=node.name, kind="cpu",
                                  replicas=[m for m, n in held for _ in range(n)], price_per_hour=node.price_per_hour))
    del offers_memory
    return nodes


def _groups(problem: PackingProblem, replicas: dict[tuple[str, str], int], v: _Vars,
            solution: Solution) -> list[PlanGroup]:
    offers = {(o.model, o.hardware_class): o for o in problem.offers}
    counts: Counter[tuple[str, str]] = Counter(replicas)
    for (model, node, _), var in v.cpu_replicas.items():
        counts[(model, node)] += solution.count(var)
    return [PlanGroup(model=m, hardware_class=c, replicas=n, capacity=n * offers[(m, c)].capacity, offer=offers[(m, c)])
            for (m, c), n in sorted(counts.items()) if n]


def _served(problem: PackingProblem, groups: Iterable[PlanGroup]) -> list[Served]:
    mine = list(groups)
    return [Served(model=m.name, unit=m.unit, demand=m.demand,
                   capacity=sum(g.capacity for g in mine if g.model == m.name),
                   replicas=sum(g.replicas for g in mine if g.model == m.name)) for m in problem.models]


def one_model_per_gpu(problem: PackingProblem) -> Baseline:
    """Each model alone: on whole GPUs of its cheapest kind, or, without a GPU offer, on its own CPU nodes."""
    classes = hardware_classes(problem.hardware)
    groups, cost, gpus, cpu_nodes = [], 0.0, 0, 0
    for model in problem.models:
        options = []
        for offer in problem.offers_of(model.name):
            owner, slot = classes[offer.hardware_class]
            replicas = max(model.min_replicas, math.ceil(model.demand / offer.capacity - _TOLERANCE))
            if isinstance(owner, GpuKind) and slot == WHOLE:
                options.append((replicas * owner.price_per_hour, replicas, 0, offer, replicas))
            elif isinstance(owner, CpuNodeType) and _per_node(offer, owner):
                nodes = math.ceil(replicas / _per_node(offer, owner))
                options.append((nodes * owner.price_per_hour, 0, nodes, offer, replicas))
        if not options:  # measured on slices only: a whole GPU does at least what its best slice does
            best = max(problem.offers_of(model.name), key=lambda o: o.capacity)
            kind = classes[best.hardware_class][0]
            assert isinstance(kind, GpuKind)
            replicas = max(model.min_replicas, math.ceil(model.demand / best.capacity - _TOLERANCE))
            whole = best.model_copy(update={"hardware_class": kind.name})
            options.append((replicas * kind.price_per_hour, replicas, 0, whole, replicas))
        price, n_gpus, n_nodes, offer, replicas = min(options, key=lambda o: (o[0], o[1]))
        cost, gpus, cpu_nodes = cost + price, gpus + n_gpus, cpu_nodes + n_nodes
        groups.append(PlanGroup(model=model.name, hardware_class=offer.hardware_class, replicas=replicas,
                                capacity=replicas * offer.capacity, offer=offer))
    return Baseline(cost_per_hour=cost, gpus=gpus, cpu_nodes=cpu_nodes, groups=groups)


def check_plan(problem: PackingProblem, plan: PackingPlan) -> list[str]:
    """Everything a plan gets wrong against its problem; empty for a sound plan.

    Checks: each GPU's layout is a valid one of its kind; each replica fits its slot's memory and has an offer
    there; no CPU node holds more cores or memory than it has; GPUs and nodes within what is to be had; every
    model's capacity covers its demand with at least ``min_replicas``; the cost is the nodes' prices.
    """
    found: list[str] = []
    offers = {(o.model, o.hardware_class): o for o in problem.offers}
    pools = {g.name: g for g in problem.hardware.gpus}
    cpu_types = {c.name: c for c in problem.hardware.cpu_nodes}
    for node in plan.nodes:
        if node.kind == "gpu":
            found += _check_gpu_node(node, pools[node.pool], offers)
        else:
            found += _check_cpu_node(node, cpu_types[node.pool], offers)
    for kind in problem.hardware.gpus:
        used = sum(len(n.gpus) for n in plan.nodes if n.pool == kind.name)
        if kind.max_gpus is not None and used > kind.max_gpus:
            found.append(f"{used} {kind.name} GPUs, {kind.max_gpus} to be had")
    for node_type in problem.hardware.cpu_nodes:
        used = sum(1 for n in plan.nodes if n.pool == node_type.name)
        if node_type.max_nodes is not None and used > node_type.max_nodes:
            found.append(f"{used} {node_type.name} nodes, {node_type.max_nodes} to be had")
    for served in plan.served:
        model = problem.model(served.model)
        held = _replicas_held(plan, served.model)
        capacity = sum(offers[(served.model, c)].capacity for c in held)
        if capacity < model.demand * (1 - 1e-9):
            found.append(f"{served.model}: capacity {capacity:g} {model.unit} under its demand {model.demand:g}")
        if len(held) < model.min_replicas:
            found.append(f"{served.model}: {len(held)} replicas, at least {model.min_replicas} asked")
    priced = sum(n.price_per_hour for n in plan.nodes)
    if abs(priced - plan.cost_per_hour) > 1e-6 * max(1.0, priced):
        found.append(f"the plan costs {plan.cost_per_hour:g}/h, its nodes {priced:g}/h")
    return found


def _replicas_held(plan: PackingPlan, model: str) -> list[str]:
    """The hardware class of each replica of a model the nodes hold."""
    held = []
    for node in plan.nodes:
        for gpu in node.gpus:
            held += [node.pool if slot == WHOLE else f"{node.pool}-mig-{slot}"
                     for slot, m in zip(gpu.layout, gpu.models) if m == model]
        held += [node.pool for m in node.replicas if m == model]
    return held


def _check_gpu_node(node: NodePlan, kind: GpuKind, offers: dict[tuple[str, str], Offer]) -> list[str]:
    found = []
    if len(node.gpus) > kind.gpus_per_node:
        found.append(f"{node.name}: {len(node.gpus)} GPUs on a node of {kind.gpus_per_node}")
    for number, gpu in enumerate(node.gpus):
        if tuple(sorted(gpu.layout)) not in kind.layouts:
            found.append(f"{node.name} GPU {number}: {gpu.layout} is not a valid layout of {kind.name}")
        for slot, model in zip(gpu.layout, gpu.models):
            if model is None:
                continue
            offer = offers.get((model, kind.class_name(slot)))
            if offer is None:
                found.append(f"{node.name} GPU {number}: {model} has no offer on {kind.class_name(slot)}")
            elif offer.memory_gb > kind.slot_memory_gb(slot):
                found.append(f"{node.name} GPU {number}: {model} needs {offer.memory_gb:g} GB, its {slot} slot has "
                             f"{kind.slot_memory_gb(slot):g}")
    return found


def _check_cpu_node(node: NodePlan, node_type: CpuNodeType, offers: dict[tuple[str, str], Offer]) -> list[str]:
    held = [offers.get((m, node_type.name)) for m in node.replicas]
    if any(o is None for o in held):
        return [f"{node.name}: holds a model with no offer on {node_type.name}"]
    cores = sum(o.cores for o in held if o)
    memory = sum(o.memory_gb for o in held if o)
    found = []
    if cores > node_type.cores + _TOLERANCE:
        found.append(f"{node.name}: {cores:g} cores requested, the node has {node_type.cores}")
    if memory > node_type.memory_gb + _TOLERANCE:
        found.append(f"{node.name}: {memory:g} GB requested, the node has {node_type.memory_gb:g}")
    return found
