"""The help text the `shardline` command hands its renderer: paragraphs, whatever the source's line width; and the
commands the docs name are the command's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardline.cli.help_text import as_paragraphs

ROOT = Path(__file__).resolve().parents[2]


def test_the_lines_of_a_paragraph_are_joined_and_paragraph_breaks_kept() -> None:
    docstring = """Score every row of the input shards.

        Exit codes: 0 all scored, 3 some
        shards quarantined, 1 failed (re-run to resume).
        """
    assert as_paragraphs(docstring) == ("Score every row of the input shards.\n\n"
                                        "Exit codes: 0 all scored, 3 some shards quarantined, 1 failed (re-run to resume).")
    assert as_paragraphs(as_paragraphs(docstring)) == as_paragraphs(docstring)


def test_literal_blocks_list_items_and_what_follows_form_feed_stay_as_written() -> None:
    docstring = """Run a job.

        For example:

            shardline batch run --model churn@prod \\
              --input in/ --output out/
        """
    assert as_paragraphs(docstring) == ("Run a job.\n\nFor example:\n\n"
                                        "    shardline batch run --model churn@prod \\\n      --input in/ --output out/")
    kept = "\bname     what\nchurn    a classifier"
    assert as_paragraphs(f"Models:\n\n{kept}") == f"Models:\n\n{kept}"
    listed = "Exit codes:\n- 0 all scored\n- 2 the request\nwas wrong"
    assert as_paragraphs(listed) == "Exit codes:\n- 0 all scored\n- 2 the request was wrong"
    assert as_paragraphs("Shown\nhere.\f\nnot shown\nhere") == "Shown here.\f\nnot shown\nhere"


def _commands(command: Any, path: str = "shardline") -> dict[str, Any]:
    found = {path: command}
    for name, sub in (getattr(command, "commands", None) or {}).items():
        found |= _commands(sub, f"{path} {name}")
    return found


def test_every_shardline_command_the_docs_name_exists() -> None:
    import typer

    from shardline.cli import app

    commands = _commands(typer.main.get_command(app))
    pages = [*ROOT.glob("*.md"), *ROOT.glob("*/README.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob(
        "*.md")]
    wrong = []
    for page in sorted(set(pages)):
        for number, line in enumerate(page.read_text().splitlines(), 1):
            # `shardline WORD ...` in code, or `shardline GROUP WORD` anywhere (not kubectl's namespace `-n shardline`)
            for match in re.finditer(r"(`?)(?<!-n )shardline((?: [a-z][a-z0-9-]+)+)", line):
                words, path = match.group(2).split(), "shardline"
                for word in words:
                    if f"{path} {word}" not in commands:
                        break
                    path = f"{path} {word}"
                named = path.count(" ")
                is_group = bool(getattr(commands[path], "commands", None))
                if is_group and named < len(words) and (named or match.group(1)):
                    wrong.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0).strip('`')}")
    assert wrong == [], "commands that `shardline --help` does not list"
