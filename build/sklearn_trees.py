"""Whether the trees of a scikit-learn model rebuilt by skops are safe to run (``mlflow_flavors._skops_model``).

skops 0.16 leaves two scikit-learn types untrusted (``skops.io.exceptions.UNTRUSTED_TYPE_REASONS``):
``sklearn.tree._tree.Tree`` (DecisionTree*, RandomForest*, ExtraTrees*, GradientBoosting*, IsolationForest) and
``sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor`` (HistGradientBoosting*). Their node arrays
hold raw child and feature indices that scikit-learn's Cython code (``_tree.pyx``: ``apply``, ``predict``,
``decision_path``; ``_gradient_boosting.pyx``: ``predict_stages``; ``_predictor.pyx``) follows without bounds
checks, so a crafted file loads and then ``predict`` reads or writes out of bounds. ``check_trees`` walks the
rebuilt model (instance attributes, lists, tuples, dicts, numpy object arrays; each object once, ``MAX_DEPTH``
deep and ``MAX_OBJECTS`` objects at most) and checks, before anything predicts:

- every ``Tree`` is some estimator's ``tree_``, that estimator's ``n_features_in_`` equals the tree's
  ``n_features``; ``node_count`` >= 1 and the node array holds ``node_count`` rows; ``n_outputs`` >= 1, every
  ``n_classes`` >= 1 and ``max_n_classes`` their maximum; ``value`` is ``(node_count, n_outputs, max_n_classes)``;
  each node is a leaf (both children ``TREE_LEAF``, -1) or has both children in ``(i, node_count)`` (scikit-learn's
  builders always number a child above its parent: no cycles) and ``feature`` in ``[0, n_features)``; the deepest
  path is at most ``max_depth`` (``decision_path`` sizes its output by it); the node array's
  ``missing_go_to_left``, ``threshold`` and ``impurity`` come with it (one row a node);
- the tree estimators in one ensemble's ``estimators_`` share one ``n_features_in_`` (GradientBoosting checks the
  rows' width against the first only); GradientBoosting's ``estimators_`` is 2-D, its width
  ``n_trees_per_iteration_``, and its ``init_`` is ``"zero"`` or a ``DummyClassifier``/``DummyRegressor`` answering
  that many columns (``predict_stages`` adds tree ``k``'s answer to column ``k`` of the init's answers unchecked);
- every ``TreePredictor`` is in a HistGradientBoosting model's ``_predictors``, which has no ``_preprocessor``
  (its rows are then checked against ``n_features_in_``; one with categorical features holds
  ``functools.partial`` and is refused before this anyway); its ``nodes`` are ``PREDICTOR_RECORD_DTYPE`` and
  non-empty; each non-leaf node has ``left`` and ``right`` in ``(i, len(nodes))`` and ``feature_idx`` in
  ``[0, n_features_in_)``; a categorical node's ``bitset_idx`` is a row of ``raw_left_cat_bitsets`` and
  ``binned_left_cat_bitsets`` (8 words wide) and its feature is categorical in ``_bin_mapper.is_categorical_``
  (whose length is ``n_features_in_``: ``known_cat_bitsets`` and ``f_idx_map`` come from it).

Anything else is refused (``InvalidInput``, one line naming the model, the estimator, the tree, the field and the
bad value).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from shardline.errors import InvalidInput

TREE = "sklearn.tree._tree.Tree"
TREE_PREDICTOR = "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor"
TREE_TYPES = frozenset({TREE, TREE_PREDICTOR})
MAX_DEPTH = 64  # nesting of attributes and containers the walk follows
MAX_OBJECTS = 1_000_000  # objects the walk visits
_LEAF = -1
_BITSET_WORDS = 8  # uint32 words of a category bitset (256 bits; a category is a uint8)
_DO = "log the model again from a trusted scikit-learn (mlflow.sklearn.log_model on the fitted estimator)"


class _Refused(Exception):
    """One bad field, said in words; ``check_trees`` turns it into ``InvalidInput``."""


@dataclass
class _Found:
    """What the walk saw: each Tree and TreePredictor (by id), and the objects holding them."""

    trees: dict[int, tuple[str, Any]] = field(default_factory=dict)  # id -> (path, Tree)
    predictors: dict[int, tuple[str, Any]] = field(default_factory=dict)
    objects: list[tuple[str, Any]] = field(default_factory=list)  # instances with attributes, with their paths


def check_trees(model: Any, what: str) -> None:
    """Refuse a model whose trees would send scikit-learn's predict out of bounds (the module's list).

    Args:
        model: the estimator skops rebuilt.
        what: the model in words, for the message ("MLflow model models:/x/1 (flavor sklearn)").

    Raises:
        InvalidInput: a tree breaks an invariant (naming the estimator, the tree, the field, the bad value).
    """
    from sklearn.ensemble._hist_gradient_boosting.predictor import TreePredictor
    from sklearn.tree._tree import Tree

    found = _Found()
    try:
        _walk(model, "model", Tree, TreePredictor, found)
        checked: set[int] = set()
        for path, obj in found.objects:
            tree = vars(obj).get("tree_")
            if isinstance(tree, Tree):
                _check_tree(tree, obj, f"{path}.tree_")
                checked.add(id(tree))
            predictors = vars(obj).get("_predictors")
            if predictors is not None:
                checked |= _check_hist(obj, predictors, path, TreePredictor)
            estimators = vars(obj).get("estimators_")
            if estimators is not None:
                _check_ensemble(obj, estimators, path, Tree)
        for path, _ in [v for k, v in {**found.trees, **found.predictors}.items() if k not in checked]:
            raise _Refused(f"{path} is a tree outside a tree estimator's tree_ or a HistGradientBoosting "
                           "model's _predictors (scikit-learn keeps none elsewhere)")
    except _Refused as e:
        raise InvalidInput(f"{what} holds a tree scikit-learn could not run safely: {e}; {_DO}") from None


def _walk(root: Any, root_path: str, tree_type: type, predictor_type: type, found: _Found) -> None:
    seen: set[int] = set()
    stack: list[tuple[Any, str, int]] = [(root, root_path, 0)]
    while stack:
        obj, path, depth = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, complex, type)):
            continue
        seen.add(id(obj))
        if len(seen) > MAX_OBJECTS or depth > MAX_DEPTH:
            raise _Refused(f"{path} is nested deeper or wider than Shardline checks ({MAX_DEPTH} levels, "
                           f"{MAX_OBJECTS} objects)")
        if isinstance(obj, tree_type):
            found.trees[id(obj)] = (path, obj)
            continue
        if isinstance(obj, predictor_type):
            found.predictors[id(obj)] = (path, obj)
        stack.extend((child, child_path, depth + 1) for child_path, child in _children(obj, path))
        if hasattr(obj, "__dict__") and not isinstance(obj, np.ndarray):
            found.objects.append((path, obj))


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        yield from ((f"{path}[{key!r}]", value) for key, value in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from ((f"{path}[{i}]", value) for i, value in enumerate(obj))
    elif isinstance(obj, np.ndarray):
        if obj.dtype == object:
            yield from ((f"{path}[{', '.join(map(str, i))}]", value) for i, value in np.ndenumerate(obj))
    elif hasattr(obj, "__dict__"):
        yield from ((f"{path}.{name}", value) for name, value in vars(obj).items())


def _n_features_in(obj: Any) -> int | None:
    value = vars(obj).get("n_features_in_")
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else None


def _check_tree(tree: Any, owner: Any, path: str) -> None:
    n = int(tree.node_count)
    n_features, n_outputs = int(tree.n_features), int(tree.n_outputs)
    width = _n_features_in(owner)
    if width is None or width != n_features:
        raise _Refused(f"{path}: n_features {n_features}, its estimator's n_features_in_ {width}")
    if n < 1:
        raise _Refused(f"{path}: node_count {n}")
    n_classes = np.asarray(tree.n_classes)
    if n_outputs < 1 or n_classes.shape != (n_outputs,) or (n_classes < 1).any() \
            or int(tree.max_n_classes) != int(n_classes.max()):
        raise _Refused(f"{path}: n_outputs {n_outputs}, n_classes {n_classes.tolist()}, "
                       f"max_n_classes {tree.max_n_classes}")
    left, right, feature = (np.asarray(a, dtype=np.int64) for a in
                            (tree.children_left, tree.children_right, tree.feature))
    for name, column in (("children_left", left), ("children_right", right), ("feature", feature),
                         ("threshold", tree.threshold), ("missing_go_to_left", tree.missing_go_to_left),
                         ("impurity", tree.impurity)):
        if len(column) != n:
            raise _Refused(f"{path}.{name}: {len(column)} values for node_count {n}")
    value_shape = np.asarray(tree.value).shape
    if value_shape != (n, n_outputs, int(tree.max_n_classes)):
        raise _Refused(f"{path}.value: shape {value_shape}, expected {(n, n_outputs, int(tree.max_n_classes))}")
    _check_nodes(path, left, right, feature, n_features,
                 ("children_left", "children_right", "feature"))
    _check_depth(path, left, right, int(tree.max_depth))


def _check_nodes(path: str, left: np.ndarray, right: np.ndarray, feature: np.ndarray, n_features: int,
                 names: tuple[str, str, str], leaf: np.ndarray | None = None) -> None:
    """Each node a leaf or with both children in (i, n) and its feature in [0, n_features)."""
    n = len(left)
    index = np.arange(n)
    is_leaf = (left == _LEAF) & (right == _LEAF) if leaf is None else leaf
    split = ~is_leaf
    for name, child in ((names[0], left), (names[1], right)):
        bad = np.flatnonzero(split & ((child <= index) | (child >= n)))
        if bad.size:
            i = int(bad[0])
            raise _Refused(f"{path}.{name}[{i}] = {int(child[i])}, outside ({i}, {n})")
    bad = np.flatnonzero(split & ((feature < 0) | (feature >= n_features)))
    if bad.size:
        i = int(bad[0])
        raise _Refused(f"{path}.{names[2]}[{i}] = {int(feature[i])}, outside [0, {n_features})")


def _check_depth(path: str, left: np.ndarray, right: np.ndarray, max_depth: int) -> None:
    """The longest path from the root has at most ``max_depth`` edges (children above parents: levels end)."""
    level, depth = np.array([0]), 0
    while level.size:
        level = level[left[level] != _LEAF]
        level = np.unique(np.concatenate([left[level], right[level]]))
        if level.size:
            depth += 1
            if depth > max_depth:
                raise _Refused(f"{path}: a path deeper than max_depth {max_depth}")


def _check_ensemble(obj: Any, estimators: Any, path: str, tree_type: type) -> None:
    """The tree estimators of one ensemble share one width; GradientBoosting's layout and init fit its trees."""
    members = list(np.asarray(estimators, dtype=object).ravel()) if isinstance(estimators, np.ndarray) \
        else list(estimators) if isinstance(estimators, (list, tuple)) else []
    widths = {_n_features_in(m) for m in members if hasattr(m, "__dict__")
              and isinstance(vars(m).get("tree_"), tree_type)}
    if len(widths) > 1:
        raise _Refused(f"{path}.estimators_: trees of n_features_in_ {sorted(widths, key=str)}")
    from sklearn.ensemble._gb import BaseGradientBoosting

    if isinstance(obj, BaseGradientBoosting):
        _check_gradient_boosting(obj, estimators, path)


def _check_gradient_boosting(model: Any, estimators: Any, path: str) -> None:
    from sklearn.dummy import DummyClassifier, DummyRegressor

    if not isinstance(estimators, np.ndarray) or estimators.ndim != 2:
        raise _Refused(f"{path}.estimators_: not a 2-D array of trees")
    k = estimators.shape[1]
    if k != model.__dict__.get("n_trees_per_iteration_"):
        raise _Refused(f"{path}.estimators_: {k} trees an iteration, n_trees_per_iteration_ "
                       f"{model.__dict__.get('n_trees_per_iteration_')}")
    init = model.__dict__.get("init_")
    if isinstance(init, str) and init == "zero":
        return
    loss = model.__dict__.get("_loss")
    multiclass = bool(getattr(loss, "is_multiclass", False))
    if isinstance(init, DummyClassifier):
        prior = np.asarray(init.__dict__.get("class_prior_", []))
        columns = prior.shape[-1] if multiclass and prior.ndim == 1 else 1 if not multiclass else 0
    elif isinstance(init, DummyRegressor) and not multiclass:
        outputs = init.__dict__.get("n_outputs_")
        columns = 1 if outputs == 1 else int(outputs) if isinstance(outputs, int) else 0
    else:
        raise _Refused(f"{path}.init_ is {type(init).__name__}: Shardline checks GradientBoosting models whose "
                       "init is 'zero' or scikit-learn's default (a DummyClassifier or DummyRegressor)")
    if columns != k:
        raise _Refused(f"{path}.init_ answers {columns} columns for {k} trees an iteration")


def _check_hist(model: Any, predictors: Any, path: str, predictor_type: type) -> set[int]:
    """HistGradientBoosting's predictors against its width and categorical features; returns their ids."""
    from sklearn.ensemble._hist_gradient_boosting.common import PREDICTOR_RECORD_DTYPE

    width = _n_features_in(model)
    if width is None or model.__dict__.get("_preprocessor") is not None:
        raise _Refused(f"{path}: a HistGradientBoosting model with n_features_in_ {width} and a _preprocessor "
                       f"{type(model.__dict__.get('_preprocessor')).__name__}")
    categorical = getattr(model.__dict__.get("_bin_mapper"), "is_categorical_", None)
    categorical = np.zeros(width, dtype=bool) if categorical is None else np.asarray(categorical).astype(bool)
    if categorical.shape != (width,):
        raise _Refused(f"{path}._bin_mapper.is_categorical_: shape {categorical.shape}, n_features_in_ {width}")
    ids: set[int] = set()
    rows = predictors if isinstance(predictors, (list, tuple)) else []
    for i, row in enumerate(rows):
        for j, predictor in enumerate(row if isinstance(row, (list, tuple)) else []):
            if isinstance(predictor, predictor_type):
                _check_predictor(predictor, f"{path}._predictors[{i}][{j}]", width, categorical,
                                 PREDICTOR_RECORD_DTYPE)
                ids.add(id(predictor))
    return ids


def _check_predictor(predictor: Any, path: str, width: int, categorical: np.ndarray, dtype: np.dtype) -> None:
    nodes = vars(predictor).get("nodes")
    if not isinstance(nodes, np.ndarray) or nodes.dtype != dtype or nodes.ndim != 1 or len(nodes) < 1:
        raise _Refused(f"{path}.nodes: {getattr(nodes, 'dtype', type(nodes).__name__)} "
                       f"{getattr(nodes, 'shape', '')}, expected a non-empty 1-D PREDICTOR_RECORD_DTYPE array")
    leaf = nodes["is_leaf"].astype(bool)
    left, right = nodes["left"].astype(np.int64), nodes["right"].astype(np.int64)
    feature = nodes["feature_idx"].astype(np.int64)
    _check_nodes(f"{path}.nodes", left, right, feature, width, ("left", "right", "feature_idx"), leaf=leaf)
    split_categorical = ~leaf & nodes["is_categorical"].astype(bool)
    for name in ("raw_left_cat_bitsets", "binned_left_cat_bitsets"):
        bitsets = vars(predictor).get(name)
        if not isinstance(bitsets, np.ndarray) or bitsets.ndim != 2 or bitsets.shape[1] != _BITSET_WORDS:
            raise _Refused(f"{path}.{name}: shape {getattr(bitsets, 'shape', type(bitsets).__name__)}, expected "
                           f"(n, {_BITSET_WORDS})")
        bad = np.flatnonzero(split_categorical & (nodes["bitset_idx"].astype(np.int64) >= len(bitsets)))
        if bad.size:
            i = int(bad[0])
            raise _Refused(f"{path}.nodes.bitset_idx[{i}] = {int(nodes['bitset_idx'][i])}, outside "
                           f"[0, {len(bitsets)}) rows of {name}")
    bad = np.flatnonzero(split_categorical & ~categorical[np.clip(feature, 0, width - 1)])
    if bad.size:
        i = int(bad[0])
        raise _Refused(f"{path}.nodes[{i}]: a categorical split on feature {int(feature[i])}, which "
                       "_bin_mapper.is_categorical_ says is not categorical")
