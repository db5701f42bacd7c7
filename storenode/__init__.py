"""kvpool store node: registered memory segment, extent table, data server (DESIGN.md §1).

Installed as ``kvpool.storenode`` (this folder; see docs/development.md).
"""
