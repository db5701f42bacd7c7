"""The contract between kvpool processes: messages, errors, layouts, keys, transports.

Everything here is free of process state; master, storenode and connector import it
and never each other (DESIGN.md §1).

Installed as ``kvpool.protocol`` (this folder; see docs/development.md).
"""
