"""Pure parsers for Slurm's compressed node lists and task counts.

`expand_hostlist("gpu-a[001-002,010],gpu-b07")` -> `["gpu-a001", "gpu-a002", "gpu-a010", "gpu-b07"]`
`expand_tasks_per_node("2(x3),1")` -> `[2, 2, 2, 1]`

Both follow Slurm's own grammar (see `scontrol show hostnames`); tests check them against it.
Both are bounded: a range spans at most `MAX_RANGE` (65536) hosts, as in Slurm, and a whole list
expands to at most `MAX_HOSTS` (100,000) names or task counts, far above any real job's and far
below a MemoryError; beyond either, HostlistError before anything is built.
"""

from __future__ import annotations

import itertools
import math
import re

__all__ = ["MAX_HOSTS", "MAX_RANGE", "HostlistError", "expand_hostlist", "expand_tasks_per_node"]

MAX_RANGE = 65536  # Slurm's hostlist.c refuses a longer range ("Too many hosts in range")
MAX_HOSTS = 100_000
_MAX_DIGITS = 18  # a number this long is no host index or task count (and int() of 4300+ digits raises)


class HostlistError(ValueError):
    """A node list or task count that does not follow Slurm's grammar."""


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in node list {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in node list {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in node list {text!r}")
    parts.append("".join(current))
    return parts


_RANGE = re.compile(r"(\d{1,%d})(?:-(\d{1,%d}))?" % (_MAX_DIGITS, _MAX_DIGITS))


def _expand_bracket(body: str, whole: str) -> list[str]:
    """Expand the inside of one bracket group, e.g. `001-003,7` -> 001 002 003 7."""
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match:
            raise HostlistError(f"bad range {item!r} in node list {whole!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise HostlistError(f"descending range {item!r} in node list {whole!r}")
        if int(high) - int(low) + 1 > MAX_RANGE:
            raise HostlistError(f"too many hosts in range {item!r} of node list {whole!r} (Slurm's limit: {MAX_RANGE})")
        if len(values) + int(high) - int(low) + 1 > MAX_HOSTS:
            raise _too_many(whole)
        # Slurm pads every number of a range to the width of its lower bound (`n[08-10]` -> n08 n09 n10).
        width = len(low)
        values.extend(str(i).zfill(width) for i in range(int(low), int(high) + 1))
    return values


def _too_many(whole: str) -> HostlistError:
    shown = whole if len(whole) <= 60 else whole[:57] + "..."
    return HostlistError(f"node list {shown!r} names more than {MAX_HOSTS} hosts")


def _expand_one(pattern: str, whole: str) -> list[str]:
    """Expand one comma-free pattern; several bracket groups form a product, in Slurm's order."""
    pieces = re.split(r"\[([^\]]*)\]", pattern)
    # re.split with one group alternates: literal, bracket body, literal, ..., literal.
    literals, groups = pieces[0::2], [_expand_bracket(body, whole) for body in pieces[1::2]]
    if any("[" in lit or "]" in lit for lit in literals):
        raise HostlistError(f"unbalanced bracket in node list {whole!r}")
    if groups and literals[-1]:
        # Slurm (22.05) rejects `n[1-2]-ib`: a bracket group must end the name.
        raise HostlistError(f"text {literals[-1]!r} after the last ']' in node list {whole!r}")
    if math.prod(len(group) for group in groups) > MAX_HOSTS:
        raise _too_many(whole)
    if len(groups) < 2:
        return [literals[0] + value for value in (groups[0] if groups else [""])]
    # Slurm's order (checked against `scontrol show hostnames`): the last group varies fastest, then
    # the first, second, ... group: a[1-2]b[1-2]c[1-2] -> a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ...
    leading = groups[:-1]
    names = []
    for combo in itertools.product(*reversed(leading), groups[-1]):
        values = list(reversed(combo[:-1])) + [combo[-1]]
        names.append("".join(lit + value for lit, value in zip(literals, values)))
    return names


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm node list (`SLURM_JOB_NODELIST`) into host names, in Slurm's order."""
    text = text.strip()
    if not text:
        raise HostlistError("empty node list")
    hosts: list[str] = []
    for part in _split_top_level(text):
        part = part.strip()
        if not part:
            raise HostlistError(f"empty entry in node list {text!r}")
        hosts.extend(_expand_one(part, text))
        if len(hosts) > MAX_HOSTS:
            raise _too_many(text)
    return hosts


_TASKS = re.compile(r"(\d{1,%d})(?:\(x(\d{1,%d})\))?" % (_MAX_DIGITS, _MAX_DIGITS))


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand `SLURM_TASKS_PER_NODE` (`2(x3),1`) into one task count per node."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASKS.fullmatch(item.strip())
        if not match:
            raise HostlistError(f"bad task count {item!r} in {text!r} (expected e.g. '2(x3),1')")
        tasks, repeat = int(match.group(1)), int(match.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise HostlistError(f"task counts {text[:60]!r} describe more than {MAX_HOSTS} nodes")
        counts.extend([tasks] * repeat)
    return counts
