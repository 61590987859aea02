"""Replay buffer eviction, hand-out and chunk rules (Ray only where the samples go to the object store)."""

import pytest

from ray_forge.actors.buffer import COUNTERS, ReplayBuffer
from ray_forge.config.schema import BufferConfig
from ray_forge.core.episode import Episode, Turn


def _group(version, group_id, size=2):
    turn = Turn((1,), (2,), (-0.5,), version)
    return [Episode(group_id=group_id, seed=group_id, turns=(turn,), reward=float(i)) for i in range(size)]


def test_evicts_groups_older_than_the_lag():
    buf = ReplayBuffer(BufferConfig(max_policy_lag=1))
    buf.add([_group(0, 0), _group(1, 1), _group(2, 2)])
    assert buf.evict_stale(trainer_version=2) == 1
    assert buf.num_games() == 4
    batch = buf.sample(4, trainer_version=3)  # version 1 is now too old too
    assert batch is None and buf.num_games() == 2


def test_never_hands_out_twice_by_default():
    buf = ReplayBuffer(BufferConfig(max_policy_lag=5))
    buf.add([_group(0, g) for g in range(3)])
    first = buf.sample(4, trainer_version=0)
    assert [g[0].group_id for g in first] == [0, 1]
    second = buf.sample(2, trainer_version=0)
    assert [g[0].group_id for g in second] == [2]
    assert buf.sample(2, trainer_version=0) is None


def test_reuse_when_configured():
    buf = ReplayBuffer(BufferConfig(max_policy_lag=5, max_uses=2))
    buf.add([_group(0, 0)])
    assert buf.sample(2, 0) is not None and buf.sample(2, 0) is not None
    assert buf.sample(2, 0) is None


def test_capacity_drops_oldest():
    buf = ReplayBuffer(BufferConfig(max_policy_lag=5, capacity_games=4))
    buf.add([_group(0, g) for g in range(3)])
    assert buf.num_games() == 4 and buf.stats()["dropped_full"] == 2  # games of the oldest group
    assert buf.sample(2, 0)[0][0].group_id == 1


def test_every_game_is_accounted_for_once():
    buf = ReplayBuffer(BufferConfig(max_policy_lag=1, capacity_games=6))
    same = [Episode(group_id=9, seed=9, turns=(), reward=0.5) for _ in range(2)]  # no signal: all rewards equal
    buf.add([_group(0, 0), same, _group(1, 1)], next_batch=1)
    buf.add([_group(1, 2)], next_batch=2)  # 8 games in a buffer of 6: the oldest group goes
    assert buf.sample(4, trainer_version=1) is not None  # the no-signal group and group 1
    buf.add([_group(0, 3)], next_batch=3)
    buf.evict_stale(trainer_version=2)  # version 0 is now too old
    stats = buf.stats()
    assert stats == dict(generated=10, trained=2, evicted_stale=2, dropped_no_signal=2, dropped_full=2,
                         buffer_size=2)
    assert stats["generated"] == sum(stats[k] for k in COUNTERS[1:]) + stats["buffer_size"]


def test_state_round_trips_contents_counts_and_position():
    buf = ReplayBuffer(BufferConfig(max_policy_lag=5, max_uses=2))
    buf.add([_group(0, 0), _group(1, 1)], next_batch=7)
    buf.sample(2, trainer_version=1)  # group 0 used once, still in
    copy = ReplayBuffer(BufferConfig(max_policy_lag=5, max_uses=2))
    assert copy.load_state(buf.state()) == 4
    assert copy.stats() == buf.stats() and copy.next_batch == 7
    assert copy.sample(4, 1) == buf.sample(4, 1)  # same groups, same uses left: group 0 is used up
    assert copy.sample(2, 1) == buf.sample(2, 1) == [_group(1, 1)]  # group 1's second use
    assert copy.sample(2, 1) is None and buf.sample(2, 1) is None


def test_chunks_enter_whole_batches_in_order_and_a_replayed_chunk_counts_once():
    buffer = ReplayBuffer(BufferConfig(max_policy_lag=5))

    def g(group_id):
        return _group(0, group_id)

    buffer.add_chunk(1, 0, 2, [g(10)])
    buffer.add_chunk(0, 1, 2, [g(1)])
    assert buffer.num_games() == 0 and buffer.next_batch == 0  # nothing enters half a batch
    buffer.add_chunk(1, 1, 2, [g(11)])
    assert buffer.num_games() == 0  # batch 1 waits for batch 0
    buffer.add_chunk(0, 0, 2, [g(0)])
    assert buffer.next_batch == 2 and buffer.stats()["generated"] == 8
    assert [e.group[0].group_id for e in buffer._entries] == [0, 1, 10, 11]  # chunk order within a batch
    buffer.add_chunk(1, 1, 2, [g(11)])  # a worker that died after adding: its chunk is played again
    assert buffer.stats()["generated"] == 8 and buffer.next_batch == 2
    assert buffer.state()["next_batch"] == 2


def test_sample_batch_makes_samples_beside_the_games(ray_cluster):
    import ray

    buffer = ray.remote(ReplayBuffer).options(num_cpus=0).remote(BufferConfig(max_policy_lag=5))
    groups = [[Episode(group_id=0, seed=0, turns=(Turn((1,), (2,), (-0.5,), v),), reward=r)
               for r, v in ((0.0, 3), (1.0, 4))]]
    ray.get(buffer.add_chunk.remote(0, 0, 1, groups), timeout=60)
    assert ray.get(buffer.sample_batch.remote(4, 6, True), timeout=60) is None
    stats, ref = ray.get(buffer.sample_batch.remote(2, 6, True), timeout=60)
    assert isinstance(ref, ray.ObjectRef)
    samples = ray.get(ref, timeout=60)
    assert [s.token_versions for s in samples] == [(3,), (4,)]
    assert stats["policy_lag"] == 2.5 and stats["policy_lag_max"] == 3 and stats["num_rows"] == 2
    assert [s.advantage for s in samples] == pytest.approx([-1.0, 1.0], abs=1e-5)  # scaled by the group's std
    ray.get(buffer.add_chunk.remote(1, 0, 1, groups), timeout=60)
    _, ref = ray.get(buffer.wait_batch.remote(2, 6, True, 10.0, "none"), timeout=60)  # what the driver passes on
    assert [s.advantage for s in ray.get(ref, timeout=60)] == pytest.approx([-0.5, 0.5])
    ray.kill(buffer)
