"""Sweeps: `--sweep dotted.key=v1,v2,...` parsed (one-line errors naming the flag), expanded into one override
list per array task (the cartesian product, first key slowest), and a readable distinct run name for each. No torch.
"""

from __future__ import annotations

import itertools
import re
from typing import Sequence

from mgpu.errors import MgpuError
from mgpu.submit.script_line import check_line

__all__ = ["expand_sweep", "parse_sweep", "sweep_names"]


def _split_values(text: str) -> list[str]:
    """`1,2` -> ['1', '2']; commas inside brackets or quotes (`[0.9,0.95]`) do not split."""
    values, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(current.strip())
            current = ""
            continue
        current += char
    values.append(current.strip())
    return values


def parse_sweep(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`["optim.lr=1e-3,3e-4", ...]` -> `[("optim.lr", ["1e-3", "3e-4"]), ...]`, with one-line errors."""
    parsed: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        values = _split_values(text)
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", key) or not all(values):
            raise MgpuError(f"--sweep {item!r}: expected dotted.key=v1,v2,... (e.g. optim.lr=1e-3,3e-4)")
        check_line("--sweep", item)
        if any(key == seen for seen, _ in parsed):
            raise MgpuError(f"--sweep {item!r}: {key} is swept twice; give all its values in one --sweep")
        parsed.append((key, values))
    return parsed


def expand_sweep(sweep: Sequence[tuple[str, Sequence[str]]]) -> list[list[str]]:
    """The cartesian product as override lists, first key slowest: [["a=1", "b=x"], ["a=1", "b=y"], ...]."""
    return [[f"{key}={value}" for (key, _), value in zip(sweep, combo)]
            for combo in itertools.product(*(values for _, values in sweep))]


def sweep_names(base: str, combos: list[list[str]]) -> list[str]:
    """Readable distinct run names (`base_lr0.001_bs32`); numbered (`base_0`, ...) if those collide."""
    def part(override: str) -> str:
        key, _, value = override.partition("=")
        return key.rsplit(".", 1)[-1] + re.sub(r"[^A-Za-z0-9.+-]+", "", value)

    names = [f"{base}_" + "_".join(part(o) for o in combo) for combo in combos]
    if len(set(names)) < len(names) or any(len(name) > 100 for name in names):
        names = [f"{base}_{i}" for i in range(len(combos))]
    return names
