"""How units are cut among data-parallel ranks (``slidekit.distributed.shards``): pure arithmetic."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slidekit.distributed import unit_shard, unit_shards
from slidekit.planning.placement import GRANULE


@given(numel=st.integers(0, 40 * GRANULE), world=st.integers(1, 9))
def test_the_shards_of_a_unit_cover_it_once_in_rank_order(numel, world):
    shards = [unit_shard(numel, world, r) for r in range(world)]
    assert shards[0].start == 0
    assert shards[-1].stop == numel
    for a, b in itertools.pairwise(shards):
        assert a.stop == b.start
    assert sum(s.size for s in shards) == numel
    for s in shards:
        assert 0 <= s.size <= s.chunk
        assert s.offset + s.chunk <= s.padded  # each rank's piece lies in the padded buffer
        if s.size:
            assert s.offset == s.start
    assert shards[0].padded >= numel


@given(numel=st.integers(1, 40 * GRANULE), world=st.integers(2, 9))
def test_shards_start_at_granule_multiples_and_are_as_even_as_granules_allow(numel, world):
    shards = [unit_shard(numel, world, r) for r in range(world)]
    assert all(s.start % GRANULE == 0 for s in shards if s.size)  # an empty one sits at the unit's end
    assert shards[0].chunk % GRANULE == 0
    # No rank owns more than one GRANULE beyond an even split.
    assert max(s.size for s in shards) <= -(-numel // world) + GRANULE


def test_one_rank_owns_every_unit_whole_and_unpadded():
    for numel in (1, 5000, 3 * GRANULE + 7):
        s = unit_shard(numel, 1, 0)
        assert (s.start, s.stop, s.padded) == (0, numel, numel)


def test_a_small_unit_leaves_the_last_ranks_empty_shards():
    shards = unit_shards([2 * GRANULE], 4, 3) + unit_shards([2 * GRANULE], 4, 1)
    assert shards[0].size == 0
    assert (shards[1].start, shards[1].stop) == (GRANULE, 2 * GRANULE)
    assert shards[0].of(0).stop == GRANULE


@pytest.mark.parametrize(("numel", "world", "rank"), [(10, 0, 0), (10, 2, 2), (10, 2, -1), (-1, 2, 0)])
def test_bad_arguments_are_refused(numel, world, rank):
    with pytest.raises(ValueError):
        unit_shard(numel, world, rank)
