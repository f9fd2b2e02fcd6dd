"""The run's settings: typed, documented dataclasses (`schema`), their loading from YAML and `key=value` overrides with one-line errors (`loading`), and the generated reference (`reference`). No torch. Imports only `mgpu.errors` and `mgpu.fsutil`.

`from mgpu.config import Config, load_config` (the names of `loading`, as before the subpackages) still works.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib

    return getattr(importlib.import_module("mgpu.config.loading"), name)
