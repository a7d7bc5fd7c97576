"""`shardline ... --help` as a user's terminal shows it: every command's help reads as paragraphs at 80 and 120
columns, flags show no value placeholder, and the help's escaped ``\\[default: ...]`` still renders."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections import Counter
from typing import Any, Iterator

import pytest
import typer.main

from shardline.cli.commands import app
from tests.e2e.conftest import SHARDLINE

SENTENCE_ENDS = (".", ":", ";", "!", "?")
TYPER_ITEM = re.compile(r"\[(default: .*|env var: .*|required)\]")  # typer's own lines under an option's help
WIDTHS = (80, 120)


def _command_paths(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        if not sub.hidden:
            yield from _command_paths(sub, (*path, name))


COMMANDS = list(_command_paths(typer.main.get_command(app)))


def _terminal(width: int) -> dict[str, str]:
    """A user's environment in a terminal of ``width`` columns (rich reads COLUMNS), no colour forced."""
    drop = ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS", "TERMINAL_WIDTH", "NO_COLOR")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_") and k not in drop}
    env.update(COLUMNS=str(width), PYTHONIOENCODING="utf-8")
    return env


def _help(words: tuple[str, ...], width: int) -> str:
    """`shardline WORDS --help` in a subprocess, in a terminal of ``width`` columns."""
    done = subprocess.run([*SHARDLINE, *words, "--help"], env=_terminal(width), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return done.stdout


# Every command's help, rendered by one process per width: the command's own click entry point, as
# `shardline WORDS --help` runs it (108 processes took 75 s of the suite; each renders the same).
_EVERY_HELP = """
import contextlib, io, json, sys
import typer.main
from shardline.cli.commands import app
command = typer.main.get_command(app)
shown = {}
for words in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = command.main([*words, "--help"], prog_name="shardline", standalone_mode=False)
    shown[" ".join(words)] = [code or 0, out.getvalue(), err.getvalue()]
print(json.dumps(shown))
"""


@functools.cache
def _every_help(width: int) -> dict[str, list[Any]]:
    done = subprocess.run([sys.executable, "-c", _EVERY_HELP, json.dumps(COMMANDS)], env=_terminal(width),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return json.loads(done.stdout)


def _cells(rows: list[str]) -> list[tuple[int, list[str]]]:
    """A panel's rows (between its borders) cut into its help cells, each with its width: the help column
    starts where most rows' last cell starts and ends before the panel's padding; a row with a name or a
    type left of it starts a new cell."""
    starts = Counter(list(re.finditer(r"(?:^\s*|\s{2,})(?=\S)", row.rstrip()))[-1].end() for row in rows if row.strip())
    x = starts.most_common(1)[0][0]
    cells: list[list[str]] = [[]]
    for row in rows:
        if row[:x].strip() or not row[x:].strip():
            cells.append([])
        if row[x:].strip():
            cells[-1].append(row[x:].strip())
    return [(max(len(rows[0]) - 1 - x, *map(len, c)), c) for c in cells if c]


def _paragraphs(shown: str) -> list[tuple[int, list[str]]]:
    """The rendered help cut into the runs of lines that each show one paragraph or one table cell, each
    with the width it was wrapped to (the terminal's, less one column of padding each side, outside panels)."""
    found: list[tuple[int, list[str]]] = []
    text: list[str] = []
    panel: list[str] | None = None
    width = 0
    for line in [*shown.splitlines(), ""]:
        if panel is None and text and not line.strip():
            found.append((max(width, *map(len, text)), text))
            text = []
        if line.startswith("╭"):
            panel = []
        elif line.startswith("╰") and panel is not None:
            found += _cells(panel)
            panel = None
        elif panel is not None:
            panel.append(line.rstrip("\n")[1:-1])
        elif line.strip():
            text.append(line.strip())
            width = len(line) - 2
    return found


def _breaks_not_made_by_wrapping(width: int, paragraph: list[str]) -> list[tuple[str, str]]:
    """Line breaks inside a paragraph wrapped to ``width`` that fall mid-sentence where the next word would
    have fitted: the renderer did not make them, a newline in the source did (the short orphan lines of
    issue 33). A break that the width forced (a long word, e.g. an environment variable's name in a narrow
    column) is not one of them."""
    return [(above, below) for above, below in zip(paragraph, paragraph[1:])
            if not above.endswith(SENTENCE_ENDS) and not TYPER_ITEM.fullmatch(below)
            and len(above) + 1 + len(below.split()[0]) <= width]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("words", COMMANDS, ids=lambda words: " ".join(words) or "shardline")
def test_every_commands_help_reads_as_paragraphs_with_flags_as_flags(words: tuple[str, ...], width: int) -> None:
    code, shown, errors = _every_help(width)[" ".join(words)]
    assert code == 0 and not errors, errors
    paragraphs = _paragraphs(shown)
    assert len(paragraphs) >= 3, shown  # usage, what the command does, its options
    broken = [b for wrapped, lines in paragraphs for b in _breaks_not_made_by_wrapping(wrapped, lines)]
    assert not broken, (f"`shardline {' '.join(words)} --help` at {width} columns breaks mid-sentence:\n"
                        + "\n".join(f"{above!r} / {below!r}" for above, below in broken) + "\n" + shown)
    assert "<bool>" not in shown and re.search(r"--help +Show this message", shown), shown


def test_the_breaks_it_finds_are_the_ones_a_newline_in_the_source_made() -> None:
    shown_before = [  # `shardline router --help` at 80 columns before issue 33: the source's lines re-wrapped
        "It authenticates tenants and holds their quotas for all replicas, pins each", "request's model",
        "version, sends a model to its replicas by rendezvous hashing with bounded", "loads, retries on"]
    assert _breaks_not_made_by_wrapping(78, shown_before) == [(shown_before[1], shown_before[2])]
    at_120 = ["It authenticates tenants and holds their quotas for all replicas, pins each request's model",
              "version, sends a model to its replicas by rendezvous hashing with bounded loads, retries on"]
    assert len(_breaks_not_made_by_wrapping(118, at_120)) == 1  # no short line, but a ragged paragraph
    narrow_cell = ["The tenants YAML (the one", "its replicas read)", "[SHARDLINE_TENANTS_FILE]."]
    assert _breaks_not_made_by_wrapping(25, narrow_cell) == []  # the long name could not follow on the short line
    assert _breaks_not_made_by_wrapping(30, ["Model reference: name@alias or", "name:version.", "[required]"]) == []


@pytest.mark.parametrize("width", WIDTHS)
def test_options_keep_their_placeholders_and_escaped_defaults(width: int) -> None:
    run = _help(("batch", "run"), width)
    assert re.search(r"--model +<str> +Model reference", run) and re.search(r"--json +Print the summary", run), run
    cells = [" ".join(lines) for _, lines in _paragraphs(_help(("router",), width))]
    assert "TCP port [default: 8080; SHARDLINE_ROUTER_PORT]." in cells, cells
    assert any(cell.startswith("It authenticates tenants and holds their quotas for all replicas, pins each "
                               "request's model version, sends a model") for cell in cells), cells
