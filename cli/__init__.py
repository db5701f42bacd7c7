"""kvpool command line (typer): one module per noun; each command parses flags, builds
the config and calls one function.

Installed as ``kvpool.cli`` (this folder; see docs/development.md).
"""
