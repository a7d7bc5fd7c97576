"""The router's pure decisions: rendezvous hashing with bounded loads, the breaker, the retry budget,
backoff, deadlines, and failover between groups with hysteresis."""

from __future__ import annotations

import random

import pytest

from shardline.online.router.config import ReplicaGroup, RouterConfig, parse_router_config
from shardline.online.router.health import Breaker, BreakerPolicy, Deadline, RetryBudget, backoff_s, stalled
from shardline.online.router.placement import choose, load_bound, rank
from shardline.online.router.replicas import ReplicaSet
from shardline.errors import InvalidSetting


def _replicas(n: int, seed: int) -> list[str]:
    return [f"http://10.{seed % 250}.{i // 250}.{i % 250}:8000" for i in range(n)]


def _owner(keys: list[str], replicas: list[str]) -> dict[str, str]:
    return {k: rank(k, replicas)[0] for k in keys}


@pytest.mark.parametrize("n", [3, 5, 10, 20])
def test_adding_or_removing_one_of_n_replicas_moves_about_one_nth_of_the_models(n: int) -> None:
    keys = [f"model-{i}:{i % 7 + 1}" for i in range(2000)]
    moved_add, moved_remove = [], []
    for seed in range(5):
        replicas = _replicas(n, seed)
        added = f"http://10.{seed}.99.99:8000"
        before = _owner(keys, replicas)
        grown = _owner(keys, [*replicas, added])
        shrunk = _owner(keys, replicas[:-1])
        # a key moves only to the new replica, or off the removed one
        assert all(grown[k] in (before[k], added) for k in keys)
        assert all(shrunk[k] == before[k] for k in keys if before[k] != replicas[-1])
        moved_add.append(sum(grown[k] != before[k] for k in keys) / len(keys))
        moved_remove.append(sum(shrunk[k] != before[k] for k in keys) / len(keys))
    assert max(moved_add) <= 1.5 / (n + 1) and max(moved_remove) <= 1.5 / n  # each seed (sampling: 2,000 keys)
    assert 0.8 / (n + 1) <= sum(moved_add) / len(moved_add) <= 1.2 / (n + 1)  # over the seeds
    assert 0.8 / n <= sum(moved_remove) / len(moved_remove) <= 1.2 / n


@pytest.mark.parametrize("balance", [1.0, 1.25, 2.0])
def test_no_replica_carries_more_than_c_times_the_mean(balance: float) -> None:
    rng = random.Random(7)
    replicas = _replicas(8, 1)
    loads = {r: 0 for r in replicas}
    hot = ["hot-model:1"] * 600 + [f"m{rng.randrange(30)}:1" for _ in range(400)]  # one model takes 60% of traffic
    rng.shuffle(hot)
    for i, key in enumerate(hot):
        picked = choose(rank(key, replicas), loads, balance)
        assert picked is not None
        loads[picked] += 1
        mean = (i + 1) / len(replicas)
        assert max(loads.values()) <= max(1, -(-balance * (i + 1) // len(replicas))), (i, loads)
        assert max(loads.values()) <= balance * mean + 1
    assert min(loads.values()) > 0  # the hot model spilled everywhere


def test_a_model_stays_on_its_first_replica_until_that_one_is_over_the_bound() -> None:
    replicas = _replicas(4, 2)
    order = rank("churn:3", replicas)
    assert rank("churn:3", list(reversed(replicas))) == order  # the order is the key's, not the list's
    assert choose(order, {r: 0 for r in replicas}) == order[0]
    assert load_bound(4, 4, 1.25) == 2
    assert choose(order, {r: 1 for r in replicas}) == order[0]  # 1 < bound 2
    assert load_bound(2, 4, 1.25) == 1
    assert choose(order, {order[0]: 2}) == order[1]  # over the bound: spills to the next in its order
    assert choose(order, {}, skip={order[0]}) == order[1]
    assert choose(order, {}, skip=set(order)) is None
    with pytest.raises(ValueError, match="at least 1.0"):
        load_bound(1, 2, 0.9)


def test_the_breaker_opens_half_opens_and_closes() -> None:
    breaker = Breaker(BreakerPolicy(consecutive_failures=3, open_s=2.0, probes=2))
    for t in range(2):
        breaker.record(False, float(t))
    assert breaker.state == "closed" and breaker.allows(2.0)
    breaker.record(False, 2.0)
    assert breaker.state == "open" and not breaker.allows(3.0) and breaker.closed_to(3.0)
    assert breaker.allows(4.1) and breaker.state == "half_open"  # the first probe
    assert breaker.allows(4.1) and not breaker.allows(4.1)  # two probes at a time, no more
    breaker.record(True, 4.2)
    breaker.record(True, 4.3)
    assert breaker.state == "closed" and breaker.allows(4.4)


def test_a_failed_probe_opens_the_breaker_for_twice_as_long() -> None:
    breaker = Breaker(BreakerPolicy(consecutive_failures=1, open_s=1.0, max_open_s=3.0))
    breaker.record(False, 0.0)
    assert breaker.allows(1.0)
    breaker.record(False, 1.0)
    assert breaker.state == "open" and breaker.open_for == 2.0 and not breaker.allows(2.9)
    assert breaker.allows(3.0)
    breaker.record(False, 3.0)
    assert breaker.open_for == 3.0  # capped


def test_the_breaker_opens_on_the_error_rate_with_a_minimum_sample() -> None:
    breaker = Breaker(BreakerPolicy(consecutive_failures=100, error_rate=0.5, min_requests=10, window_s=10))
    for i in range(9):
        breaker.record(i % 3 != 0 and i % 2 == 0, i * 0.1)  # mostly failing, but fewer than 10 answers
    assert breaker.state == "closed"
    for i in range(6):
        breaker.record(False, 1.0 + i * 0.1)
    assert breaker.state == "open"


def test_the_retry_budget_is_a_share_of_the_traffic_plus_a_floor() -> None:
    budget = RetryBudget(ratio=0.2, min_per_s=0.5, window_s=10)  # floor: 5 retries per 10 s
    for _ in range(100):
        budget.request(0.0)
    granted = sum(budget.try_retry(0.5) for _ in range(40))
    assert granted == 25  # 20% of 100 + 5
    assert not budget.try_retry(5.0)
    assert budget.try_retry(11.0)  # the window moved on


def test_the_fast_lanes_requests_and_retries_count_in_the_same_budget() -> None:
    budget = RetryBudget(ratio=0.1, min_per_s=0.0, window_s=10)
    budget.record(0.2, requests=100, retries=9)  # the fast lane's counts, as read
    assert budget.has_room(0.4) and budget.try_retry(0.4)  # the 10th of 10% of 100
    assert not budget.has_room(0.5) and not budget.try_retry(0.5)
    budget.record(0.7, requests=20, retries=0)
    assert sum(budget.try_retry(0.8) for _ in range(5)) == 2  # 10% of 120 = 12
    assert not budget.has_room(9.9)
    budget.record(10.0, requests=10, retries=0)
    assert budget.try_retry(10.0) and not budget.has_room(10.0)  # the window moved on: 10% of 10


def test_backoff_is_full_jitter_and_capped() -> None:
    assert backoff_s(1, 0.5, base_s=0.01, cap_s=1) == pytest.approx(0.005)
    assert backoff_s(4, 0.999, base_s=0.01, cap_s=1) == pytest.approx(0.0799, rel=1e-3)
    assert backoff_s(20, 1.0, base_s=0.01, cap_s=0.25) == 0.25
    assert backoff_s(3, 0.0) == 0.0
    with pytest.raises(ValueError):
        backoff_s(0, 0.5)


def test_the_deadline_honours_the_header_within_the_maximum() -> None:
    assert Deadline.from_header("250", 10.0, 30.0, 300.0).at == pytest.approx(10.25)
    assert Deadline.from_header(None, 10.0, 30.0, 300.0).at == 40.0
    assert Deadline.from_header("nonsense", 10.0, 30.0, 300.0).at == 40.0
    assert Deadline.from_header("-5", 10.0, 30.0, 300.0).at == 40.0
    assert Deadline.from_header("9999999", 10.0, 30.0, 300.0).at == 310.0
    assert Deadline(12.5).header(12.0) == "500" and Deadline(12.0).header(13.0) == "1"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_traffic_fails_over_by_priority_and_comes_back_only_after_failback() -> None:
    config = RouterConfig(groups=(
        ReplicaGroup(name="west", priority=1, replicas=("http://w1:8000",)),
        ReplicaGroup(name="east", priority=0, replicas=("http://e1:8000", "http://e2:8000")),
    ))
    clock = Clock()
    replicas = ReplicaSet(config, BreakerPolicy(), failback_s=10.0, clock=clock)
    assert replicas.active_group() is None and replicas.order("m:1") == []
    for r in replicas.replicas.values():
        r.healthy = True
    assert replicas.active_group() == "east"
    assert [r.group for r in replicas.order("m:1")] == ["east", "east", "west"]

    clock.now = 5.0
    for url in ("http://e1:8000", "http://e2:8000"):
        replicas.replicas[url].healthy = False
    assert replicas.active_group() == "west" and [r.url for r in replicas.order("m:1")] == ["http://w1:8000"]

    clock.now = 6.0
    replicas.replicas["http://e1:8000"].healthy = True
    assert replicas.active_group() == "west"  # back, but not for failback_s yet
    clock.now = 15.9
    assert replicas.active_group() == "west"
    clock.now = 16.0
    assert replicas.active_group() == "east"
    assert [r.url for r in replicas.order("m:1")][0] == "http://e1:8000"


def test_a_preferred_group_comes_first_and_the_rest_stay_in_their_order() -> None:
    """A tenant past its budget's soft limit prefers the model's cheaper group; without one up, the usual order."""
    config = RouterConfig(groups=(
        ReplicaGroup(name="gpu", priority=0, replicas=("http://g1:8000", "http://g2:8000")),
        ReplicaGroup(name="cpu", priority=1, replicas=("http://c1:8000",)),
        ReplicaGroup(name="far", priority=2, replicas=("http://f1:8000",)),
    ))
    replicas = ReplicaSet(config, BreakerPolicy(), 0.0, Clock())
    for r in replicas.replicas.values():
        r.healthy = True
    assert [r.group for r in replicas.order("m:1", prefer="cpu")] == ["cpu", "gpu", "gpu", "far"]
    assert [r.group for r in replicas.order("m:1")] == ["gpu", "gpu", "cpu", "far"]
    replicas.replicas["http://c1:8000"].healthy = False
    assert [r.group for r in replicas.order("m:1", prefer="cpu")] == ["gpu", "gpu", "far"]


def test_set_members_keeps_the_state_of_replicas_that_stay() -> None:
    config = RouterConfig(groups=(ReplicaGroup(name="dns", replicas=("http://a:1", "http://b:1")),))
    replicas = ReplicaSet(config, BreakerPolicy(), 0.0, Clock())
    replicas.replicas["http://a:1"].healthy = True
    replicas.set_members("dns", ["http://a:1", "http://c:1"])
    assert set(replicas.replicas) == {"http://a:1", "http://c:1"}
    assert replicas.replicas["http://a:1"].healthy and not replicas.replicas["http://c:1"].healthy


def test_a_bad_router_config_names_the_field() -> None:
    with pytest.raises(InvalidSetting, match=r"groups\[0\]: Value error, give a group either 'replicas'"):
        parse_router_config({"groups": [{"name": "a"}]}, "router.yaml")
    with pytest.raises(InvalidSetting, match=r"groups\[0\]\.replicas: Value error, '10.0.0.1:8000' is not a replica address"):
        parse_router_config({"groups": [{"name": "a", "replicas": ["10.0.0.1:8000"]}]}, "router.yaml")
    with pytest.raises(InvalidSetting, match="group names must be unique"):
        parse_router_config({"groups": [{"name": "a", "replicas": ["http://x:1"]},
                                        {"name": "a", "replicas": ["http://y:1"]}]}, "router.yaml")
    with pytest.raises(InvalidSetting, match="the fallback of 'churn' names group 'cpu', which is not one of the groups"):
        parse_router_config({"groups": [{"name": "a", "replicas": ["http://x:1"]}],
                             "fallbacks": [{"model": "churn", "variant": "int8", "group": "cpu"}]}, "router.yaml")


def test_a_replica_much_slower_than_the_others_for_the_same_models_is_ejected_for_a_while() -> None:
    from shardline.online.router.health import OutlierPolicy, latency_outliers

    policy = OutlierPolicy(min_answers=20)
    figures = {"a": {"m:1": (4.0, 50), "n:1": (40.0, 50)}, "b": {"m:1": (5.0, 50)}, "c": {"m:1": (60.0, 50)},
               "d": {"n:1": (45.0, 50)}}
    # c is 12x the others on m:1; a's 40 ms on n:1 is that model's own time (d takes as long): only c
    assert latency_outliers(figures, policy) == ["c"]
    assert latency_outliers({**figures, "c": {"m:1": (60.0, 5)}}, policy) == []  # too few answers to judge
    assert latency_outliers({"a": {"m:1": (1.0, 50)}, "b": {"m:1": (9.0, 50)}, "c": {"m:1": (1.2, 50)}}, policy) == []
    assert latency_outliers({"a": {"m:1": (4.0, 50)}, "b": {"m:1": (60.0, 50)}}, policy) == []  # never one of two

    config = RouterConfig(groups=(ReplicaGroup(name="g", replicas=tuple(f"http://10.0.0.{i}:8000" for i in range(3))),))
    now = [100.0]
    replicas = ReplicaSet(config, BreakerPolicy(), 0.0, lambda: now[0])
    urls = list(replicas.replicas)
    for url, ms in zip(urls, (4.0, 5.0, 60.0)):
        replicas.replicas[url].healthy = True
        for _ in range(30):
            replicas.replicas[url].answered("m:1", ms)
    assert replicas.eject_outliers(now[0], policy) == [urls[2]]
    assert not replicas.available(replicas.replicas[urls[2]], now[0]) and len(replicas.order("m:1")) == 2
    now[0] += policy.eject_s
    assert replicas.eject_outliers(now[0], policy) == []  # back, with its figures started afresh
    assert replicas.available(replicas.replicas[urls[2]], now[0]) and replicas.replicas[urls[2]].latency == {}


def test_a_replica_is_probed_when_its_oldest_try_stalled_and_it_answered_nothing_since() -> None:
    stall = 0.25
    assert not stalled(None, 0.0, 0.0, 10.0, stall)  # nothing waits
    assert not stalled(9.9, 0.0, 0.0, 10.0, stall)  # waited 100 ms: not yet
    assert stalled(9.7, 9.0, 0.0, 10.0, stall)  # waited 300 ms, nothing heard since it was sent
    assert not stalled(9.7, 9.8, 0.0, 10.0, stall)  # it answered another meanwhile: slow for this one, not hung
    assert not stalled(9.7, 9.0, 9.9, 10.0, stall)  # probed 100 ms ago: not again yet
    assert stalled(9.7, 9.0, 9.7, 10.0, stall)  # probed a stall time ago (and it answered): again
    assert not stalled(9.0, 0.0, 0.0, 10.0, 0.0)  # stall 0: off
