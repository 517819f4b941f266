"""The documentation site builds with `mkdocs build --strict`, offline, and the strict build is a
real check: it fails on a broken link and on a page left out of the navigation (mkdocs.yml's
`validation` settings), and the CLI reference it generates lists every command and flag of the
parser it is generated from (docs/hooks/cli_reference.py); and every `specdec` command line the README
and the docs show parses with that parser."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("material", reason="the docs extra is not installed: pip install -e '.[docs]'")


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the project at `root` into `site`, with every proxy pointed at a
    closed port, so any attempt to reach the network fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env[name] = "http://127.0.0.1:9"
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    done = build(ROOT, site)
    assert done.returncode == 0, done.stdout + done.stderr
    return site


def test_the_site_builds_strictly_and_offline(site):
    assert (site / "index.html").is_file() and (site / "design" / "index.html").is_file()
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()


def test_the_cli_reference_lists_every_command_and_flag_of_the_parser(site):
    page = (site / "reference" / "cli" / "index.html").read_text()
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert commands
    for name, sub in commands.items():
        assert f'id="{name}"' in page, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):  # -h, --help: every command has it
                continue
            for flag in action.option_strings:
                assert f"<code>{flag}</code>" in page, (name, flag)


def copy_project(tmp_path: Path) -> Path:
    """The docs, mkdocs.yml and the package beside them (the hook imports specdec's parser)."""
    root = tmp_path / "project"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    (root / "specdec").symlink_to(ROOT / "specdec")
    return root


@pytest.mark.parametrize("fault", ["broken link", "page left out of the nav"])
def test_the_strict_build_fails_on_a_broken_link_or_an_orphan_page(fault, tmp_path):
    root = copy_project(tmp_path)
    if fault == "broken link":
        page = root / "docs" / "install.md"
        page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    else:
        (root / "docs" / "orphan.md").write_text("# Orphan\n\nNot in the navigation.\n")
    done = build(root, tmp_path / "site")
    assert done.returncode != 0
    assert ("no-such-page.md" if fault == "broken link" else "orphan.md") in done.stdout + done.stderr


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every `specdec ...` line of the ```sh blocks of README.md and docs/ (and torchrun's
    `-m specdec.cli ...`), as (where, argv); lines with a [--flag] synopsis are left out."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```sh\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line.split(" #")[0])
                if "[" in line or not words:
                    continue
                if words[0] == "specdec":
                    found.append((f"{path.relative_to(ROOT)}: {line.strip()}", words[1:]))
                elif "specdec.cli" in words:
                    found.append((f"{path.relative_to(ROOT)}: {line.strip()}", words[words.index("specdec.cli") + 1:]))
    return found


def test_every_documented_command_line_parses(capsys):
    commands = documented_commands()
    assert len(commands) > 40
    parser = build_parser()
    wrong = []
    for where, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            wrong.append(f"{where}\n    {capsys.readouterr().err.strip().splitlines()[-1]}")
    assert not wrong, "\n".join(wrong)


def test_the_docs_folder_holds_prose_and_pictures_only():
    """Experiments live in benchmarks/ and their data under docs/evidence/; besides the site's hooks,
    docs/ holds Markdown, images and the evidence's data files, and no script."""
    allowed = {".md", ".png", ".svg", ".jpg", ".json", ".txt"}
    stray = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*") if p.is_file()
             and "hooks" not in p.relative_to(ROOT / "docs").parts and "__pycache__" not in p.parts
             and (p.suffix not in allowed or (p.suffix in {".json", ".txt"} and "evidence" not in p.parts))]
    assert not stray, stray


def test_the_readme_is_short_shows_the_two_commands_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    blocks = "".join(re.findall(r"```sh\n(.*?)```", readme, re.S))
    assert "make run" in blocks and "make test" in blocks
    first_table = readme[readme.index("\n|"):].split("\n\n")[0]
    assert "llama.cpp" in first_table and "transformers" in first_table
    broken = [link for link in re.findall(r"\]\(([^)#\s]+)", readme)
              if not re.match(r"[a-z]+:", link) and not (ROOT / link).exists()]
    assert not broken, broken
