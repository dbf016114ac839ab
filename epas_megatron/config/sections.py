"""A run config's sections: the built-in ones (:data:`~epas_megatron.config.schema.SECTIONS`) and
those build options outside the package enrol (:func:`enrol_section`), which parse from the
command line and YAML and are saved with a checkpoint as the built-in ones are."""

from __future__ import annotations

from dataclasses import fields

from epas_megatron.config.schema import ENROLLED_SECTIONS, SECTIONS


def all_sections() -> dict[str, type]:
    """Every section a config has now: the built-in ones, then the enrolled ones."""
    return {**SECTIONS, **ENROLLED_SECTIONS}


def enrol_section(name: str, cls: type) -> None:
    """Add the config section ``name`` (the dataclass ``cls``: one docstring per field, field
    names unique across every section so flags stay flat) for a build option outside the built-in
    sections (:func:`epas_megatron.model.option_registry.enrol`); enrolling the same class twice
    is a no-op."""
    if ENROLLED_SECTIONS.get(name) is cls:
        return
    if name in all_sections() or name == "enrolled":
        raise ValueError(f"config section {name!r} exists already")
    taken = {f.name for section in all_sections().values() for f in fields(section)}
    clash = sorted(taken & {f.name for f in fields(cls)})
    if clash:
        raise ValueError(f"config section {name!r}: fields {clash} exist in another section (flags are flat)")
    ENROLLED_SECTIONS[name] = cls
