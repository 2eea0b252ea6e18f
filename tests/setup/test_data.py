"""The batch stream: numbered by step, epochs cycle, drawn as the user's own loop draws."""

from __future__ import annotations

import itertools

import pytest
import torch

from nandoctor.errors import ConfigError, UserCodeError
from nandoctor.setup.data import BatchStream


def take(stream, n):
    return list(itertools.islice(stream, n))


def test_a_list_cycles_epochs_with_steps_counting_on():
    stream = BatchStream(lambda: ["a", "b", "c"])
    assert take(stream, 7) == [(0, "a"), (1, "b"), (2, "c"), (3, "a"), (4, "b"), (5, "c"), (6, "a")]


def test_steps_start_after_a_checkpoint_step():
    assert take(BatchStream(lambda: [1, 2], start_step=100), 3) == [
        (100, 1),
        (101, 2),
        (102, 1),
    ]


def test_a_generator_is_rebuilt_each_epoch():
    calls = []

    def make():
        calls.append(1)
        return (i for i in range(2))

    assert [b for _, b in take(BatchStream(make), 5)] == [0, 1, 0, 1, 0]
    assert len(calls) == 3


def test_empty_data_is_a_config_error():
    with pytest.raises(ConfigError, match="data: yielded no batches in the first epoch"):
        take(BatchStream(list), 1)


def test_non_iterable_data_is_a_config_error():
    with pytest.raises(ConfigError, match="data: returned an int, expected an iterable"):
        take(BatchStream(lambda: 3), 1)


def test_data_raising_is_the_users_error_named_by_its_entrypoint():
    def make():
        yield 1
        raise OSError("disk gone")

    where = "data (train.py:build_data)"  # NB: as a session names its config's entrypoint
    with pytest.raises(UserCodeError, match="disk gone") as caught:
        take(BatchStream(make, where=where), 3)
    assert caught.value.message.startswith("data (train.py:build_data) raised OSError")


def shuffled(generator=None, workers=0):
    dataset = torch.utils.data.TensorDataset(torch.arange(32.0))
    return torch.utils.data.DataLoader(
        dataset, batch_size=4, shuffle=True, generator=generator, num_workers=workers
    )


def test_each_epoch_shuffles_from_the_global_rng_as_it_begins_as_the_users_loop_does():
    """Dropout draws from the global RNG between batches; the user's loop draws the next
    epoch's order from it after that, and so does the stream."""

    def users_loop():
        torch.manual_seed(0)
        loader, out = shuffled(), []
        for _ in range(2):
            for (x,) in loader:
                out.append(x.tolist())
                torch.rand(1000)  # what a dropout layer would consume
        return out

    def streamed():
        torch.manual_seed(0)
        out = []
        for _, (x,) in itertools.islice(BatchStream(shuffled), 16):
            out.append(x.tolist())
            torch.rand(1000)
        return out

    assert streamed() == users_loop()
    assert users_loop()[:8] != users_loop()[8:]  # the second epoch is shuffled anew


def test_a_loaders_own_generator_draws_only_what_the_users_loop_draws():
    def order(loader):
        return [x.tolist() for (x,) in itertools.chain(loader, loader)]

    users = order(shuffled(torch.Generator().manual_seed(5)))
    stream = BatchStream(lambda: shuffled(torch.Generator().manual_seed(5)))
    assert [x.tolist() for _, (x,) in take(stream, 16)] == users


@pytest.mark.parametrize("workers", [0, 2])
def test_each_batch_of_a_map_style_loader_comes_with_its_dataset_indices(workers):
    stream = BatchStream(lambda: shuffled(workers=workers))
    for step, (x,) in take(stream, 12):  # an epoch and a half
        assert stream.indices_of(step) == (tuple(int(v) for v in x.tolist()),)


def test_indices_are_unknown_where_the_data_is_no_map_style_loader():
    stream = BatchStream(lambda: [torch.zeros(2), torch.ones(2)])
    take(stream, 3)
    assert stream.indices_of(2) == (None,)
    assert stream.indices_of(7) is None  # not drawn (or long forgotten)


def test_with_accumulation_each_micro_batch_has_its_indices():
    stream = BatchStream(lambda: shuffled(torch.Generator().manual_seed(1)), accum=3)
    step, micro = take(stream, 3)[-1]  # 9 batches: the second epoch began in this step
    assert stream.indices_of(step) == tuple(
        tuple(int(v) for v in x.tolist()) for (x,) in micro.batches
    )


def test_a_distributed_samplers_epoch_is_set_each_epoch_as_the_job_does():
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dataset = TensorDataset(torch.arange(8.0))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    stream = BatchStream(lambda: loader)
    epochs = [batch[0].tolist() for _, batch in itertools.islice(stream, 2)]
    assert sampler.epoch == 1 and epochs[0] != epochs[1]  # reshuffled, as set_epoch does


def test_with_accumulation_a_step_is_n_consecutive_batches_across_epochs():
    from nandoctor.setup.data import MicroBatches

    stream = BatchStream(lambda: [0, 1, 2, 3, 4], start_step=10, accum=2)
    steps = list(itertools.islice(stream, 4))
    assert steps == [
        (10, MicroBatches((0, 1))),
        (11, MicroBatches((2, 3))),
        (12, MicroBatches((4, 0))),  # the last group of an epoch runs on into the next
        (13, MicroBatches((1, 2))),
    ]


class Samples(torch.utils.data.Dataset):
    """A map-style dataset: one (x, y) sample per index."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i >= 4:
            raise IndexError(i)
        return torch.randn(8), torch.tensor(i % 2)


def test_a_map_style_dataset_is_refused_with_the_dataloader_to_return():
    # iterated as it is, each "batch" would be one unbatched sample
    with pytest.raises(ConfigError, match="data: returned a Samples, a dataset of samples") as e:
        take(BatchStream(Samples), 1)
    assert "DataLoader(dataset, batch_size=...)" in (e.value.hint or "")


def test_the_dataloader_of_that_dataset_is_batches():
    loader = lambda: torch.utils.data.DataLoader(Samples(), batch_size=2)  # noqa: E731
    (_, (x, y)), _ = take(BatchStream(loader), 2)
    assert x.shape == (2, 8) and y.shape == (2,)


def test_an_iterable_dataset_may_yield_batches():
    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([torch.zeros(2, 8), torch.ones(2, 8)])

    assert [b.shape for _, b in take(BatchStream(Batches), 2)] == [(2, 8), (2, 8)]


def test_a_hugging_face_dataset_of_examples_is_refused_but_not_a_users_datasets_folder():
    class Dataset:  # stands for datasets.Dataset (not installed here): items are examples
        def __iter__(self):
            return iter([{"x": [1.0]}])

    Dataset.__module__ = "datasets.arrow_dataset"
    with pytest.raises(ConfigError, match="data: returned a Dataset, a dataset of samples"):
        take(BatchStream(Dataset), 1)
    Dataset.__module__ = "datasets.mine"  # the user's own package named `datasets`
    assert take(BatchStream(Dataset), 1) == [(0, {"x": [1.0]})]
