import numpy as np
import pytest
import torch

from device_agent.data.partition import (
    PartitionSpec,
    capped,
    client_shard,
    domain_classes,
    iid_partition,
    iid_shard,
    label_permutation,
    partition,
)

LABELS = np.repeat(np.arange(10), 30)


@pytest.mark.parametrize(
    "spec",
    [
        PartitionSpec("iid", 4, seed=1),
        PartitionSpec("dirichlet", 5, seed=1, alpha=0.1),
        PartitionSpec("domains", 6, seed=1, num_domains=2),
    ],
)
def test_every_sample_goes_to_exactly_one_client_and_is_reproducible(spec):
    shards = partition(LABELS, spec)
    assert len(shards) == spec.num_clients
    assert sorted(np.concatenate(shards).tolist()) == list(range(len(LABELS)))
    again = partition(LABELS, spec)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))


def test_iid_shards_are_near_equal_and_seed_dependent():
    shards = partition(LABELS, PartitionSpec("iid", 4, seed=0))
    assert [len(s) for s in shards] == [75] * 4
    assert not np.array_equal(shards[0], partition(LABELS, PartitionSpec("iid", 4, seed=1))[0])


def test_small_alpha_concentrates_labels():
    skewed = partition(LABELS, PartitionSpec("dirichlet", 5, seed=0, alpha=0.05))
    even = partition(LABELS, PartitionSpec("dirichlet", 5, seed=0, alpha=100))

    def classes(shards):
        return np.mean([len(np.unique(LABELS[s])) for s in shards if len(s)])

    assert classes(skewed) < classes(even)


def test_domains_are_disjoint_class_groups():
    shards = partition(LABELS, PartitionSpec("domains", 4, seed=0, num_domains=2))
    seen = [set(LABELS[s].tolist()) for s in shards]
    assert seen[0] | seen[1] == {0, 1, 2, 3, 4} and seen[2] | seen[3] == {5, 6, 7, 8, 9}
    assert [g.tolist() for g in domain_classes(10, 2)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_permuted_labels_use_seed_plus_client_id():
    x, y = torch.arange(300.0)[:, None], torch.from_numpy(LABELS)
    spec = PartitionSpec("iid", 3, seed=5, permute_labels=True)
    xs, ys = client_shard(x, y, spec, 2, 10)
    permutation = label_permutation(10, 5, 2)
    assert sorted(permutation.tolist()) == list(range(10))
    assert torch.equal(ys, permutation[y[xs[:, 0].long()]])
    assert torch.equal(permutation, torch.from_numpy(np.random.default_rng(7).permutation(10)))
    assert not torch.equal(label_permutation(10, 5, 1), permutation)


def test_bad_specs_say_what_is_wrong():
    with pytest.raises(ValueError, match="unknown partition scheme 'shards'"):
        PartitionSpec("shards")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="alpha must be > 0"):
        PartitionSpec("dirichlet", alpha=0)
    with pytest.raises(ValueError, match=r"client index must be in \[0, 2\)"):
        client_shard(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long), PartitionSpec("iid", 2), 2)


def test_a_capped_shard_keeps_the_same_images_for_a_seed_and_no_more_than_asked():
    x, y = torch.arange(40.0).reshape(20, 2), torch.arange(20)
    first, again = capped((x, y), 8, seed=3), capped((x, y), 8, seed=3)
    assert len(first[1]) == 8 and torch.equal(first[1], again[1]) and torch.equal(first[0], x[first[1]])
    assert len(set(first[1].tolist())) == 8  # drawn without replacement
    assert not torch.equal(capped((x, y), 8, seed=4)[1], first[1])
    assert capped((x, y), 50, seed=3) == (x, y) and capped((x, y), None, seed=3) == (x, y)


@pytest.mark.parametrize(("samples", "clients"), [(60_000, 1000), (1437, 300), (10, 3), (5, 8)])
def test_one_iid_shard_is_that_client_of_the_whole_partition(samples, clients):
    whole = iid_partition(samples, clients, seed=11)
    for client in {0, 1, clients // 2, clients - 1}:
        np.testing.assert_array_equal(iid_shard(samples, clients, 11, client), whole[client])
