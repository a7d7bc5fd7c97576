"""Students for distillation: a small scikit-learn model fitted on a teacher's answers.

``fit_student`` fits one of ``STUDENT_KINDS`` (a linear model, a few shallow trees, a small
perceptron) on feature rows and the teacher's outputs for them: its labels for a classifier, its
predictions for a regressor. Packaging it is ``shardline.build.packaging.package_sklearn``'s; running
the teacher, scoring and gating the student are ``shardline.quality.distillation``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardline.errors import InvalidInput, InvalidSetting, RuntimeUnavailable

STUDENT_KINDS: tuple[str, ...] = ("linear", "gbt", "mlp")


@dataclass(frozen=True)
class StudentSize:
    """How big a student is: trees and their depth (gbt), hidden units (mlp); linear has no size."""

    trees: int = 50
    max_depth: int = 3
    hidden: int = 16

    def describe(self, kind: str) -> str:
        """The size of a ``kind`` student in words, for messages."""
        if kind == "gbt":
            return f"{self.trees} tree{'s' if self.trees != 1 else ''} of depth {self.max_depth}"
        if kind == "mlp":
            return f"one hidden layer of {self.hidden}"
        return "one linear layer"


def _estimator(kind: str, classifier: bool, size: StudentSize, seed: int) -> Any:
    from sklearn.ensemble import GradientBoostingClassifier, GradientBoostingRegressor
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.neural_network import MLPClassifier, MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind == "linear":
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000) if classifier else Ridge())
    if kind == "gbt":
        trees = GradientBoostingClassifier if classifier else GradientBoostingRegressor
        return trees(n_estimators=size.trees, max_depth=size.max_depth, random_state=seed)
    mlp = MLPClassifier if classifier else MLPRegressor
    return make_pipeline(StandardScaler(), mlp((size.hidden,), max_iter=2000, random_state=seed))


def fit_student(
    kind: str, features: np.ndarray, targets: np.ndarray, *, classifier: bool, size: StudentSize = StudentSize(),
    seed: int = 0,
) -> Any:
    """A fitted scikit-learn student of ``kind`` on ``features`` (rows, k) and the teacher's ``targets``.

    Raises:
        InvalidSetting: the kind is not one of ``STUDENT_KINDS``, or a size is below 1.
        InvalidInput: the teacher gave one class only (nothing to learn), or there are fewer than 2 rows.
        RuntimeUnavailable: scikit-learn is not installed.
    """
    if kind not in STUDENT_KINDS:
        raise InvalidSetting(f"student {kind!r} is not one Shardline fits; use one of {', '.join(STUDENT_KINDS)}")
    if min(size.trees, size.max_depth, size.hidden) < 1:
        raise InvalidSetting(f"a student's trees, depth and hidden units are at least 1, got {size}")
    if features.shape[0] < 2:
        raise InvalidInput(f"distillation needs at least 2 rows of data, got {features.shape[0]}; give more rows")
    if classifier and np.unique(targets).size < 2:
        raise InvalidInput(
            f"the teacher answers {targets[0]!r} for every one of the {targets.shape[0]} rows, so a student has "
            "nothing to learn; give data on which the teacher gives more than one answer")
    try:
        estimator = _estimator(kind, classifier, size, seed)
    except ImportError as e:
        raise RuntimeUnavailable("fitting a student needs scikit-learn; pip install 'shardline[package]'") from e
    return estimator.fit(features, targets)
