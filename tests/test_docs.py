"""The README and the pages under docs/: every relative link resolves (file and heading anchor),
every epas command quoted in a ``bash`` block parses with that command's own argument parser
(an unknown flag, subcommand or choice fails here), and the configuration reference is what the
config dataclasses generate."""

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from epas_testing import COMMANDS_BY_SCRIPT as COMMANDS
from epas_testing import REPO

PAGES = [REPO / "README.md", REPO / "tests" / "README.md", *sorted((REPO / "docs").glob("*.md"))]



def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


def _quoted_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(module, argv) of every epas command line in the page's bash blocks."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].split("  #")[0].strip()
            for part in re.split(r"&&|\|\|?|;", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
                    words.pop(0)
                module, args = None, []
                for i, word in enumerate(words):
                    name = Path(word).name
                    if name in COMMANDS:
                        module, args = COMMANDS[name], words[i + 1:]
                        break
                    if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("epas_megatron."):
                        module, args = words[i + 1], words[i + 2:]
                        if module.endswith(".cli") and module not in COMMANDS.values():
                            module = None
                        break
                if module is not None:
                    found.append((module, [a for a in args if a != "..." and "$" not in a]))
    return found


class _Parsed(BaseException):
    """Raised right after a command's parser accepted its arguments: nothing more runs."""


def test_the_docs_quote_commands():
    assert sum(len(_quoted_commands(page)) for page in PAGES) >= 20


def _parse_failures(commands, monkeypatch) -> list[str]:
    """Each command's ``main`` run until its parser has accepted the arguments. A command that
    reads its own flags with ``parse_known_args`` hands the rest to the training parser
    (``epas-plan``): only a full ``parse_args`` ends the command."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    failures = []
    for module, argv in commands:
        main = importlib.import_module(module).main
        try:
            main(argv)
        except _Parsed:
            continue
        except SystemExit as exit_:
            failures.append(f"{module} {shlex.join(argv)}: exit {exit_.code}")
        except Exception as error:  # noqa: BLE001 -- a parser's error (ConfigError) is the failure reported
            failures.append(f"{module} {shlex.join(argv)}: {type(error).__name__}: {error}")
        else:
            failures.append(f"{module} {shlex.join(argv)}: returned without parsing its arguments")
    return failures


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_quoted_command_parses(page, monkeypatch):
    assert not (failures := _parse_failures(_quoted_commands(page), monkeypatch)), failures


def test_the_check_catches_a_wrong_flag_a_wrong_subcommand_and_a_wrong_choice(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("```bash\n.venv/bin/epas-train --preset tiny --moc-topk-typo 0.2\n"
                    "OMP_NUM_THREADS=2 .venv/bin/epas-bench trian --preset small\n"
                    "torchrun --nproc-per-node 2 -m epas_megatron.train --preset huge\n"
                    "epas-eval --load CKPT --regions 0,max   # fine\n```\n")
    commands = _quoted_commands(page)
    assert [m for m, _ in commands] == ["epas_megatron.train", "epas_megatron.bench.cli", "epas_megatron.train", "epas_megatron.evaluate"]
    failures = _parse_failures(commands, monkeypatch)
    assert len(failures) == 3 and all(not f.startswith("epas_megatron.evaluate") for f in failures), failures


def test_the_configuration_reference_is_generated():
    from epas_megatron.config.reference import config_reference_markdown

    page = REPO / "docs" / "configuration-reference.md"
    assert page.read_text() == config_reference_markdown(), (
        "docs/configuration-reference.md is out of date: .venv/bin/python -m epas_megatron.config.reference "
        "> docs/configuration-reference.md")


REPO_PATH = re.compile(r"^(?:launch|slurm|tools|kernels|docs|tests|\.ci)/[\w./-]*\w$")
"""A word of a quoted command that names a file of this repository (outputs go elsewhere)."""


def _quoted_words(page: Path) -> list[list[str]]:
    """Every command line of the page's bash blocks as words, ``VAR=value`` prefixes split into
    their values (``CONFIG=launch/configs/1b.yaml sbatch ...``)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\|?|;", line.split(" # ")[0]):
                try:
                    words = shlex.split(part)
                except ValueError:
                    continue
                lines.append([w.split("=", 1)[1] if re.match(r"^[A-Z_]+=", w) else w for w in words])
    return lines


def _missing_paths(page: Path) -> list[str]:
    return sorted({w for words in _quoted_words(page) for w in words if REPO_PATH.match(w) and not (REPO / w).exists()})


def _sbatch_problems(page: Path, tmp_path: Path) -> list[str]:
    """Each quoted ``sbatch`` script parses (``bash -n``) and the config it is given
    (``CONFIG=...``) is one epas-train reads."""
    import subprocess

    from epas_megatron.config.cli import parse_config

    problems = []
    for words in _quoted_words(page):
        if "sbatch" not in words:
            continue
        scripts = [w for w in words[words.index("sbatch") + 1:] if w.endswith(".sbatch")]
        for script in scripts:
            proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
            if proc.returncode:
                problems.append(f"{script}: {proc.stderr.strip()}")
        for config in (w for w in words if w.endswith((".yaml", ".yml"))):
            try:
                parse_config(["--config", str(REPO / config), "--output-dir", str(tmp_path / "out")])
            except Exception as error:  # noqa: BLE001 -- any refusal is the finding
                problems.append(f"{config}: {type(error).__name__}: {error}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_quoted_command_names_exists_and_sbatch_scripts_parse(page, tmp_path):
    assert not _missing_paths(page), _missing_paths(page)
    assert not (problems := _sbatch_problems(page, tmp_path)), problems


def test_the_path_check_catches_files_that_do_not_exist(tmp_path):
    """The README once quoted ``sbatch --nodes 2 slurm/train.sbatch launch/configs/gpt_1b.yaml``:
    neither file ever existed."""
    page = tmp_path / "page.md"
    page.write_text("```bash\nsbatch --nodes 2 slurm/train.sbatch launch/configs/gpt_1b.yaml\n"
                    "CONFIG=launch/configs/1b.yaml sbatch --nodes=2 slurm/pretrain.sbatch\n```\n")
    assert _missing_paths(page) == ["launch/configs/gpt_1b.yaml", "slurm/train.sbatch"]
    assert _quoted_words(page)[1][0] == "launch/configs/1b.yaml"
