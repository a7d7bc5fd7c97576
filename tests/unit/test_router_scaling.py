"""Scaling decisions (pure, the clock given) and the activator that holds requests while a replica starts."""

from __future__ import annotations

import asyncio

from shardline.online.router.scaling import Activator, Scaler, ScalePolicy, wanted

POLICY = ScalePolicy(target_in_flight=4, min_replicas=0, max_replicas=5, up_delay_s=2, down_delay_s=10)


def test_replicas_wanted_follow_demand_within_the_bounds() -> None:
    assert [wanted(d, POLICY) for d in (0, 0.5, 4, 4.5, 12, 100)] == [0, 1, 1, 2, 3, 5]
    assert wanted(0, ScalePolicy(min_replicas=2, max_replicas=4)) == 2


def test_from_zero_at_once_up_after_the_delay_down_after_a_quiet_window() -> None:
    scaler = Scaler(POLICY)
    scaler.observe(0.0, 1)
    assert scaler.decide(0.0, 0) == 1  # a request waits: no delay from zero
    for t in range(1, 3):  # 1.0, 2.0: a burst wanting 3
        scaler.observe(float(t), 12)
    assert scaler.decide(1.0, 1) == 1  # the burst has not held up_delay_s yet
    scaler.observe(3.0, 12)
    assert scaler.decide(3.0, 1) == 3  # wanted 3 for the last 2 s
    for t in range(4, 13):
        scaler.observe(float(t), 0)
    assert scaler.decide(12.0, 3) == 3  # 3 was wanted within the last 10 s
    for t in range(13, 15):
        scaler.observe(float(t), 0)
    assert scaler.decide(14.0, 3) == 0  # nothing wanted for 10 s: down to the minimum (zero)


def test_a_short_burst_starts_nothing_and_a_lull_stops_nothing() -> None:
    scaler = Scaler(POLICY)
    for t, demand in enumerate([4, 4, 16, 4, 4, 4, 0, 4, 4]):
        scaler.observe(float(t), demand)
        assert scaler.decide(float(t), 1) == 1


def test_the_activator_holds_requests_until_a_replica_is_ready_and_refuses_past_its_queue() -> None:
    async def scenario() -> tuple[list[bool], bool, bool, int]:
        activator = Activator(limit=3)
        held = [asyncio.create_task(activator.wait("m:1", 5.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        full = await activator.wait("m:1", 5.0)  # a fourth: the queue is full, refused at once
        counted = activator.waiting["m:1"]
        activator.notify()
        released = list(await asyncio.gather(*held))
        late = await activator.wait("m:1", 0.05)  # nobody notifies: its time runs out
        return released, full, late, counted

    released, full, late, counted = asyncio.run(scenario())
    assert released == [True, True, True] and counted == 3
    assert full is False and late is False
