"""``python -m shardplan.cli``: the ``shardplan`` command."""

from shardplan.cli import run

run()
