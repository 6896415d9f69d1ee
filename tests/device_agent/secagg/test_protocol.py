"""The protocol end to end in one process: sums, dropouts at every stage, aborts, and what the server holds."""

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from device_agent.secagg.errors import ProtocolAborted, ProtocolViolation
from device_agent.secagg.graph import ring_order
from device_agent.secagg.local import STAGES, InProcessRun
from device_agent.secagg.messages import Params, Session
from device_agent.secagg.quantize import to_bytes
from device_agent.secagg.server import ServerStage
from tests.device_agent.secagg.conftest import devices, inputs_for


def _plain_sum(inputs, survivors):
    return np.sum([inputs[device] for device in survivors], axis=0)


def test_no_dropout_sum_equals_plain_sum(session):
    params = Params(devices(10), threshold=4, neighbours=6, length=257, clip=0.5, bits=16)
    inputs = inputs_for(params)
    run = InProcessRun(session, params, inputs, keys={d: bytes([i]) * 32 for i, d in enumerate(params.participants)})
    result = run.run()
    assert result.survivors == params.participants and result.dropped == ()
    assert np.max(np.abs(result.total - _plain_sum(inputs, params.participants))) <= result.error_bound
    assert np.allclose(result.mean, result.total / 10)


def _connected(graph, members):
    members = set(members)
    reached, frontier = set(), [next(iter(members))]
    while frontier:
        device = frontier.pop()
        if device not in reached:
            reached.add(device)
            frontier.extend(graph[device] & members)
    return reached == members


def _prune(graph, members, threshold):
    members = set(members)
    while weak := {d for d in members if len(graph[d] & members) < threshold}:
        members -= weak
    return members


@given(
    n=st.integers(3, 50),
    fractions=st.tuples(*[st.floats(0, 0.3)] * 4),
    seed=st.integers(0, 2**32 - 1),
    strictness=st.floats(0, 1),
)
@settings(max_examples=60, deadline=None)
def test_unmasked_sum_is_the_survivors_plain_sum_whatever_drops_out(n, fractions, seed, strictness):
    rng = random.Random(seed)
    degrees = [k for k in range(2, n) if k % 2 == 0 or k == n - 1]
    k = rng.choice(degrees)
    threshold = 2 + round(strictness * (k // 2 - 1)) if k >= 4 else 2
    params = Params(devices(n), threshold=threshold, neighbours=k, length=33, clip=1.0, bits=12)
    inputs = inputs_for(params, seed)
    alive, drop = set(params.participants), {}
    for stage, fraction in zip(STAGES, fractions, strict=True):
        drop[stage] = set(rng.sample(sorted(alive), round(fraction * len(alive))))
        alive -= drop[stage]
    run = InProcessRun(Session("fleet", "run", seed), params, inputs, drop=drop)
    graph = run.server.graph
    try:
        result = run.run()
    except ProtocolAborted as abort:
        # An abort must be forced by the dropouts: check its claim against who really answered.
        event(f"aborted at {abort.stage}")
        server = run.server
        if abort.stage == ServerStage.UNMASK.value:
            responders = server.members - drop["mask"] - drop["unmask"]
            assert abort.count == len(graph[abort.device] & responders) < threshold
        elif abort.device is not None:
            assert abort.stage == ServerStage.MASK.value
            assert abort.count == len(graph[abort.device] & (server.members - drop["mask"])) < threshold
        elif abort.stage == ServerStage.MASK.value:
            sent = server.members - drop["mask"]
            assert len(sent) < threshold or not _connected(graph, sent)
        else:
            before = set(params.participants) - drop["advertise"]
            kept = _prune(graph, before, threshold)
            if abort.stage == ServerStage.SHARE_KEYS.value:
                kept = _prune(graph, kept - drop["share_keys"], threshold)
            assert len(kept) < threshold
        return
    event("summed")
    assert set(result.survivors) <= set(params.participants) - drop["advertise"] - drop["share_keys"] - drop["mask"]
    assert len(result.survivors) >= threshold
    assert np.max(np.abs(result.total - _plain_sum(inputs, result.survivors))) <= result.error_bound * (1 + 1e-9)


@pytest.mark.parametrize("n", [5, 8, 50])
def test_dropouts_at_each_stage_are_recovered(n, session):
    k = n - 1 if n < 10 else 12
    params = Params(devices(n), threshold=2, neighbours=k, length=64, clip=1.0, bits=16)
    inputs = inputs_for(params, n)
    last = params.participants[-1]
    drop = (
        {"mask": {params.participants[0]}, "unmask": {last}}
        if n == 5
        else {
            "advertise": {params.participants[0]},
            "share_keys": {params.participants[1]},
            "mask": {params.participants[2], params.participants[3]},
            "unmask": {last},
        }
    )
    result = InProcessRun(session, params, inputs, drop=drop).run()
    expected = set(params.participants) - set().union(*(drop.get(s, set()) for s in STAGES[:3]))
    assert set(result.survivors) == expected  # the one lost at unmasking is counted: its input was sent
    assert last in result.survivors
    assert np.max(np.abs(result.total - _plain_sum(inputs, result.survivors))) <= result.error_bound


def _stored(value, seen=None):
    """Every array and byte string reachable from ``value`` (objects, dicts, sequences, dataclasses)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, np.ndarray | bytes):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _stored(key, seen)
            yield from _stored(item, seen)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from _stored(item, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _stored(getattr(value, field.name), seen)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        yield from _stored(vars(value), seen)


@given(seed=st.integers(0, 2**32 - 1), drop_mask=st.integers(0, 2))
@settings(max_examples=10, deadline=None)
def test_server_never_holds_one_devices_input(seed, drop_mask):
    params = Params(devices(6), threshold=2, neighbours=4, length=40, clip=1.0, bits=16)
    inputs = inputs_for(params, seed)
    run = InProcessRun(Session("f", "r", seed), params, inputs, drop={"mask": set(params.participants[:drop_mask])})
    snapshots = []
    server = run.server
    receive, advance = server.receive, server.advance

    def spy(call):
        def wrapped(*args):
            out = call(*args)
            snapshots.append(list(_stored(server)))  # the server's whole state after every step
            return out

        return wrapped

    server.receive, server.advance = spy(receive), spy(advance)
    run.run()
    quantizer = params.quantizer
    for values in inputs.values():
        quantized = quantizer.encode(values)
        wire = to_bytes(quantized, quantizer.modulus_bits)
        for state in snapshots:
            for stored in state:
                if isinstance(stored, bytes):
                    assert stored != wire
                elif stored.size == params.length:
                    assert not np.array_equal(stored.astype(np.uint64, copy=False), quantized)
                    assert not np.allclose(stored, values, atol=quantizer.step)


def test_too_few_survivors_abort_naming_stage_and_threshold(session):
    params = Params(devices(5), threshold=3, neighbours=4, length=8, clip=1.0, bits=8)
    drop = {"mask": set(devices(5)[:3])}
    with pytest.raises(ProtocolAborted, match="at masked input: 2 devices sent masked input, fewer than the threshold"):
        InProcessRun(session, params, inputs_for(params), drop=drop).run()
    run = InProcessRun(session, params, inputs_for(params), drop={"unmask": set(devices(5)[:3])})
    with pytest.raises(ProtocolAborted, match=r"at unmasking: 2 neighbours of dev-\d\d returned shares") as abort:
        run.run()
    assert run.server.stage is ServerStage.ABORTED and abort.value.count == 2
    with pytest.raises(ProtocolAborted, match="aborted at advertise keys: 2 of 5 devices advertised keys"):
        InProcessRun(session, params, inputs_for(params), drop={"advertise": set(devices(5)[:3])}).run()


def test_device_refuses_to_reveal_both_shares_of_a_device_and_to_answer_twice(session):
    params = Params(devices(4), threshold=2, neighbours=3, length=4, clip=1.0, bits=8)
    run = InProcessRun(session, params, inputs_for(params), drop={"unmask": set(devices(4))})
    with pytest.raises(ProtocolAborted):
        run.run()
    request = run.server._requests["dev-00"]
    device = run.devices["dev-00"]
    greedy = dataclasses.replace(request, dropped=("dev-01",), survivors=("dev-01", "dev-02"))
    with pytest.raises(ProtocolViolation, match=r"both the mask-key share and the seed share of \['dev-01'\]"):
        device.unmask(greedy)
    device.unmask(request)
    with pytest.raises(ProtocolViolation, match="unmask_request at stage done"):
        device.unmask(request)


def test_survivors_split_into_groups_abort_rather_than_reveal_each_groups_sum(session):
    # A ring of 12 where each device masks against the 2 nearest on either side: losing two pairs of
    # opposite devices leaves two arcs of 4 with no mask in common. Every device still has 2 live neighbours
    # (the threshold), so only the split stops it: a coordinator that kept the masked inputs could add up
    # each arc's after unmasking.
    params = Params(devices(12), threshold=2, neighbours=4, length=6, clip=1.0, bits=8)
    order = ring_order(params.participants, f"{session.label}/graph".encode())
    drop = {"mask": {order[0], order[1], order[6], order[7]}}
    with pytest.raises(ProtocolAborted, match=r"8 devices that sent masked input fall into 2 groups .* \[4, 4\]"):
        InProcessRun(session, params, inputs_for(params), drop=drop).run()
    drop = {"mask": {order[0], order[1], order[6]}}  # one arc still joins the rest: unmasked as usual
    result = InProcessRun(session, params, inputs_for(params), drop=drop).run()
    assert len(result.survivors) == 9


def test_in_process_run_names_an_unknown_stage(session):
    params = Params(devices(3), threshold=2, neighbours=2, length=1, clip=1.0, bits=8)
    with pytest.raises(ValueError, match=r"drop: unknown stages \['upload'\]"):
        InProcessRun(session, params, inputs_for(params), drop={"upload": {"dev-00"}})
