"""The run's settings: typed, documented dataclasses (`schema`), their loading from YAML and `key=value` overrides with one-line errors (`loading`), whether a resume may use the current config, against the checkpoint's (`resume_compat`), and the generated reference (`reference`). No torch. Imports only `mgpu.errors` and `mgpu.fsutil`.

`from mgpu.config import Config, load_config` (the names of `loading` and `resume_compat`, as before the subpackages) still works.
"""

from typing import Any

_RESUME_COMPAT = {"check_resume_compatible", "diff_configs", "is_safe_to_change"}


def __getattr__(name: str) -> Any:
    import importlib

    module = "mgpu.config.resume_compat" if name in _RESUME_COMPAT else "mgpu.config.loading"
    return getattr(importlib.import_module(module), name)
