"""The resumable, sharded batch sampler."""

import pytest

from bayesify.training.sampler import ResumableBatchSampler


def test_ranks_together_draw_the_single_process_global_batch():
    single = list(ResumableBatchSampler(103, 8, seed=3))
    shards = [list(ResumableBatchSampler(103, 4, seed=3, rank=r, world_size=2)) for r in range(2)]
    assert len(single) == len(shards[0]) == len(shards[1]) == 103 // 8
    for t, batch in enumerate(single):
        assert sorted(batch) == sorted(shards[0][t] + shards[1][t])


def test_epochs_differ_and_repeat_exactly():
    s = ResumableBatchSampler(50, 10, seed=1)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    s.set_epoch(0)
    assert list(s) == first != second
    assert sorted(i for b in first for i in b) == list(range(50))


def test_start_skips_consumed_batches():
    s = ResumableBatchSampler(64, 8, seed=0)
    s.set_epoch(2)
    whole = list(s)
    s.set_epoch(2, start=5)
    assert list(s) == whole[5:] and len(s) == 3


def test_a_global_batch_larger_than_the_data_names_the_fix():
    with pytest.raises(ValueError, match="--batch-size 10 or less"):
        ResumableBatchSampler(10, 8, world_size=2)
