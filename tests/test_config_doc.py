"""docs/config.md is the reference generated from mgpu/config/schema.py: it fails here when it is stale, and
every key in it has its type, default, meaning and resume rule."""

from __future__ import annotations

import dataclasses

from mgpu.config import schema as config_schema
from mgpu.config.reference import field_docs, render
from tests.conftest import ROOT

DOC = ROOT / "docs" / "config.md"


def test_docs_config_md_is_what_the_schema_generates() -> None:
    assert DOC.read_text() == render(), "docs/config.md is stale: python -m mgpu.config.reference > docs/config.md"


def test_every_key_is_in_the_reference_with_its_meaning() -> None:
    docs, text = field_docs(), DOC.read_text()
    for section in dataclasses.fields(config_schema.Config):
        cls = section.default_factory().__class__  # type: ignore[misc]
        for field in dataclasses.fields(cls):
            assert docs[cls.__name__].get(field.name), f"{section.name}.{field.name} has no docstring"
            assert f"| `{section.name}.{field.name}` |" in text
    assert "| `optim.lr` | `float` | `0.001` | may change |" in text  # applied over the restored optimizer
    assert "| `data.batch_size` | `int` | `32` | fixed |" in text
    assert "| `train.epochs` | `int` | `1` | may change |" in text


def test_the_readme_links_the_reference() -> None:
    assert "(docs/config.md)" in (ROOT / "README.md").read_text()
