"""How the ``shardline`` command's help reads: paragraphs the renderer wraps to the terminal, flags as flags.

Typer renders help with rich in its ``rich`` markup mode, which keeps every single newline of a command's
docstring after the first paragraph (and of the first paragraph in a group's command list). Docstrings here
are wrapped at ~100 columns in the source, so the terminal wrapped each source line again: short orphan
lines at 80 columns, ragged paragraphs at 120. Typer also shows a value placeholder (``<bool>``) beside
flags, which take no value. ``ParagraphHelp``, the root group's class, fixes both in one place for every
command under it, so no docstring has to be wrapped by hand.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Optional

import typer
from typer.core import TyperGroup

_LIST_ITEM = re.compile(r"[-*•] ")  # a line that starts a list item starts a line of its own


def as_paragraphs(text: str) -> str:
    """Help text as paragraphs: the lines of each paragraph joined, blank lines kept as paragraph breaks.

    A paragraph that is a literal block stays as written: one with an indented line (an example, a
    table) or one that starts with ``\\b`` (click's mark for "do not rewrap"). A line that starts a list
    item (``- ``, ``* ``, ``• ``) starts a new line. Whatever follows ``\\f`` (click's "help ends here")
    is kept untouched.
    """
    head, cut, tail = text.partition("\f")
    paragraphs = re.split(r"\n[ \t]*\n", inspect.cleandoc(head))
    return "\n\n".join(_joined(p) for p in paragraphs) + cut + tail


def _joined(paragraph: str) -> str:
    lines = paragraph.splitlines()
    if paragraph.startswith("\b") or any(line[:1] in (" ", "\t") for line in lines):
        return paragraph
    out: list[str] = []
    for line in lines:
        if out and not _LIST_ITEM.match(line):
            out[-1] = f"{out[-1]} {line.strip()}"
        else:
            out.append(line.strip())
    return "\n".join(out)


class ParagraphHelp(TyperGroup):
    """The root command group: before the command line is read, every command under it (itself included)
    gets its help, short help, epilog and options' help as paragraphs (``as_paragraphs``), and every flag
    an empty placeholder, so its help shows ``--json`` rather than ``--json <bool>``.

    Done in ``main``, not when the group is built: typer adds the completion options to the root after
    building it, and each command makes its ``--help`` option when first asked for its parameters.
    """

    def main(self, *args: Any, **kwargs: Any) -> Any:
        _help_as_paragraphs(self, None, None)
        return super().main(*args, **kwargs)


def _help_as_paragraphs(command: Any, parent: Optional[typer.Context], name: Optional[str]) -> None:
    for attr in ("help", "short_help", "epilog"):
        text = getattr(command, attr, None)
        if text:
            setattr(command, attr, as_paragraphs(text))
    ctx = command.context_class(command, parent=parent, info_name=name, **command.context_settings)
    for param in command.get_params(ctx):  # with the --help option, which this makes (as parsing would)
        if getattr(param, "help", None):
            param.help = as_paragraphs(param.help)
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # typer's help shows a flag's metavar where a value's type would be
    for sub_name, sub in getattr(command, "commands", {}).items():
        _help_as_paragraphs(sub, ctx, sub_name)
