import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_agent.secagg.errors import ParameterError
from device_agent.secagg.graph import components, neighbour_graph, ring_order, suggested, validate


def _devices(n):
    return [f"dev-{i:03d}" for i in range(n)]


@given(n=st.integers(3, 300), half=st.integers(1, 20), seed=st.binary(max_size=8))
@settings(max_examples=60, deadline=None)
def test_graph_is_regular_symmetric_and_seeded(n, half, seed):
    k = min(2 * half, n - 1)
    if k % 2 and k != n - 1:
        k -= 1
    graph = neighbour_graph(_devices(n), k, seed)
    assert set(graph) == set(_devices(n))
    for device, peers in graph.items():
        assert len(peers) == k and device not in peers
        assert all(device in graph[peer] for peer in peers)
    assert graph == neighbour_graph(list(reversed(_devices(n))), k, seed)  # order of the list does not matter


def test_another_round_draws_another_graph():
    assert neighbour_graph(_devices(50), 8, b"round-1") != neighbour_graph(_devices(50), 8, b"round-2")


def test_suggested_parameters_grow_as_log_n_and_validate():
    for n in (3, 10, 100, 300, 10_000):
        threshold, k = suggested(n)
        validate(n, threshold, k)
    assert suggested(10) == (5, 9)  # the complete graph for small fleets
    assert suggested(300) == (14, 26)
    assert suggested(10_000)[1] == 40


@pytest.mark.parametrize(
    "devices, threshold, neighbours, message",
    [
        (2, 2, 1, "^devices: secure aggregation needs at least 3 devices, got 2"),
        (10, 2, 10, r"^neighbours: must be in 2\.\.9"),
        (10, 2, 5, "^neighbours: must be even"),
        (10, 7, 6, r"^threshold: must be in 2\.\.6"),
        (10, 1, 6, "^threshold"),
    ],
)
def test_bad_parameters_name_themselves(devices, threshold, neighbours, message):
    with pytest.raises(ParameterError, match=message):
        validate(devices, threshold, neighbours)


def test_duplicate_ids_are_refused():
    with pytest.raises(ParameterError, match="distinct"):
        neighbour_graph(["a", "b", "a", "c"], 2, b"")


def test_components_of_the_surviving_ring():
    order = ring_order(_devices(10), b"s")
    graph = neighbour_graph(_devices(10), 2, b"s")  # a plain ring in `order`
    assert components(graph, _devices(10)) == [set(_devices(10))]
    alive = set(order) - {order[0], order[5]}
    assert sorted(map(sorted, components(graph, alive))) == sorted([sorted(order[1:5]), sorted(order[6:])])
    assert components(graph, []) == []
