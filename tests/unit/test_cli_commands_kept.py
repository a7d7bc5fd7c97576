"""The CLI a user scripts against is kept: every command and option of the CLI before the layers were split
(commit 773d186, its tree in data/cli_commands_773d186.jsonl) is still there with the same type, default,
requiredness and flag-ness. New commands and options may be added; none may change or go."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import typer

from shardline.cli import app

BEFORE = Path(__file__).parent / "data" / "cli_commands_773d186.jsonl"


def command_tree() -> dict[str, dict[str, dict[str, Any]]]:
    """Every command's path -> its parameters by name (names, type, default, required, flag, multiple)."""
    tree: dict[str, dict[str, dict[str, Any]]] = {}

    def walk(command: click.Command, path: list[str]) -> None:
        tree[" ".join(path)] = {p.name or "": {
            "name": p.name, "opts": sorted(p.opts + p.secondary_opts), "kind": type(p).__name__,
            "type": str(getattr(p, "type", "")), "default": "callable" if callable(p.default) else repr(p.default),
            "required": p.required, "flag": getattr(p, "is_flag", False), "multiple": p.multiple,
        } for p in command.params}
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), ["shardline"])
    return tree


def test_every_command_and_option_of_before_the_split_is_kept_as_it_was() -> None:
    now = command_tree()
    lost: list[str] = []
    for line in BEFORE.read_text().splitlines():
        before = json.loads(line)
        command = before["command"]
        if command not in now:
            lost.append(f"{command}: gone")
            continue
        for param in before["params"]:
            kept = now[command].get(param["name"])
            if kept is None:
                lost.append(f"{command} {param['opts']}: gone")
            elif kept != param:
                lost.append(f"{command} {param['opts']}: was {param}, now {kept}")
    assert not lost, "\n".join(lost)
    assert len(now) >= 38
