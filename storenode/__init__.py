"""kvpool store node: registered memory segment, extent table, data server (DESIGN.md §1)."""
