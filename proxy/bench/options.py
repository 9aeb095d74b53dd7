"""Parsers for the comma lists and NAME=ARGS options of `npu-spec bench` and
`verify_cost` (shared, so neither command imports the other)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """A named set of extra command-line options (server or `npu-spec serve`)."""

    name: str
    args: list[str]


def int_list(text: str) -> list[int]:
    """'2,4,6' -> [2, 4, 6]; '' or 'none' -> []."""
    if text.strip().lower() in ("", "none"):
        return []
    return [int(x) for x in text.split(",") if x.strip()]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def context_list(text: str, natural: bool = True) -> list[int | None]:
    """'natural,512,4k' -> [None, 512, 4096] (natural: the prompts as written)."""
    out: list[int | None] = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        if natural and item in ("natural", "none", "0"):
            out.append(None)
        elif item.endswith("k"):
            out.append(int(float(item[:-1]) * 1024))
        else:
            out.append(int(item))
    return out


def comma_choices(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `allowed`."""
    items = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in items if m not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; from {', '.join(allowed)}")
    return items


def parse_variant(text: str) -> Variant:
    """'fa-off=-ngl 99 -fa off' -> Variant('fa-off', ['-ngl', '99', '-fa', 'off'])."""
    name, sep, args = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"variant {text!r}: write NAME=ARGS, e.g. 'base=-ngl 99'")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"variant {text!r} has no name")
    return Variant(name.strip(), shlex.split(args))
