"""The reliability tables of docs/reliability.md: rendered from fault and bad-input results between marker comments."""

import json

import pytest

from benchmarks.reliability import BEGIN, END, main, render, update_page

RESULTS = {
    "scenarios": {
        "kill -9 the broker mid-upload": {
            "survived": True,
            "lost_updates": 0,
            "rounds_completed": 3,
            "detail": "supervisor restarts: 3",
        },
        "disk full in the run directory": {
            "survived": None,
            "lost_updates": 0,
            "rounds_completed": 0,
            "detail": "not run: no root",
        },
    },
    "bad_inputs": {
        "nan update": {"refused": True, "reason": "non_finite", "round_unaffected": True, "detail": "a|b"},
    },
}


def test_both_tables_are_rendered_with_one_row_per_case() -> None:
    text = render(RESULTS)

    assert "| kill -9 the broker mid-upload | yes | 0 | 3 | supervisor restarts: 3 |" in text
    assert "| disk full in the run directory | not run | 0 | 0 | not run: no root |" in text
    assert "| nan update | yes | non_finite | yes | a\\|b |" in text


def test_the_page_block_is_replaced_and_the_rest_kept(tmp_path) -> None:
    page = tmp_path / "reliability.md"
    page.write_text(f"# x\n\n## Reliability\n\n{BEGIN}\nold table\n{END}\n\n## Next\n")
    results = tmp_path / "faults.json"
    results.write_text(json.dumps({"scenarios": RESULTS["scenarios"]}))

    assert main([str(results), "--page", str(page)]) == 0

    text = page.read_text()
    assert "old table" not in text and "| kill -9 the broker mid-upload | yes |" in text
    assert text.startswith("# x\n\n## Reliability\n\n") and text.endswith(f"{END}\n\n## Next\n")


def test_missing_markers_or_results_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"no <!-- faults:begin --> \.\.\. <!-- faults:end --> block"):
        update_page("# no markers\n", RESULTS)
    with pytest.raises(ValueError, match="expected a 'scenarios' or 'bad_inputs' key"):
        render({"seconds": 3})
