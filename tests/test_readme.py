"""The README is the front page: short, its example fleet.yaml valid, its links into docs/ alive.

The docs pages' own links are checked by ``mkdocs build --strict`` in ``make lint``; the README lies
outside the site, so its links are checked here.
"""

import re
from pathlib import Path

import yaml

from coordinator.config.fleet import parse_fleet

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_readme_fleet_yaml_is_a_valid_fleet() -> None:
    block = re.search(r"## A fleet.yaml\n\n```yaml\n(.*?)```", README, re.S)
    assert block is not None, "the README lost its fleet.yaml example"

    fleet = parse_fleet(yaml.safe_load(block.group(1)), source="README.md")

    assert fleet.strategy.name == "fedhm" and len(fleet.devices) == 4


def test_every_relative_link_in_the_readme_names_an_existing_file_and_heading() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", README)
    assert links, "no links found: the pattern no longer matches the README"
    for target, anchor in links:
        if "://" in target:
            continue
        path = ROOT / target
        assert path.is_file(), f"README links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"README links to {target}#{anchor}, a heading that does not exist"


def test_the_readme_stays_a_front_page() -> None:
    assert len(README.splitlines()) <= 200, "README.md is over 200 lines: move the detail into a docs/ page"


def test_every_repository_path_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    folders = "tests|benchmarks|coordinator|device_agent|export|profiles|examples"
    pattern = rf"\b(?:{folders})/[\w./-]+\.(?:py|yaml|md|jsonl|json)\b"
    named = {(page.name, path) for page in pages for path in re.findall(pattern, page.read_text())}
    assert len(named) > 20, "the pattern no longer finds the paths the docs name"
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).exists())
    assert not missing, f"docs name files that moved or were removed: {missing}"
