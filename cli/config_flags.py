"""Command-line flags generated from the typed config (protocol/config.py), as vLLM builds
its engine arguments from its config dataclasses: every scalar field of a section becomes
a ``--field-name`` option whose help is the field's description and whose shown default is
the config's. A flag given overrides its key; flags not given leave the config file, the
environment and the defaults as they are (protocol/config.py: precedence).
"""
from __future__ import annotations

import functools
import inspect
import types
from collections import Counter
from typing import Annotated, Any, Callable, Optional, Union, get_args, get_origin

import msgspec
import typer

_SCALARS = (bool, int, float, str)
_LABELS = {"storenode": "storenodes[]"}  # a section's place in the YAML, where its name differs


def _flag_type(tp: Any) -> tuple[type, str] | None:
    """``(option type, description)`` of a config field's type, or None for a field that is
    not one scalar (lists, sections). A union with ``str`` (a duration or size given as text
    or a number) is a string option; ``T | None`` is ``T``."""
    desc = ""
    if get_origin(tp) is Annotated:
        tp, *meta = get_args(tp)
        desc = next((m.description for m in meta if isinstance(m, msgspec.Meta) and m.description), "")
    args = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (Union, types.UnionType) else [tp]
    if not all(a in _SCALARS for a in args):
        return None
    return (str if str in args or len(args) != 1 else args[0]), desc


def section_options(section: str, struct: type, skip: frozenset[str] = frozenset()) -> list[inspect.Parameter]:
    """One keyword parameter per scalar field of ``struct`` (the config section ``section``),
    annotated as a typer option; its default is None (not given)."""
    out = []
    for f in msgspec.structs.fields(struct):
        got = None if f.name in skip else _flag_type(f.type)
        if got is None:
            continue
        typ, desc = got
        flag = "--" + f.name.replace("_", "-")
        decls = (f"{flag}/--no-{flag[2:]}",) if typ is bool else (flag,)
        default = f.default if f.default is not msgspec.NODEFAULT else None
        if isinstance(default, bool):
            default = str(default).lower()  # as YAML writes it
        shown = f"{_LABELS.get(section, section)}.{f.name}" + ("" if default is None else f"; default {default}")
        out.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            Optional[typ], typer.Option(*decls, help=f"{desc or f.name} (config {shown})", show_default=False)]))
    return out


def config_flags(**sections: type | tuple[type, frozenset[str]]) -> Callable[[Callable], Callable]:
    """Decorate a command: it gets the flags of each config section named (``master=MasterConfig``,
    or ``(struct, fields to skip)``) after its own parameters, and receives the flags that
    were given as ``overrides`` (section -> field -> value)."""
    gen: dict[str, list[inspect.Parameter]] = {}
    for section, spec in sections.items():
        struct, skip = spec if isinstance(spec, tuple) else (spec, frozenset())
        gen[section] = section_options(section, struct, skip)

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for name, p in sig.parameters.items() if name != "overrides"]
        taken = {p.name for p in own}
        extra = [p for params in gen.values() for p in params if p.name not in taken]
        names = {section: [p.name for p in params if p.name not in taken] for section, params in gen.items()}
        dup = [n for n, c in Counter(p.name for p in extra).items() if c > 1]
        if dup:
            raise TypeError(f"config flags named by several sections: {dup}")

        @functools.wraps(fn)
        def command(**kw: Any) -> Any:
            overrides = {}
            for section, fields in names.items():
                given = {n: v for n in fields if (v := kw.pop(n, None)) is not None}
                if given:
                    overrides[section] = given
            return fn(**kw, overrides=overrides)

        params = [*own, *extra]
        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap

