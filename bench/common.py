"""Shared by the benchmarks: medians, ratios, a printed table and a JSON file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(name: str, rows: list[dict[str, Any]], out: Path | None = None, **notes: Any) -> None:
    """Print rows as a table and write `bench/results/<name>.json` (or `out`), with `notes` beside the rows."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    widths = [max(len(k), *(len(_fmt(r.get(k, ""))) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for row in rows:
        print("  ".join(_fmt(row.get(k, "")).ljust(w) for k, w in zip(keys, widths)))
    out = out or ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "python": platform.python_version(),
            "machine": platform.machine(), "argv": sys.argv,
            "cores": os.cpu_count(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}
    out.write_text(json.dumps({"meta": meta, **notes, "rows": rows}, indent=1))
    print(f"wrote {out}")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
