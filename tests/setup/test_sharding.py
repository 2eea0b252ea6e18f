"""Which batches a rank sees: data the same on every rank is split, data that is already
rank-aware is kept, a user's own DistributedSampler is kept. The ranks' exchange of
fingerprints is injected here; tests/setup/test_distributed.py runs the real one on 2 ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from nandoctor.errors import ConfigError
from nandoctor.setup.sharding import Sharder, fingerprint


def _batches(seed: int, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, generator=g), torch.arange(2) + i) for i in range(n)]


def _as_if(other_ranks_first_batch):
    """A gather where the other rank's first batch is the one given."""
    return lambda mine: [mine, fingerprint(other_ranks_first_batch)]


def test_a_fingerprint_reads_values_and_structure():
    a = _batches(0)[0]
    assert fingerprint(a) == fingerprint((a[0].clone(), a[1].clone()))
    assert fingerprint(a) != fingerprint((a[0] + 1e-3, a[1]))
    assert fingerprint(a) != fingerprint([a[0], a[1]])  # a list is not a tuple
    assert fingerprint({"x": torch.ones(2, dtype=torch.bfloat16)}) != fingerprint(
        {"x": torch.ones(2)}
    )


def test_the_same_list_on_every_rank_is_split_by_position():
    data = _batches(0)
    sharder = Sharder(1, 2, _as_if(data[0]))
    seen = list(sharder.split(data))
    assert sharder.how == "by-position"
    assert [fingerprint(b) for b in seen] == [fingerprint(b) for b in data[1::2]]


def test_a_rank_aware_iterable_is_left_as_it_is():
    mine, theirs = _batches(1), _batches(0)
    sharder = Sharder(1, 2, _as_if(theirs[0]))
    assert list(sharder.split(mine)) == mine
    assert sharder.how == "self"


def test_a_rank_aware_generator_keeps_its_first_batch():
    mine, theirs = _batches(1), _batches(0)
    sharder = Sharder(1, 2, _as_if(theirs[0]))
    seen = list(sharder.split(iter(mine)))
    assert [fingerprint(b) for b in seen] == [fingerprint(b) for b in mine]


def test_the_decision_is_made_once_for_every_epoch():
    calls = []
    data = _batches(0)

    def gather(mine):
        calls.append(mine)
        return [mine, mine]

    sharder = Sharder(0, 2, gather)
    sharder.split(data), sharder.split(data)
    assert len(calls) == 1 and sharder.how == "by-position"


def test_a_users_own_distributed_sampler_is_kept():
    dataset = TensorDataset(torch.randn(8, 3))
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 2, 1))
    sharder = Sharder(1, 2, lambda mine: [mine, "another"])
    assert sharder.split(loader) is loader and sharder.how == "sampler"


def test_the_same_map_style_loader_gets_a_distributed_sampler():
    dataset = TensorDataset(torch.arange(8.0))
    loader = DataLoader(dataset, batch_size=2, shuffle=False)
    sharder = Sharder(1, 2, lambda mine: [mine, mine])
    split = sharder.split(loader)
    assert sharder.how == "sampler" and isinstance(split.sampler, DistributedSampler)
    assert [b[0].tolist() for b in split] == [[1.0, 3.0], [5.0, 7.0]]


def test_peeking_at_a_shuffled_loader_leaves_the_rng_as_it_was():
    dataset = TensorDataset(torch.arange(8.0))
    loader = DataLoader(dataset, batch_size=2, shuffle=True)
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    Sharder(0, 2, lambda mine: [mine, "another"]).split(loader)
    assert torch.equal(torch.rand(1), expected)


def test_a_dataset_of_samples_is_refused_before_its_samples_are_dealt_out_as_batches():
    samples = TensorDataset(torch.randn(4, 3), torch.arange(4))
    sharder = Sharder(1, 2, _as_if(samples[0]))
    with pytest.raises(ConfigError, match="a dataset of samples; expected batches"):
        sharder.split(samples)
