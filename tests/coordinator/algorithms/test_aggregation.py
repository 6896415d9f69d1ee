import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from coordinator.algorithms.aggregation import StreamingAggregator, UpdateRejected, aggregation_weights, parse_classes
from coordinator.algorithms.lowrank import align, factorize
from device_agent.layers.hybrid import factorization_plan, hybrid

RATIOS = [1, 1 / 2, 1 / 4, 1 / 8]


def softmax(x):
    e = np.exp(np.asarray(x, dtype=float) - np.max(x))
    return e / e.sum()


def test_paper_weighting_is_softmax_of_gamma_over_tau():
    assert aggregation_weights("paper", RATIOS) == pytest.approx(softmax(RATIOS))
    assert aggregation_weights("paper", RATIOS, temperature=0.5) == pytest.approx(softmax(np.array(RATIOS) / 0.5))
    assert aggregation_weights("paper", RATIOS) == pytest.approx([0.399, 0.242, 0.188, 0.166], abs=0.002)


def test_reference_weighting_is_softmax_of_minus_inverse_gamma():
    weights = aggregation_weights("reference", RATIOS)
    assert weights == pytest.approx(softmax([-1 / g for g in RATIOS]))
    assert weights == pytest.approx([0.705, 0.259, 0.035, 0.0006], abs=0.0005)


def test_sample_and_uniform_weightings():
    assert aggregation_weights("samples", RATIOS, [10, 30, 40, 20]) == pytest.approx([0.1, 0.3, 0.4, 0.2])
    assert aggregation_weights("uniform", RATIOS) == pytest.approx([0.25] * 4)
    with pytest.raises(ValueError, match=r"unknown weighting .median.*paper"):
        aggregation_weights("median", RATIOS)


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    plan = factorization_plan("cnn")
    global_state = hybrid("cnn", 1.0).state_dict()
    clients = []
    for index, gamma in enumerate(RATIOS):
        torch.manual_seed(index + 1)
        trained = {k: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v for k, v in global_state.items()}
        clients.append((factorize(trained, plan, [gamma])[gamma], gamma, 10 * (index + 1)))
    return plan, global_state, clients


@pytest.mark.parametrize("weighting", ["paper", "reference", "samples", "uniform"])
def test_streaming_result_equals_the_weighted_average_of_aligned_clients(cnn, weighting):
    plan, global_state, clients = cnn
    aggregator = StreamingAggregator(global_state, plan, weighting)
    for update, gamma, samples in clients:
        aggregator.add(update, gamma, samples)
    result = aggregator.result()
    alphas = aggregation_weights(weighting, [g for _, g, _ in clients], [n for _, _, n in clients])
    aligned = [align(update, plan) for update, _, _ in clients]
    for key, value in global_state.items():
        if value.is_floating_point():
            expected = sum(alpha * full[key].double() for alpha, full in zip(alphas, aligned, strict=True))
            torch.testing.assert_close(result[key], expected.float(), rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(result[key], value)


def test_tiny_weights_neither_underflow_nor_lose_the_big_client():
    plan = factorization_plan("cnn")
    state = hybrid("cnn", 1.0).state_dict()
    aggregator = StreamingAggregator(state, plan, "reference", temperature=0.001)
    low = factorize(state, plan, [1 / 64])[1 / 64]
    aggregator.add(low, 1 / 64)
    aggregator.add(state, 1.0)
    result = aggregator.result()
    assert all(torch.isfinite(v).all() for v in result.values() if v.is_floating_point())
    torch.testing.assert_close(result["conv2.weight"], state["conv2.weight"])


def test_keys_no_client_sent_keep_the_global_value(cnn):
    plan, global_state, clients = cnn
    aggregator = StreamingAggregator(global_state, plan)
    update, gamma, samples = clients[1]
    aggregator.add({k: v for k, v in update.items() if "running" not in k}, gamma, samples)
    result = aggregator.result()
    assert torch.equal(result["bn2.running_mean"], global_state["bn2.running_mean"])
    assert not torch.equal(result["bn2.weight"], global_state["bn2.weight"])


def corrupt(update, key, value):
    return {**update, key: value}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda u: corrupt(u, "conv1.weight", torch.full_like(u["conv1.weight"], float("nan"))), "conv1.weight.*NaN"),
        (lambda u: corrupt(u, "conv1.weight", torch.zeros(3, 3)), "conv1.weight.*shape"),
        (lambda u: corrupt(u, "evil.weight", torch.zeros(1)), "evil.weight.*not a parameter"),
        (lambda u: {k: v for k, v in u.items() if k != "conv2.expand"}, "conv2.*only one"),
        (lambda u: corrupt(u, "conv2.weight", torch.zeros(64, 32, 3, 3)), "conv2.*factors"),
        (lambda u: corrupt(u, "conv3.reduce", torch.zeros(7, 64, 1, 3)), "conv3.reduce.*gamma"),
        (lambda u: corrupt(u, "fc.bias", torch.zeros(10, dtype=torch.int32)), "fc.bias.*floating"),
        (lambda u: corrupt(u, "fc.bias", [0.0] * 10), "fc.bias.*tensor"),
    ],
)
def test_a_bad_update_is_rejected_by_name_and_changes_nothing(cnn, mutate, message):
    plan, global_state, clients = cnn
    good, gamma, samples = clients[1]
    with_bad = StreamingAggregator(global_state, plan)
    with_bad.add(good, gamma, samples)
    with pytest.raises(UpdateRejected, match=message):
        with_bad.add(mutate(clients[2][0]), 1 / 4, 30)
    clean = StreamingAggregator(global_state, plan)
    clean.add(good, gamma, samples)
    assert with_bad.num_clients == 1
    for key, value in clean.result().items():
        assert torch.equal(with_bad.result()[key], value), key


def test_previous_global_model_as_pseudo_client_is_opt_in(cnn):
    plan, global_state, clients = cnn
    update, gamma, _ = clients[3]
    plain = StreamingAggregator(global_state, plan)
    plain.add(update, gamma)
    with_global = StreamingAggregator(global_state, plan, global_as_pseudo_client=True)
    with_global.add(update, gamma)
    alpha_low, alpha_global = aggregation_weights("paper", [gamma, 1.0])
    aligned = align(update, plan)["conv3.weight"]
    torch.testing.assert_close(plain.result()["conv3.weight"], aligned)
    expected = alpha_low * aligned + alpha_global * global_state["conv3.weight"]
    torch.testing.assert_close(with_global.result()["conv3.weight"], expected)
    torch.testing.assert_close(with_global.result()["conv3.weight"], expected)


MEMORY_PROBE = textwrap.dedent(
    """
    import sys, torch
    from coordinator.algorithms.aggregation import StreamingAggregator
    from coordinator.algorithms.lowrank import factorize
    from device_agent.layers.hybrid import factorization_plan, hybrid

    clients, mode = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    plan = factorization_plan("resnet18")
    state = hybrid("resnet18", 1.0).state_dict()
    levels = factorize(state, plan, [1.0, 0.5, 0.25, 0.125])
    ratios = [1.0, 0.5, 0.25, 0.125]

    def updates():
        for i in range(clients):
            gamma = ratios[i % 4]
            base = levels[gamma]
            yield {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in base.items()}, gamma

    aggregator = StreamingAggregator(state, plan)
    stream = list(updates()) if mode == "held" else updates()
    for update, gamma in stream:
        aggregator.add(update, gamma, 10)
        del update
    aggregator.result()
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forked parent across exec, so a
    # large pytest process would hide the probe's own peak.
    with open("/proc/self/status") as status:
        print(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")))
    """
)


def peak_rss(clients: int, mode: str = "streamed") -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(clients), mode], capture_output=True, text=True, env=env, check=True
    )
    return int(done.stdout.strip())


@pytest.mark.slow
def test_streaming_aggregation_of_50_clients_peaks_no_higher_than_2():
    model_bytes = 11_173_962 * 4
    two, fifty = peak_rss(2), peak_rss(50)
    held = peak_rss(8, "held")
    mib = {name: round(value / 2**20) for name, value in (("2", two), ("50", fifty), ("8 held", held))}
    print(f"peak RSS in MiB by clients: {mib}")
    assert held > two + 2 * model_bytes, "the measurement must see updates that are kept in memory"
    # Allocator noise reaches ~13 MiB under load; keeping the 50 updates would cost ~900 MiB, and
    # keeping any one full-rank update 42.6 MiB.
    assert fifty <= two + 0.5 * model_bytes


def masked_classifier_round(rule):
    """Three clients, three classes, one input feature; "samples" weighting with 1, 1 and 2 samples
    gives alpha = 0.25, 0.25, 0.5. The previous global classifier is 9 in every row.

    client  gamma  alpha  classes    classifier rows (weight = bias)
    A       1      0.25   all        [4, 8, 12]
    B       1/2    0.25   {0, 1}     [8, 4, 100]
    C       1/4    0.5    {1}        [100, 2, 100]
    """
    global_state = {"classifier.weight": torch.full((3, 1), 9.0), "classifier.bias": torch.full((3,), 9.0)}
    global_state["body.weight"] = torch.zeros(1)
    aggregator = StreamingAggregator(
        global_state,
        {},
        "samples",
        classifier_rule=rule,
        classifier_keys=frozenset({"classifier.weight", "classifier.bias"}),
    )
    clients = [
        (1.0, 1, [4.0, 8.0, 12.0], None, 1.0),
        (0.5, 1, [8.0, 4.0, 100.0], torch.tensor([True, True, False]), 2.0),
        (0.25, 2, [100.0, 2.0, 100.0], torch.tensor([False, True, False]), 3.0),
    ]
    for gamma, samples, rows, held, body in clients:
        update = {
            "classifier.weight": torch.tensor(rows)[:, None],
            "classifier.bias": torch.tensor(rows),
            "body.weight": torch.tensor([body]),
        }
        aggregator.add(update, gamma, samples, held)
    return aggregator.result()


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        # off: every row from every client. row 0: .25*4 + .25*8 + .5*100 = 1 + 2 + 50 = 53;
        # row 1: .25*8 + .25*4 + .5*2 = 2 + 1 + 1 = 4; row 2: .25*12 + .25*100 + .5*100 = 3 + 25 + 50 = 78.
        ("off", [53.0, 4.0, 78.0]),
        # reference: B and C add only their classes' rows, alpha not renormalised (A, full rank, adds all).
        # row 0: .25*4 + .25*8 = 3 (C lacks class 0); row 1: 2 + 1 + 1 = 4 (all hold it);
        # row 2: .25*12 = 3 (only A): rows held by few clients shrink.
        ("reference", [3.0, 4.0, 3.0]),
        # renormalised: the same sums divided by the holders' alpha. row 0: 3 / (.25 + .25) = 6;
        # row 1: 4 / 1 = 4; row 2: 3 / .25 = 12 (A's row itself).
        ("renormalised", [6.0, 4.0, 12.0]),
    ],
)
def test_label_masked_classifier_against_a_hand_computed_three_client_round(rule, expected):
    result = masked_classifier_round(rule)
    assert result["classifier.weight"][:, 0].tolist() == pytest.approx(expected)
    assert result["classifier.bias"].tolist() == pytest.approx(expected)
    # Other layers are the plain Eq. 2 average under every rule: .25*1 + .25*2 + .5*3 = 2.25.
    assert result["body.weight"].tolist() == pytest.approx([2.25])


@pytest.mark.parametrize("rule", ["reference", "renormalised"])
def test_a_classifier_row_nobody_trained_keeps_its_global_value(rule):
    """The reference code would zero row 2 here (it sums into zeros); fedfleet keeps the global row."""
    global_state = {"classifier.weight": torch.tensor([[9.0], [9.0], [9.0]])}
    aggregator = StreamingAggregator(
        global_state, {}, "uniform", classifier_rule=rule, classifier_keys=frozenset({"classifier.weight"})
    )
    aggregator.add(
        {"classifier.weight": torch.tensor([[2.0], [4.0], [6.0]])}, 0.5, 1, torch.tensor([True, False, False])
    )
    aggregator.add(
        {"classifier.weight": torch.tensor([[4.0], [8.0], [6.0]])}, 0.5, 1, torch.tensor([True, True, False])
    )
    # uniform alpha = .5 each. row 0: reference .5*2 + .5*4 = 3, renormalised 3 / 1 = 3;
    # row 1: reference .5*8 = 4, renormalised 4 / .5 = 8; row 2: nobody holds it -> 9.
    want = {"reference": [3.0, 4.0, 9.0], "renormalised": [3.0, 8.0, 9.0]}[rule]
    assert aggregator.result()["classifier.weight"][:, 0].tolist() == pytest.approx(want)


def test_a_masked_classifier_refuses_a_low_rank_client_without_classes():
    global_state = {"classifier.weight": torch.zeros(3, 1)}
    aggregator = StreamingAggregator(
        global_state, {}, classifier_rule="reference", classifier_keys=frozenset({"classifier.weight"})
    )
    with pytest.raises(UpdateRejected, match="'classes'"):
        aggregator.add({"classifier.weight": torch.ones(3, 1)}, 0.5)
    with pytest.raises(ValueError, match=r"unknown label_masked_classifier 'sometimes'.*renormalised"):
        StreamingAggregator(global_state, {}, classifier_rule="sometimes")


@pytest.mark.parametrize(
    ("classes", "problem"),
    [
        (None, "needs the client's classes"),
        (torch.tensor([0.0, 1.0]), "1-D integer"),
        (torch.tensor([[0, 1]]), "1-D integer"),
        (torch.tensor([0, 3]), r"in \[0, 3\)"),
        (torch.tensor([-1]), r"in \[0, 3\)"),
        (torch.tensor([1, 1]), "listed twice"),
        (torch.tensor([0, 1, 2, 0]), "4 entries for a model of 3 classes"),
    ],
)
def test_reported_classes_are_validated(classes, problem):
    extras = None if classes is None else {"classes": classes}
    with pytest.raises(UpdateRejected, match=problem):
        parse_classes(extras, 3)


def test_reported_classes_become_a_row_mask():
    assert parse_classes({"classes": torch.tensor([2, 0])}, 4).tolist() == [True, False, True, False]
