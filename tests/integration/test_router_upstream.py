"""The router's client to its replicas against real sockets on loopback: keep-alive reuse, chunked
answers, a replica that closes a kept-alive connection, one that dies mid-answer, one that is silent."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Awaitable, Callable

import pytest

from shardline.online.router.upstream import UpstreamFailed, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


async def _serve(handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_answers_come_back_whole_and_the_connection_is_kept() -> None:
    connections = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while True:
            try:
                head, body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            tenant = next(line for line in head.split(b"\r\n") if line.startswith(b"x-tenant"))
            if body == b"chunked":
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nX-Kind: Chunked\r\n\r\n"
                             b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            else:
                answer = body[::-1] + b"|" + tenant
                writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()

    async def main() -> None:
        server, port = await _serve(echo)
        pool = UpstreamPool("127.0.0.1", port)
        status, headers, body = await pool.request("POST", "/x", b"x-tenant: acme\r\n", b"hello", 5.0)
        assert (status, body) == (201, b"olleh|x-tenant: acme")
        status, headers, body = await pool.request("POST", "/x", b"x-tenant: acme\r\n", b"chunked", 5.0)
        assert (status, body) == (200, b"abcde") and (b"x-kind", b"Chunked") in headers
        assert len(connections) == 1  # both over one kept-alive connection
        pool.close()
        server.close()

    asyncio.run(main())


def test_a_kept_alive_connection_the_replica_closed_is_replaced_once() -> None:
    served = 0

    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await _read_request(reader)
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # its keep-alive ran out

    async def main() -> None:
        server, port = await _serve(one_then_close)
        pool = UpstreamPool("127.0.0.1", port)
        assert (await pool.request("GET", "/", b"", b"", 5.0))[0] == 200
        await asyncio.sleep(0.2)  # the replica has closed the idle connection by now
        assert (await pool.request("GET", "/", b"", b"", 5.0))[2] == b"ok"
        assert served == 2
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("behaviour", ["refused", "dies mid-answer", "silent", "not http"])
def test_no_answer_is_an_upstream_failure(behaviour: str) -> None:
    async def misbehave(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if behaviour == "dies mid-answer":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
            await writer.drain()
            writer.close()
        elif behaviour == "not http":
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
            await writer.drain()
        else:
            await asyncio.sleep(5)

    async def main() -> None:
        server, port = await _serve(misbehave)
        if behaviour == "refused":
            server.close()
            await server.wait_closed()
        pool = UpstreamPool("127.0.0.1", port)
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamFailed) as failed:
            await pool.request("POST", "/v2/models/m/infer", b"", b"{}", 0.3)
        assert asyncio.get_running_loop().time() - started < 2
        expected = {"refused": "cannot connect", "dies mid-answer": "in the middle of its answer",
                    "silent": "no answer within 300 ms", "not http": "is not HTTP"}[behaviour]
        assert expected in str(failed.value)
        server.close()

    asyncio.run(main())


def test_a_dns_group_is_the_addresses_its_name_resolves_to() -> None:
    from shardline.local_ports import reserve_port as free_port
    from shardline.online.models import ModelDirectory
    from shardline.online.router.config import DnsReplicas, ReplicaGroup, RouterConfig
    from shardline.online.router.health import BreakerPolicy
    from shardline.online.router.replicas import ReplicaSet
    from shardline.online.router.router import Router
    from shardline.online.router.service import RouterService
    from shardline.online.tenants import TenantDirectory
    from shardline.settings import RouterSettings

    port = free_port()  # nothing listens on it
    config = RouterConfig(groups=(ReplicaGroup(name="svc", dns=DnsReplicas(name="localhost", port=port)),))
    replicas = ReplicaSet(config, BreakerPolicy(), 0.0, time.monotonic)
    router = Router(RouterSettings(), TenantDirectory([], []), ModelDirectory(None, None, 5.0), replicas, "k" * 16)  # type: ignore[arg-type]
    service = RouterService(router, config)

    async def main() -> None:
        await service._resolve("svc")
        await service.check_all()  # every address it resolves to is a replica, and none is ready

    asyncio.run(main())
    assert f"http://127.0.0.1:{port}" in replicas.replicas
    assert set(replicas.replicas) <= {f"http://127.0.0.1:{port}", f"http://[::1]:{port}"}
    assert not any(r.healthy for r in replicas.replicas.values())


def _replica(delay_s: dict[str, float], name: str, seen: list[str]) -> Handler:
    """A stand-in replica on a real socket: health 200; anything else answers ``name`` after ``delay_s[name]``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            seen.append(name)
            if b"/health/" not in head.split(b"\r\n")[0]:
                await asyncio.sleep(delay_s[name])
            answer = b'{"replica": "%s"}' % name.encode()
            try:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(answer), answer))
                await writer.drain()
            except ConnectionError:
                return

    return handler


def _router(urls: list[str], models: tuple[str, ...] = ("m@prod",), **settings: float) -> "tuple[object, object]":
    from shardline.online.models import ModelDirectory
    from shardline.online.router.config import ReplicaGroup, RouterConfig
    from shardline.online.router.health import BreakerPolicy
    from shardline.online.router.replicas import ReplicaSet
    from shardline.online.router.router import Router
    from shardline.online.tenants import TenantDirectory, hash_api_key
    from shardline.settings import RouterSettings

    tenants = TenantDirectory.from_config({"tenants": [
        {"name": "acme", "api_keys_sha256": [hash_api_key("sk-acme")], "models": list(models)}]})
    replicas = ReplicaSet(RouterConfig(groups=(ReplicaGroup(name="g", replicas=tuple(urls)),)), BreakerPolicy(), 0.0,
                          time.monotonic)
    for replica in replicas.replicas.values():
        replica.healthy = True
    router = Router(RouterSettings(**settings), tenants, ModelDirectory(None, None, 5.0), replicas, "k" * 16)  # type: ignore[arg-type]
    return router, replicas


@pytest.mark.parametrize("hedge_ms", [0, 40])
def test_a_hedged_request_is_answered_by_the_faster_copy_and_the_slow_one_is_cancelled(hedge_ms: int) -> None:
    from shardline.online.router.messages import Incoming
    from shardline.online.router.placement import rank

    seen: list[str] = []

    async def main() -> tuple[list[bytes], object]:
        delays: dict[str, float] = {}
        servers = {}
        for name in ("a", "b"):
            servers[name] = await _serve(_replica(delays, name, seen))
        urls = {f"http://127.0.0.1:{port}": name for name, (_, port) in servers.items()}
        first = urls[rank("m:1", list(urls))[0]]  # the replica the model's requests go to first: make it slow
        delays.update({first: 0.4, ("b" if first == "a" else "a"): 0.0})
        router, replicas = _router(list(urls), hedge_after_ms=hedge_ms)
        bodies = []
        for _ in range(4):
            answer = await router.handle(Incoming("POST", "/v2/models/m/versions/1/infer", b"",  # type: ignore[attr-defined]
                                                  [(b"authorization", b"Bearer sk-acme")], b"{}"))
            assert answer.status == 200
            bodies.append(answer.body)
        states = {r.breaker.state for r in replicas.replicas.values()}  # type: ignore[attr-defined]
        await router.stop()  # type: ignore[attr-defined]
        for server, _ in servers.values():
            server.close()
        return bodies, (first, states, router.metrics)  # type: ignore[attr-defined]

    bodies, (slow, states, metrics) = asyncio.run(main())
    fast = "b" if slow == "a" else "a"
    if hedge_ms:
        assert bodies == [b'{"replica": "%s"}' % fast.encode()] * 4  # the copy sent after 40 ms won each time
        assert states == {"closed"}  # the cancelled copies are no fault of the slow replica
        assert metrics.hedges.labels("second")._value.get() == 4  # type: ignore[attr-defined]
    else:
        assert bodies == [b'{"replica": "%s"}' % slow.encode()] * 4  # no hedge: the first replica's answer, waited for
        assert metrics.hedges.labels("second")._value.get() == 0  # type: ignore[attr-defined]


def test_an_openai_body_is_pinned_to_the_callers_canary_version_and_mirrored_in_shadow() -> None:
    """The rollout's pick for an OpenAI body (``"model": "emb"``): the candidate for the callers under the
    weight, the baseline for the rest; in shadow every caller gets the baseline and a copy goes to the candidate."""
    import json

    from shardline.online.router.messages import Incoming
    from shardline.online.router.rollouts import RolloutBook, bucket
    from shardline.storage.registry import AliasMove
    from shardline.storage.rollouts import Rollout

    models_seen: list[str] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                _, body = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            model = json.loads(body)["model"]
            models_seen.append(model)
            answer = json.dumps({"object": "list", "model": model,
                                 "data": [{"object": "embedding", "index": 0, "embedding": [1.0, 0.0]}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()

    canary = Rollout(id="r-openai", candidate=2, baseline=1, mode="canary", steps=(50,))
    shadow = Rollout(id="s-openai", candidate=2, baseline=1, mode="shadow", shadow=1.0)

    async def main() -> tuple[dict[str, str], list[str], object]:
        server, port = await _serve(echo)
        router, _ = _router([f"http://127.0.0.1:{port}"], ("emb@prod",))
        book = RolloutBook(None, set(), None, time.monotonic, lambda *a: None, "test")  # type: ignore[arg-type]
        router.rollouts = book  # type: ignore[attr-defined]
        book.moves[("emb", "prod")] = AliasMove(seq=2, alias="prod", version=1, action="canary", by="t", rollout=canary)
        got = {}
        for key in (f"user-{i}" for i in range(20)):
            answer = await router.handle(Incoming(  # type: ignore[attr-defined]
                "POST", "/v1/embeddings", b"", [(b"authorization", b"Bearer sk-acme"), (b"x-shardline-route-key", key.encode())],
                b'{"model": "emb", "input": "hi"}'))
            got[key] = json.loads(answer.body)["model"]
        models_seen.clear()
        book.moves[("emb", "prod")] = AliasMove(seq=3, alias="prod", version=1, action="shadow", by="t", rollout=shadow)
        answer = await router.handle(Incoming(  # type: ignore[attr-defined]
            "POST", "/v1/embeddings", b"", [(b"authorization", b"Bearer sk-acme")], b'{"model": "emb", "input": "hi"}'))
        for _ in range(50):
            if len(models_seen) == 2 and book.shadows.get("s-openai"):
                break
            await asyncio.sleep(0.02)
        seen = list(models_seen)
        await router.stop()  # type: ignore[attr-defined]
        server.close()
        return got, seen, (json.loads(answer.body)["model"], book.observed(shadow)["shadow"])

    got, seen, (answered, compared) = asyncio.run(main())
    assert got == {k: ("emb:2" if bucket("r-openai", k) < 50 else "emb:1") for k in got}
    assert set(got.values()) == {"emb:1", "emb:2"}  # 20 callers split by the weight
    assert answered == "emb:1" and sorted(seen) == ["emb:1", "emb:2"]  # the caller got the baseline; a copy went on
    assert compared["rows"] == 1 and compared["disagree"] == 0 and compared["min_cosine"] == 1.0


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/chat/completions"])
def test_an_openai_body_the_router_cannot_pin_is_refused_in_serves_words(path: str) -> None:
    """A body that is not JSON, not an object, or names no model: the router's 400 says what ``serve`` says (and
    OpenAI's ``param`` names the field), before any replica is asked."""
    import json

    from shardline.errors import InvalidInput
    from shardline.online.router.messages import Incoming
    from shardline.openai_wire import parse_embedding_request, parse_generation_request

    bodies = [b"{not json", b"[1, 2]", b'{"input": "hi"}', b'{"model": " ", "messages": []}']

    def serves(body: bytes) -> str:
        with pytest.raises(InvalidInput) as refused:
            if path == "/v1/embeddings":
                parse_embedding_request(body)
            else:
                parse_generation_request(body, chat=True)
        return str(refused.value)

    async def main() -> list[tuple[int, dict]]:
        router, _ = _router(["http://127.0.0.1:9"], ("emb@prod",))  # nothing listens there: no replica is asked
        answers = []
        for body in bodies:
            answer = await router.handle(Incoming(  # type: ignore[attr-defined]
                "POST", path, b"", [(b"authorization", b"Bearer sk-acme")], body))
            answers.append((answer.status, json.loads(answer.body)["error"]))
        await router.stop()  # type: ignore[attr-defined]
        return answers

    answers = asyncio.run(main())
    assert [status for status, _ in answers] == [400] * 4
    assert [error["message"] for _, error in answers] == [serves(body) for body in bodies]
    assert [error["param"] for _, error in answers] == [None, None, "model", "model"]
    assert answers[2][1]["message"].startswith("field 'model' is missing or not a string; name "
                                               f"{'an embedding' if path == '/v1/embeddings' else 'a text-generation'}")


def test_a_callers_request_id_reaches_the_replica_byte_for_byte_and_one_is_made_when_none_came() -> None:
    from shardline.online.router.messages import Incoming

    heads: list[bytes] = []

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            heads.append(head)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()

    async def main() -> list[int]:
        server, port = await _serve(replica)
        router, _ = _router([f"http://127.0.0.1:{port}"])
        statuses = []
        for extra in ([(b"x-request-id", b"caller-\xe9-7")], []):  # a Latin-1 byte, as HTTP allows in a value
            answer = await router.handle(Incoming("POST", "/v2/models/m/versions/1/infer", b"",  # type: ignore[attr-defined]
                                                  [(b"authorization", b"Bearer sk-acme"), *extra], b"{}"))
            statuses.append(answer.status)
        await router.stop()  # type: ignore[attr-defined]
        server.close()
        return statuses

    assert asyncio.run(main()) == [200, 200]
    ids = [[line.split(b": ", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"x-request-id:")]
           for head in heads]
    assert ids[0] == [b"caller-\xe9-7"]  # once, as the caller sent it
    assert len(ids[1]) == 1 and re.fullmatch(rb"[0-9a-f]{32}", ids[1][0])


def test_the_router_stops_its_background_loops_even_when_one_loses_its_cancel(caplog: pytest.LogCaptureFixture) -> None:
    """Python 3.11's ``asyncio.wait_for`` returns a result that came in the same turn as a cancel, which is then
    lost (CPython gh-86296): a router's front sync loop went on and its stop hung until it was killed. A loop ends
    at ``stop`` all the same, and ``stop`` waits for none of them past its bound."""
    from shardline.local_ports import reserve_port as free_port
    from shardline.online.models import ModelDirectory
    from shardline.online.router.config import ReplicaGroup, RouterConfig
    from shardline.online.router.health import BreakerPolicy
    from shardline.online.router.replicas import ReplicaSet
    from shardline.online.router.router import Router
    from shardline.online.router.service import RouterService
    from shardline.online.tenants import TenantDirectory
    from shardline.settings import RouterSettings

    config = RouterConfig(groups=(ReplicaGroup(name="svc", replicas=(f"http://127.0.0.1:{free_port()}",)),))
    replicas = ReplicaSet(config, BreakerPolicy(), 0.0, time.monotonic)
    directory = ModelDirectory(None, None, 5.0)  # type: ignore[arg-type]
    router = Router(RouterSettings(), TenantDirectory([], []), directory, replicas, "k" * 16)
    service = RouterService(router, config)
    rounds: list[float] = []

    async def swallows_a_cancel() -> None:
        rounds.append(time.monotonic())
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if len(rounds) > 1:
                raise
            # the first cancel is lost, as wait_for loses one that meets its answer

    async def main() -> list[asyncio.Task[None]]:
        await service.start()
        service._repeat("stubborn", 0.01, swallows_a_cancel)
        tasks = list(service._tasks)
        while not rounds:
            await asyncio.sleep(0.01)
        await service.stop()
        return tasks

    with caplog.at_level(logging.WARNING):
        tasks = asyncio.run(main())
    assert tasks and all(task.done() for task in tasks)  # every loop ended within stop, none left behind
    assert len(rounds) == 1  # the stubborn one did not go round again after its lost cancel
    assert "did not stop" not in caplog.text
