"""Options as dataclass fields: one definition gives the CLI flag, the keyword and the config key.

An options class (``EngineArgs``, ``ServeArgs``) declares each option once with
``option(...)``: its default, help, choices and how a string parses. From that
``add_cli_args`` makes the ``--flag-name`` argparse flags (as vLLM's
``add_cli_args`` does), ``from_mapping`` builds the class from a ``serve.yaml``
``args:`` dict or ``build_app``'s dict, and keyword construction
(``LLM(max_num_seqs=8)``) is the dataclass itself. ``check_choices`` is the one
check of every field that has choices, whichever way the value came in.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def option(default: Any = dataclasses.MISSING, *, help: str, choices: tuple | None = None,
           aliases: tuple[str, ...] = (), parse: Callable[[str], Any] | None = None,
           default_factory: Callable[[], Any] | None = None, metavar: str | None = None,
           secret: bool = False, nargs: str | None = None) -> Any:
    """A dataclass field that is also a command-line flag and a config key.

    ``parse`` turns the flag's string into the value (default: the field's type);
    ``aliases`` are extra flag spellings (``-tp``); a ``secret``'s value is never shown in help;
    ``nargs="+"`` makes a list flag (``parse`` then turns each item)."""
    metadata = {"help": help, "choices": choices, "aliases": aliases, "parse": parse, "metavar": metavar,
                "secret": secret, "nargs": nargs}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata, repr=not secret)
    return dataclasses.field(default=default, metadata=metadata, repr=not secret)


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` declared with ``option``."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_name(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def default_of(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def add_cli_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                 only: tuple[str, ...] | None = None) -> None:
    """One flag per option of ``cls`` (or of those named in ``only``); each flag's dest is the
    field name and its default the field's."""
    hints = typing.get_type_hints(cls)
    for f in option_fields(cls):
        if only is not None and f.name not in only:
            continue
        kind = _base_type(hints[f.name])
        default = default_of(f)
        meta = f.metadata
        shown = default is not None and not meta["secret"]
        help_text = f"{meta['help']} (default: {default})" if shown else meta["help"]
        names = [flag_name(f), *meta["aliases"]]
        if kind is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=meta["help"])
            continue
        parse = _argparse_type(meta["parse"], f.name) if meta["parse"] else kind
        parser.add_argument(*names, dest=f.name, type=parse, nargs=meta["nargs"],
                            default=default, choices=meta["choices"], metavar=meta["metavar"], help=help_text)


def from_namespace(cls: type[T], namespace: argparse.Namespace) -> T:
    """The options of ``cls`` from parsed flags (``add_cli_args``)."""
    return cls(**{f.name: getattr(namespace, f.name) for f in option_fields(cls)})


def split_mapping(mapping: Mapping[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Split one flat ``args`` dict between options classes; an unknown key is an error."""
    parts: list[dict[str, Any]] = [{} for _ in classes]
    owners = {f.name: i for i, cls in enumerate(classes) for f in option_fields(cls)}
    unknown = sorted(set(mapping) - set(owners))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; known: {sorted(owners)}")
    for key, value in mapping.items():
        parts[owners[key]][key] = value
    return parts


def check_choices(obj: Any) -> None:
    """Raise ValueError naming the field for any option whose value is not one of its choices."""
    for f in option_fields(type(obj)):
        choices = f.metadata["choices"]
        value = getattr(obj, f.name)
        if value is None and f.default is None:  # an optional option left unset
            continue
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def parse_bytes(value: int | str) -> int:
    """``536870912``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` -> bytes (KiB/MiB/GiB binary, K/KB/M/MB/G/GB decimal)."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        result = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _BYTE_UNITS:
            raise ValueError(f"not a byte size: {value!r} (use e.g. 536870912, 512MiB, 2GiB)")
        result = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if result <= 0:
        raise ValueError(f"a byte size must be > 0, got {value!r}")
    return result


def _base_type(hint: Any) -> type:
    """``int | None`` -> ``int``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        raise TypeError(f"an option's type must be one type or that type | None, got {hint}")
    return hint


def _argparse_type(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{name}: {exc}") from exc

    convert.__name__ = getattr(parse, "__name__", name)  # argparse names the type in its error
    return convert
