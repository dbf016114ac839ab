"""The configuration reference (``docs/configuration-reference.md``), generated from the config
dataclasses: one table per section, a row per field -- its flag, type, default and the docstring
written under it (the same text ``epas-train --help`` prints). Regenerate with

    .venv/bin/python -m epas_megatron.config.reference > docs/configuration-reference.md

(``tests/test_docs.py`` fails while the file differs from what this prints.)
"""

from __future__ import annotations

import dataclasses
import typing

from epas_megatron.config.cli import field_docstrings, flag_name
from epas_megatron.config.schema import SECTIONS


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if typing.get_origin(annotation) is None else None
    return text or str(annotation).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "(none)" if f.default is None else f"`{f.default}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()}`"  # type: ignore[misc]
    return "(required)"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_reference_markdown() -> str:
    """The whole reference page."""
    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses (`epas_megatron/config/schema.py`) by "
             "`python -m epas_megatron.config.reference`; do not edit by hand. Every field is an `epas-train` flag "
             "and a key of its section in a `--config` YAML file (flags override the file, the file overrides "
             "the preset). Booleans also take `--no-<flag>`.", ""]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        docs = field_docstrings(cls)
        lines += [f"## `{section}`", "", _cell((cls.__doc__ or "").strip()), "",
                  "| flag | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            lines.append(f"| `{flag_name(f.name)}` | {_cell(_type_name(hints[f.name]))} | {_default(f)} | {_cell(docs.get(f.name, ''))} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference_markdown(), end="")
