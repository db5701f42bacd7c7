"""``python -m kvpool``: the ``kvpool`` command."""

from kvpool.cli.app import main

main()
