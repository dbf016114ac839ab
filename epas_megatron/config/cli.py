"""Command line and YAML -> :class:`RunConfig`.

Precedence (lowest first): dataclass defaults, the preset, the YAML file (``--config``), flags.
Flags are generated from the dataclass fields; the help text is each field's docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from epas_megatron.config.presets import PRESETS, get_preset
from epas_megatron.config.schema import RunConfig
from epas_megatron.config.sections import all_sections
from epas_megatron.errors import ConfigError


def field_docstrings(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (Megatron's config style)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_name(name: str) -> str:
    """The command-line flag of a config field: ``micro_batch_size`` -> ``--micro-batch-size``."""
    return "--" + name.replace("_", "-")


def _base_type(annotation) -> tuple[type, bool]:
    """(scalar type, is_list) of a field annotation such as Optional[list[str]]."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, Sequence):
        return typing.get_args(annotation)[0], True
    return annotation, False


def _field_table() -> dict[str, tuple[str, dataclasses.Field, type, bool, str]]:
    """flag dest -> (section, field, scalar type, is_list, help)."""
    table = {}
    for section, cls in all_sections().items():
        hints = typing.get_type_hints(cls)
        docs = field_docstrings(cls)
        for f in dataclasses.fields(cls):
            scalar, is_list = _base_type(hints[f.name])
            if f.name in table:
                raise RuntimeError(f"config field {f.name} is defined twice")
            table[f.name] = (section, f, scalar, is_list, docs.get(f.name, ""))
    return table


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # unknown flag, bad value: exit 2 with the usage line
        self.print_usage()
        raise ConfigError(message)


def build_parser(prog: str = "epas-train", description: str = "") -> argparse.ArgumentParser:
    """The full flag set; every default is SUPPRESS so that only given flags are returned."""
    parser = _Parser(
        prog=prog,
        description=description,
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sections = all_sections()
    parser.add_argument("--config", help="YAML file with sections " + ", ".join(sections))
    table = _field_table()
    groups = {section: parser.add_argument_group(section, (cls.__doc__ or "").strip()) for section, cls in sections.items()}
    for name, (section, f, scalar, is_list, help_text) in table.items():
        group = groups[section]
        if name == "preset":
            group.add_argument("--preset", choices=list(PRESETS), help=help_text)
            continue
        if scalar is bool:
            group.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, help=help_text)
        elif is_list:
            group.add_argument(flag_name(name), nargs="+", type=scalar, help=help_text)
        else:
            group.add_argument(flag_name(name), type=scalar, help=help_text, metavar=scalar.__name__.upper())
    return parser


RENAMED_KEYS: dict[str, tuple[str, Any]] = {"no_save_final": ("save_final", lambda value: not value)}
"""Config keys of older configs and checkpoints -> (the key now, the value's conversion).
(``no_save_final`` could not be negated on the command line: argparse reads ``--no-save-final``
as the negation of ``--save-final``.)"""


def _set(cfg: RunConfig, name: str, value: Any, table, source: str) -> None:
    if name in RENAMED_KEYS:
        name, convert = RENAMED_KEYS[name]
        value = convert(value) if value is not None else value
    if name not in table:
        raise ConfigError(f"{source}: unknown config key {name!r}")
    section, f, scalar, is_list, _ = table[name]
    if value is not None:
        try:
            if is_list:
                value = [scalar(v) for v in (value if isinstance(value, list) else str(value).split())]
            elif scalar is bool and not isinstance(value, bool):
                raise TypeError
            else:
                value = scalar(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: {flag_name(name)} expects {scalar.__name__}, got {value!r}") from None
    setattr(getattr(cfg, section), name, value)


def load_yaml(path: str) -> dict[str, Any]:
    """A YAML config as a flat {field: value} dict (sections are optional)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of sections or fields")
    flat = {}
    for key, value in raw.items():
        if key in all_sections() and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def apply_preset(cfg: RunConfig, name: str, explicit: set[str], table) -> None:
    """Fill model (and preset training) fields that were not given explicitly."""
    preset = get_preset(name)
    values = {
        "num_layers": preset.num_layers,
        "hidden_size": preset.hidden_size,
        "num_attention_heads": preset.num_attention_heads,
        "num_query_groups": preset.num_query_groups,
        "ffn_hidden_size": preset.ffn_hidden_size,
        "vocab_size": preset.vocab_size,
        "seq_length": preset.seq_length,
        **preset.training_defaults,
    }
    for key, value in values.items():
        if key not in explicit:
            _set(cfg, key, value, table, f"preset {name}")


def parse_config(argv: Optional[Sequence[str]] = None, prog: str = "epas-train") -> RunConfig:
    """Flags (and --config YAML, and --preset) -> RunConfig. Raises ConfigError on bad input."""
    parser = build_parser(prog)
    args = vars(parser.parse_args(argv))
    return config_from_mapping(args)


def config_from_mapping(args: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a flat mapping (flags); 'config' names an optional YAML file."""
    table = _field_table()
    cfg = RunConfig()
    yaml_values = load_yaml(args.pop("config")) if args.get("config") else {}
    args.pop("config", None)
    explicit = set(yaml_values) | set(args)
    preset = args.get("preset", yaml_values.get("preset"))
    if preset is not None:
        apply_preset(cfg, preset, explicit, table)
    for name, value in yaml_values.items():
        _set(cfg, name, value, table, "--config")
    for name, value in args.items():
        _set(cfg, name, value, table, "command line")
    return cfg


def to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Sectioned plain dict (for config.yaml and checkpoints): the built-in sections, then the
    enrolled ones."""
    sectioned = dataclasses.asdict(cfg)
    sectioned.update(sectioned.pop("enrolled"))
    return sectioned


def from_dict(d: dict[str, dict[str, Any]]) -> RunConfig:
    """Inverse of :func:`to_dict`."""
    cfg = RunConfig()
    table = _field_table()
    for section, values in d.items():
        for name, value in values.items():
            _set(cfg, name, value, table, "saved config")
    return cfg


def dump_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
