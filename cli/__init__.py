"""kvpool command line (typer): the commands in ``app.py``, each of which parses flags,
builds the config and calls one function of the module that does the work (``cluster.py``
starts local clusters, ``demo.py``, ``bench*.py``, ``proxy*.py`` the P/D proxy).

Installed as ``kvpool.cli`` (this folder; see docs/development.md).
"""
