"""docs/ stays navigable and true to the tree: the index links every doc that exists, and each
path named in ARCHITECTURE.md's "Layout as built" exists in the checkout."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def test_index_links_every_doc() -> None:
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", index))
    on_disk = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert linked == on_disk
    for line in index.splitlines():  # one line each: the link and what the page answers
        if line.startswith("- ["):
            assert len(line.split(":", 1)[1].strip()) > 20, line


def _layout_paths() -> list[str]:
    text = (DOCS / "ARCHITECTURE.md").read_text()
    layout = text[text.index("## Layout as built"):]
    return re.findall(r"`([\w./-]+\.(?:py|sql|sh|md)|[\w/]+/)`", layout)


def test_layout_as_built_names_real_paths() -> None:
    """Each `path` in the section exists: as written, or under the package its bullet names."""
    text = (DOCS / "ARCHITECTURE.md").read_text()
    layout = text[text.index("## Layout as built"):]
    missing = []
    for bullet in layout.split("\n- ")[1:]:
        package = re.match(r"`([\w/]+/)`", bullet)
        for name in re.findall(r"`([\w./-]+\.(?:py|sql|sh|md)|[\w/]+/)`", bullet):
            here = [REPO / name, REPO / "docs" / name]
            if package:
                here += [REPO / package.group(1) / name, *(REPO / package.group(1)).glob(f"*/{name}")]
            if not any(p.exists() for p in here):
                missing.append(name)
    assert _layout_paths() and missing == []


def test_cli_section_lists_the_commands_that_exist() -> None:
    """ARCHITECTURE.md's CLIs section names exactly the subcommands `decodescope --help` lists."""
    import click

    from cli.main import main

    text = (DOCS / "ARCHITECTURE.md").read_text()
    section = text[text.index("## CLIs"):text.index("## Layout as built")]
    listed = re.search(r"`decodescope ([a-z |\n-]+)`", section)
    assert listed
    documented = {w.strip() for w in listed.group(1).split("|")}
    assert documented == set(main.list_commands(click.Context(main)))
