"""The fleet.yaml reference page is generated from the models: a stale page fails here."""

import pytest

from coordinator.config.fleet import Fleet
from coordinator.config.reference import BEGIN, END, PAGE, main, render, replace_reference, rows


def test_the_committed_page_matches_the_models() -> None:
    assert replace_reference(PAGE.read_text(), render()) == PAGE.read_text(), (
        "docs/fleet-yaml.md is stale: run `make docs-reference`"
    )


def test_every_field_has_a_description_and_nested_models_are_expanded() -> None:
    table = rows(Fleet)
    undescribed = [row for row in table if row.endswith("|  |")]
    assert undescribed == []
    keys = [row.split("`")[1] for row in table]
    assert {"transport.broker.mode", "devices[].overrides.memory.total", "limits.max_upload_bytes"} <= set(keys)
    partition = next(row for row in table if row.startswith("| `dataset.partition`"))
    assert "`dirichlet(ALPHA)`" in partition and "| `iid` |" in partition


def test_a_required_field_and_a_default_read_as_yaml() -> None:
    table = "\n".join(rows(Fleet))
    assert "| `fleet` | text | *required* |" in table
    assert "| `transport.broker.tls` | boolean | `true` |" in table
    assert "| `on_quorum_miss` | `extend` \\| `skip` \\| `retry` | `extend` |" in table


def test_check_says_stale_and_write_fixes_it(tmp_path, capsys) -> None:
    page = tmp_path / "fleet-yaml.md"
    page.write_text(f"# fleet.yaml\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    assert main(["--page", str(page), "--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    assert main(["--page", str(page)]) == 0
    assert main(["--page", str(page), "--check"]) == 0
    assert page.read_text().endswith(f"{END}\n\nafter\n") and "| `fleet` |" in page.read_text()


def test_a_page_without_markers_is_a_clear_error(tmp_path, capsys) -> None:
    page = tmp_path / "page.md"
    page.write_text("# no markers\n")
    assert main(["--page", str(page)]) == 2
    assert "no <!-- fleet-reference:begin --> ... <!-- fleet-reference:end --> markers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="markers"):
        replace_reference("nothing", render())
