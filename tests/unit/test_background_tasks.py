"""A server's background tasks stop within a bound (``shardline.online.background``), and no product code uses
``asyncio.wait_for``, which on Python 3.11 loses a cancel that meets its answer (CPython gh-86296): a router's
stop hung on such a loop until it was killed."""

from __future__ import annotations

import ast
import asyncio
import logging
import tomllib
from pathlib import Path

import pytest

from shardline.online.background import stop_tasks

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
PRODUCT = sorted(set(PACKAGE_DIRS.values()))  # the product's folders


def test_stop_tasks_ends_the_tasks_and_leaves_one_that_keeps_its_cancel_behind_named(
        caplog: pytest.LogCaptureFixture) -> None:
    ended: list[str] = []

    async def polite() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("polite")

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(polite(), name="polite"), loop.create_task(stubborn(), name="stubborn")]
        await asyncio.sleep(0)
        await stop_tasks(tasks, "the test", timeout_s=0.2)
        states = tasks[0].cancelled(), tasks[1].done()
        tasks[1].get_coro().close()  # type: ignore[union-attr]
        return states

    with caplog.at_level(logging.WARNING):
        polite_cancelled, stubborn_done = asyncio.run(main())
    assert polite_cancelled and ended == ["polite"]
    assert not stubborn_done
    assert "1 of the test's background tasks did not stop within 0 s; stopping without them: stubborn" in caplog.text


def test_stop_tasks_with_nothing_running_returns_at_once(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        done = asyncio.get_running_loop().create_task(asyncio.sleep(0))
        await done
        await stop_tasks([done], "the test")
        await stop_tasks([], "the test")

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert "did not stop" not in caplog.text


def test_no_product_code_calls_asyncio_wait_for() -> None:
    assert "online" in PRODUCT and "controller" in PRODUCT
    found = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr == "wait_for" and isinstance(node.value, ast.Name)
                        and node.value.id == "asyncio"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, ("asyncio.wait_for loses a cancel on Python 3.11 (gh-86296); use `async with "
                       f"asyncio.timeout(...)`: {', '.join(found)}")
