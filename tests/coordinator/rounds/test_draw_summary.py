from coordinator.rounds.draw import summarize_plan


def test_a_large_fleets_plan_counts_devices_per_level_and_names_those_left_out():
    parts = [f"d{i:03d} at {'1' if i % 2 else '1/2'}" for i in range(40)]
    parts += ["d040 out (offline)", "d041 out (too little memory)"]
    assert summarize_plan(parts) == (
        "42 devices: 20 at 1; 20 at 1/2; 1 out (offline): d040; 1 out (too little memory): d041"
    )


def test_at_most_five_left_out_devices_are_named_per_reason():
    parts = [f"d{i} out (not drawn)" for i in range(30)]
    assert summarize_plan(parts) == "30 devices: 30 out (not drawn): d0, d1, d2, d3, d4 ..."
