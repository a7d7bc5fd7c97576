"""``python -m shardline.cli``: the ``shardline`` command."""

from shardline.cli.commands import main

main()
