"""A small mixed-integer program and HiGHS under it (PyPI ``highspy``, the ``capacity`` extra).

``Program`` collects variables (cost, bounds, integer or not) and rows (lower <= sum of coefficients x <= upper);
``Program.solve`` hands them to HiGHS, whole or with integrality relaxed (the LP relaxation: a lower bound on the
integer optimum). highspy is imported inside ``solve``; without it the error names the extra to install.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from shardline.errors import InvalidSetting, RuntimeUnavailable

Status = Literal["optimal", "time-limit", "infeasible"]
INF = math.inf


@dataclass(frozen=True)
class Solution:
    """What HiGHS found: its status, each variable's value, the objective and the proven lower bound."""

    status: Status
    values: np.ndarray
    objective: float
    bound: float

    def value(self, var: int) -> float:
        """A variable's value, integer ones rounded (HiGHS returns 2.9999999 for 3)."""
        return float(self.values[var])

    def count(self, var: int) -> int:
        """An integer variable's value as an int."""
        return int(round(self.values[var]))


@dataclass
class Program:
    """A minimization: variables with costs and bounds, and rows of coefficients between two bounds."""

    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)

    def var(self, cost: float = 0.0, lower: float = 0.0, upper: float = INF, integer: bool = True) -> int:
        """Add a variable; returns its index."""
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, coefficients: dict[int, float], lower: float = -INF, upper: float = INF) -> None:
        """Add ``lower <= sum(c * x) <= upper`` (terms with a zero coefficient are dropped)."""
        self.rows.append(({v: c for v, c in coefficients.items() if c}, lower, upper))

    def solve(self, *, relax: bool = False, time_limit_s: float = 30.0, mip_rel_gap: float = 1e-4) -> Solution:
        """Solve with HiGHS (``relax``: the LP relaxation).

        Raises:
            RuntimeUnavailable: highspy is not installed.
            InvalidSetting: HiGHS found no solution in the time given (status and what to do in the message).
        """
        try:
            import highspy
        except ImportError as e:
            raise RuntimeUnavailable("capacity planning needs HiGHS: pip install 'shardline[capacity]'") from e
        # highspy.Highs's constructor logs a banner before output_flag can be set (HiGHS issues #1702, #2749):
        # the class it wraps, the C++ API's own binding, takes the options first.
        solver = highspy._Highs()  # type: ignore[attr-defined]
        solver.setOptionValue("output_flag", False)
        solver.setOptionValue("time_limit", float(time_limit_s))
        solver.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        solver.setOptionValue("threads", 1)
        solver.passModel(self._lp(highspy, relax))
        solver.run()
        status = solver.modelStatusToString(solver.getModelStatus())
        info = solver.getInfo()
        values = np.asarray(solver.getSolution().col_value, dtype=float)
        if status == "Optimal":
            bound = info.objective_function_value if relax or not any(self.integer) else info.mip_dual_bound
            return Solution("optimal", values, info.objective_function_value, bound)
        if status == "Infeasible":
            return Solution("infeasible", values, INF, INF)
        if status == "Time limit reached" and info.primal_solution_status == 2:  # a feasible solution was found
            return Solution("time-limit", values, info.objective_function_value, info.mip_dual_bound)
        raise InvalidSetting(
            f"the solver stopped with status {status!r} and no plan ({len(self.cost)} variables, {len(self.rows)} "
            "rows); give it more time (--time-limit) or fewer hardware kinds or models at once"
        )

    def _lp(self, highspy: object, relax: bool) -> object:
        lp = highspy.HighsLp()  # type: ignore[attr-defined]
        lp.num_col_, lp.num_row_ = len(self.cost), len(self.rows)
        lp.col_cost_ = np.asarray(self.cost, dtype=float)
        lp.col_lower_ = np.asarray(self.lower, dtype=float)
        lp.col_upper_ = np.asarray(self.upper, dtype=float)
        lp.row_lower_ = np.asarray([r[1] for r in self.rows], dtype=float)
        lp.row_upper_ = np.asarray([r[2] for r in self.rows], dtype=float)
        starts, index, value = [0], [], []
        for coefficients, _, _ in self.rows:
            for var, c in sorted(coefficients.items()):
                index.append(var)
                value.append(c)
            starts.append(len(index))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise  # type: ignore[attr-defined]
        lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(value, dtype=float)
        if not relax and any(self.integer):
            kinds = highspy.HighsVarType  # type: ignore[attr-defined]
            lp.integrality_ = [kinds.kInteger if i else kinds.kContinuous for i in self.integer]
        return lp
