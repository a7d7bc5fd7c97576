"""Rollouts: their state in the alias's log (one at a time, compare-and-swap moves), the sticky split,
the verdicts over a window, and how shadow answers are decoded and judged."""

from __future__ import annotations

import gzip
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import orjson
import pytest

from shardline.agreement import compare
from shardline.build.examples import package_breast_cancer
from shardline.errors import AliasConflict, InvalidSetting, RolloutConflict
from shardline.online.router.compare import decode_answer
from shardline.online.router.rollouts import RolloutBook, Route, Window, bucket, pick, verdict
from shardline.storage import rollouts
from shardline.storage.registry import ModelRegistry
from shardline.storage.rollouts import RollbackCriteria, Rollout, parse_duration, parse_share, parse_steps

MODEL = "breast-cancer"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> ModelRegistry:
    """breast-cancer:1 (gradient boosting) and :2 (logistic regression), prod on 1."""
    root = tmp_path_factory.mktemp("rollout-registry")
    registry = ModelRegistry(str(root / "registry"))
    package_breast_cancer(root / "v1")
    package_breast_cancer(root / "v2", kind="logreg")
    registry.push(root / "v1")
    registry.push(root / "v2")
    return registry


@pytest.fixture
def fresh(registry: ModelRegistry, tmp_path: Path) -> ModelRegistry:
    """A copy of the registry's versions with prod set to 1 and no rollout."""
    copy = ModelRegistry(str(tmp_path / "registry"))
    for version in (1, 2):
        from shardline.storage.registry import fetch_bundle

        fetch_bundle(registry.resolve(f"{MODEL}:{version}"), tmp_path / f"b{version}")
        copy.push(tmp_path / f"b{version}", keep_version=True)
    copy.set_alias(MODEL, "prod", 1, reason="first")
    return copy


def test_a_canary_steps_then_promotes_with_every_move_in_the_alias_history(fresh: ModelRegistry) -> None:
    started = rollouts.start(fresh, MODEL, "prod", 2, mode="canary", steps=(10, 50), interval_s=60, by="ana")
    assert started.action == "canary" and started.version == 1 and started.rollout is not None
    assert fresh.resolve(f"{MODEL}@prod").version == 1  # the alias stays on the baseline during the rollout
    assert started.rollout.weight == 10 and started.rollout.baseline == 1
    stepped = rollouts.advance(fresh, MODEL, "prod", expected_seq=started.seq, observed={"candidate": {"requests": 60}})
    assert stepped.rollout is not None and stepped.rollout.weight == 50 and stepped.rollout.id == started.rollout.id
    promoted = rollouts.advance(fresh, MODEL, "prod", expected_seq=stepped.seq)
    assert promoted.action == "promote" and promoted.version == 2 and fresh.resolve(f"{MODEL}@prod").version == 2
    assert [m.action for m in fresh.alias_history(MODEL, "prod")] == ["set", "canary", "canary", "promote"]
    assert rollouts.active(fresh.current_move(MODEL, "prod")) is None


def test_one_rollout_per_model_and_a_lost_race_is_told(fresh: ModelRegistry) -> None:
    started = rollouts.start(fresh, MODEL, "prod", 2, mode="shadow", shadow=0.1)
    fresh.set_alias(MODEL, "staging", 1)
    with pytest.raises(RolloutConflict, match=r"a rollout runs on breast-cancer already \(breast-cancer@prod: shadow"):
        rollouts.start(fresh, MODEL, "staging", 2, mode="canary", steps=(50,))
    rolled = rollouts.roll_back(fresh, MODEL, "prod", reason="shadow answers disagree", expected_seq=started.seq)
    assert rolled.action == "rollback" and rolled.version == 1 and "shadow answers disagree" in rolled.reason
    # a second router deciding on the same record loses the compare-and-swap, and is told
    with pytest.raises(RolloutConflict, match="no rollout .* runs on breast-cancer@prod"):
        rollouts.advance(fresh, MODEL, "prod", rollout_id=started.rollout.id if started.rollout else None,
                         expected_seq=started.seq)
    again = rollouts.start(fresh, MODEL, "prod", 2, mode="canary", steps=(1, 100))
    with pytest.raises(AliasConflict, match="moved while you were deciding"):
        rollouts.advance(fresh, MODEL, "prod", expected_seq=again.seq - 1)
    rollouts.roll_back(fresh, MODEL, "prod", reason="aborted")
    with pytest.raises(InvalidSetting, match="is what breast-cancer@prod points at already"):
        rollouts.start(fresh, MODEL, "prod", 1, mode="canary", steps=(5,))


def test_the_newest_record_is_read_without_reading_the_whole_history(fresh: ModelRegistry) -> None:
    for version in (2, 1, 2):
        fresh.set_alias(MODEL, "prod", version)
    folder = Path(fresh.root) / MODEL / "aliases" / "prod"
    (folder / "00000001.json").write_text("not json")  # an old record no longer read for the current one
    assert fresh.current_move(MODEL, "prod").version == 2  # type: ignore[union-attr]
    (folder / "00000005.json").write_text("")  # a writer died between create and write: skipped
    assert fresh.current_move(MODEL, "prod").seq == 4  # type: ignore[union-attr]


def test_callers_keep_their_version_within_a_step_and_the_candidate_as_the_weight_rises() -> None:
    callers = [f"tenant:{i}" for i in range(4000)]
    on = {}
    for weight in (1, 5, 25, 100):
        canary = Rollout(id="r1", candidate=2, baseline=1, mode="canary", steps=(1, 5, 25, 100),
                         step=(1, 5, 25, 100).index(weight))
        from shardline.storage.registry import AliasMove

        move = AliasMove(seq=2, alias="prod", version=1, action="canary", by="t", rollout=canary)
        picked = {c: pick(move, c, 0.5).version for c in callers}
        assert all(pick(move, c, 0.9).version == picked[c] for c in callers[:200])  # sticky within the step
        share = sum(v == 2 for v in picked.values()) / len(callers)
        assert abs(share - weight / 100) < 0.03
        assert all(picked[c] == 2 for c, v in on.items() if v == 2)  # once on the candidate, stays on it
        on = picked
    assert bucket("r1", "x") != bucket("r2", "x")


def _observed(base: tuple[int, int, float], cand: tuple[int, int, float]) -> dict[str, object]:
    def summary(n: int, errors: int, p99: float) -> dict[str, object]:
        return {"requests": n, "errors": errors, "error_rate": errors / n if n else 0.0, "p99_ms": p99 if n else None,
                "timed": n}

    return {"baseline": summary(*base), "candidate": summary(*cand)}


def test_the_verdicts_over_a_window() -> None:
    canary = Rollout(id="r", candidate=2, baseline=1, mode="canary", steps=(10, 100), interval_s=30,
                     criteria=RollbackCriteria(min_requests=20))
    # too few candidate answers: no verdict, whatever their errors
    assert verdict(canary, _observed((500, 0, 3), (19, 19, 3)), 100).action == "hold"
    bad = verdict(canary, _observed((500, 5, 3), (40, 4, 3)), 5)
    assert bad.action == "rollback" and "candidate error rate 10.0% (4 of 40)" in bad.reason
    assert verdict(canary, _observed((500, 5, 3), (40, 0, 3)), 5).action == "hold"  # the step is not over
    slow = verdict(canary, _observed((500, 0, 3), (120, 0, 12)), 5)
    assert slow.action == "rollback" and "p99 12.0 ms" in slow.reason and "9.5 ms" in slow.reason
    assert verdict(canary, _observed((500, 0, 3), (40, 0, 12)), 5).action == "hold"  # a p99 of 40 is their maximum
    assert verdict(canary, _observed((500, 0, 3), (120, 0, 9)), 31).action == "advance"
    # at 100% the baseline gets nothing: its p99 from the step before is the reference
    full = canary.model_copy(update={"step": 1, "observed": {"baseline": {"p99_ms": 3.0, "timed": 400}}})
    assert verdict(full, _observed((0, 0, 0), (150, 0, 12)), 5).action == "rollback"
    assert verdict(canary, _observed((500, 0, 3), (10, 0, 3)), 31).reason.startswith("waiting for 10 more")
    shadow = Rollout(id="s", candidate=2, baseline=1, mode="shadow", shadow=0.5,
                     criteria=RollbackCriteria(min_requests=20))
    observed = {**_observed((100, 0, 3), (50, 0, 3)), "shadow": {"rows": 200, "disagreement": 0.05}}
    assert verdict(shadow, observed, 999).action == "rollback"
    observed["shadow"] = {"rows": 200, "disagreement": 0.005}
    assert verdict(shadow, observed, 999).action == "hold"  # a shadow is promoted by hand


def test_the_book_keeps_a_sliding_window_per_arm(tmp_path: Path) -> None:
    now = [100.0]
    book = RolloutBook(ModelRegistry(str(tmp_path)), set(), lambda f: f(), lambda: now[0], lambda *a: None, "r")
    canary = Rollout(id="w", candidate=2, baseline=1, mode="canary", steps=(50,), criteria=RollbackCriteria(window_s=10))
    for i in range(10):
        book.record(Route(2, "candidate", canary), 500 if i < 3 else 200, 0.002)
        book.record(Route(1, "baseline", canary), 503, 0.001, shed=True)  # shed on purpose: not an error
        now[0] += 1
    seen = book.observed(canary)
    assert seen["candidate"]["requests"] == 10 and seen["candidate"]["errors"] == 3
    assert seen["baseline"]["errors"] == 0
    now[0] += 5.5  # the first six fall out of the window
    assert book.observed(canary)["candidate"] == {"requests": 4, "errors": 0, "error_rate": 0.0, "timed": 4,
                                                  "p99_ms": 2.0}
    book.record(Route(2, "candidate", canary), 200, None)  # a first answer (the model's load): no time
    assert book.observed(canary)["candidate"]["requests"] == 5 and book.observed(canary)["candidate"]["timed"] == 4
    assert Window().summary()["p99_ms"] is None


def _v2_json(labels: list[int], probabilities: list[list[float]]) -> bytes:
    return orjson.dumps({"model_name": MODEL, "outputs": [
        {"name": "label", "datatype": "INT64", "shape": [len(labels)], "data": labels},
        {"name": "probabilities", "datatype": "FP32", "shape": [len(labels), 2], "data": sum(probabilities, [])},
    ]})


def _v2_binary(labels: list[int], probabilities: list[list[float]]) -> tuple[list[tuple[bytes, bytes]], bytes]:
    raw_labels = np.asarray(labels, np.int64).tobytes()
    raw_probabilities = np.asarray(probabilities, np.float32).tobytes()
    head = json.dumps({"outputs": [
        {"name": "label", "datatype": "INT64", "shape": [len(labels)], "parameters": {"binary_data_size": len(raw_labels)}},
        {"name": "probabilities", "datatype": "FP32", "shape": [len(labels), 2],
         "parameters": {"binary_data_size": len(raw_probabilities)}},
    ]}).encode()
    body = gzip.compress(head + raw_labels + raw_probabilities)
    return [(b"Inference-Header-Content-Length", str(len(head)).encode()), (b"content-encoding", b"gzip")], body


def test_shadow_answers_are_judged_by_their_labels_in_every_layout() -> None:
    primary = decode_answer([], _v2_json([1, 0, 1, 1], [[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.4, 0.6]]))
    headers, body = _v2_binary([1, 0, 0, 1], [[0.2, 0.8], [0.7, 0.3], [0.6, 0.4], [0.45, 0.55]])
    shadow = decode_answer(headers, body)
    assert shadow["label"].tolist() == [1, 0, 0, 1] and shadow["probabilities"].shape == (4, 2)
    judged = compare(primary, shadow)
    assert (judged.rows, judged.disagree, judged.label_rows, judged.label_agree) == (4, 1, 4, 3)
    assert judged.max_delta == pytest.approx(0.3, abs=1e-6)  # measured, not judged
    assert compare(primary, primary).disagree == 0
    assert compare(primary, {"label": primary["label"]}).disagree == 4  # another set of outputs: all disagree


def test_embeddings_by_cosine_and_regressions_by_relative_delta() -> None:
    vectors = np.random.default_rng(0).normal(size=(3, 8))
    answer = orjson.dumps({"object": "list", "data": [{"index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]})
    turned = vectors.copy()
    turned[2] = -turned[2]
    other = orjson.dumps({"object": "list", "data": [{"index": i, "embedding": v.tolist()} for i, v in enumerate(turned)]})
    judged = compare(decode_answer([], answer), decode_answer([], other))
    assert judged.disagree == 1 and judged.min_cosine == pytest.approx(-1.0)
    near = {"prediction": np.array([100.0, 2.0])}
    assert compare(near, {"prediction": np.array([100.5, 2.0])}).disagree == 0
    assert compare(near, {"prediction": np.array([100.0, 2.1])}).disagree == 1
    with pytest.raises(ValueError):
        decode_answer([], b'{"error": "x"}')


def test_rollout_options_parse_or_say_what_to_write() -> None:
    assert parse_steps("1,5,25,100") == (1, 5, 25, 100) and parse_share("10%") == 0.1 and parse_share("0.5") == 0.5
    assert parse_duration("10m") == 600 and parse_duration("90") == 90 and parse_duration("500ms") == 0.5
    for bad, call in (("5,1", parse_steps), ("0,50", parse_steps), ("150%", parse_share), ("soon", parse_duration)):
        with pytest.raises(InvalidSetting, match="write e.g."):
            call(bad)


def test_a_report_per_router_is_kept_with_the_rollout(fresh: ModelRegistry) -> None:
    fresh.put_rollout_report(MODEL, "abc", "router-a", {"verdict": "hold"})
    fresh.put_rollout_report(MODEL, "abc", "router-b", {"verdict": "advance"})
    fresh.put_rollout_report(MODEL, "abc", "router-a", {"verdict": "rollback"})
    assert fresh.rollout_reports(MODEL, "abc") == {"router-a": {"verdict": "rollback"}, "router-b": {"verdict": "advance"}}
    assert datetime.now(timezone.utc) - fresh.alias_history(MODEL, "prod")[-1].at < timedelta(minutes=5)


def test_a_canary_too_fine_for_the_traffic_the_routers_saw_is_warned_of(fresh: ModelRegistry) -> None:
    defaults = RollbackCriteria()
    assert rollouts.observed_traffic(fresh, MODEL, "prod") is None
    assert rollouts.reach_warning(f"{MODEL}@prod", (1, 5, 25, 100), defaults, None) == (
        "no traffic of breast-cancer@prod is recorded (routers report it during rollouts); step 1% needs 50 "
        "candidate answers in 60 s, i.e. about 83 requests/s to the alias; at lower traffic use larger steps or "
        "--min-requests")
    started = rollouts.start(fresh, MODEL, "prod", 2, mode="canary", steps=(10, 100))
    assert started.rollout is not None
    for source, answers in (("router-a", 420), ("router-b", 180)):  # 600 answers in the 60 s window: 10/s
        now = [0.0]
        book = RolloutBook(fresh, set(), lambda f: f(), lambda: now[0], lambda *a: None, source)
        for i in range(answers):
            arm = "candidate" if i % 10 == 0 else "baseline"
            book.record(Route(2 if arm == "candidate" else 1, arm, started.rollout), 200, 0.002)
            now[0] += 59 / answers
        report = {"router": source, "at": "2026-12-01T10:00:00+00:00", **book.observed(started.rollout)}
        fresh.put_rollout_report(MODEL, started.rollout.id, source, report)  # as the router's refresh writes it
    rollouts.roll_back(fresh, MODEL, "prod", reason="aborted by hand")

    seen = rollouts.observed_traffic(fresh, MODEL, "prod")
    assert seen is not None and seen.rollout_id == started.rollout.id and seen.requests_per_s == pytest.approx(10.0)
    warning = rollouts.reach_warning(f"{MODEL}@prod", (1, 5, 25, 100), defaults, seen)
    assert warning == (
        f"the routers last saw about 10 requests/s on breast-cancer@prod (rollout {started.rollout.id}, 2026-12-01 "
        "10:00 UTC); steps 1%, 5% cannot reach 50 candidate answers in 60 s at that rate, so the rollout would hold "
        "there (no step, no automatic rollback): step 1% needs about 83 requests/s; use larger steps or a lower "
        "--min-requests")
    assert rollouts.reach_warning(f"{MODEL}@prod", (10, 50, 100), defaults, seen) is None  # 10% needs 8.3/s
    fewer = RollbackCriteria(min_requests=5)
    assert rollouts.reach_warning(f"{MODEL}@prod", (1, 5, 25, 100), fewer, seen) is None  # 1% needs 8.3/s
    assert rollouts.needed_rate(1, defaults) == pytest.approx(83.33, abs=0.01)
