"""The bad-inputs benchmark on a representative subset: every kind refused, logged once, the round unaffected."""

import pytest

from benchmarks.bad_inputs import main, run
from coordinator.transport.broker.mosquitto import find_mosquitto

KINDS = [
    "malformed_json",
    "unknown_field",
    "status_naming_another_device",
    "tiny_chunks_manifest",
    "forged_chunk",
    "wrong_round",
    "meta_nan_loss",
    "meta_absurd_train_seconds",
    "huge_header_safetensors",
    "float8_tensor",
    "bfloat16_tensor",
    "missing_tensors",
    "extra_tensor",
    "norm_scaled_update",
    "flood",
    "missing_chunks",
]


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_every_bad_input_is_refused_once_and_the_round_goes_on() -> None:
    outcomes = run(flood_count=1000, kinds=KINDS)["bad_inputs"]
    always = {"retained_poisoning", "replayed_transfer", "refused_then_genuine"}
    assert set(outcomes) == set(KINDS) | always
    for kind, outcome in outcomes.items():
        assert outcome["refused"], (kind, outcome)
        assert outcome["round_unaffected"], (kind, outcome)
    for kind in set(KINDS) - {"missing_chunks"}:  # a missing chunk is asked for again, not refused
        assert outcomes[kind]["log_lines"] == 1, (kind, outcomes[kind])
        assert f"({outcomes[kind]['reason']})" in outcomes[kind]["detail"], kind
    assert "'honest': 'accepted', 'mallory': 'accepted'" in outcomes["refused_then_genuine"]["detail"]


def test_an_unknown_kind_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--kinds", "no_such_kind", "--json"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "unknown kinds ['no_such_kind']" in captured.err and captured.out == ""
