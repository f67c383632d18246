"""Output plans: seeded, repeatable, shaped by the length distribution and the sampling params."""

import pytest
from simharness import SimulatorConfig

from simulator.config import parse_lengths
from simulator.engine import stream_points
from simulator.lengths import plan_output


def test_lognormal_lengths_have_the_configured_mean():
    config = SimulatorConfig(mean_output_tokens=200, sigma=1.0)
    plans = [plan_output(config, [i, i + 1], 100_000) for i in range(3000)]
    lengths = [len(p.ids) for p in plans]
    assert abs(sum(lengths) / len(lengths) - 200) < 20
    assert min(lengths) >= 1
    assert all(p.finish_reason["type"] == "stop" for p in plans)


def test_ids_stay_in_vocab_and_only_the_last_is_eos():
    config = SimulatorConfig(vocab_size=50, eos_token_id=7, lengths="fixed:500")
    ids = plan_output(config, [1], 1000).ids
    assert ids[-1] == 7 and 7 not in ids[:-1]
    assert all(0 <= i < 50 for i in ids)


def test_same_request_same_output_and_seeds_change_it():
    config = SimulatorConfig(lengths="uniform:10:1000")
    base = plan_output(config, [1, 2, 3], 5000)
    assert plan_output(config, [1, 2, 3], 5000) == base
    assert plan_output(config, [1, 2, 4], 5000) != base
    assert plan_output(config, [1, 2, 3], 5000, sampling_seed=1) != base
    assert plan_output(SimulatorConfig(lengths="uniform:10:1000", seed=1), [1, 2, 3], 5000) != base


def test_max_new_tokens_min_new_tokens_and_ignore_eos_shape_the_plan():
    config = SimulatorConfig(lengths="fixed:10")
    assert plan_output(config, [1], 4).finish_reason == {"type": "length", "length": 4}
    assert len(plan_output(config, [1], 0).ids) == 0
    assert len(plan_output(config, [1], 100, min_new_tokens=30).ids) == 31
    ignore = plan_output(config, [1], 100, ignore_eos=True)
    assert len(ignore.ids) == 100 and ignore.finish_reason["type"] == "length"


def test_length_specs_parse_or_name_the_problem():
    assert parse_lengths("fixed:7") == ("fixed", 7, 7)
    assert parse_lengths("uniform:3:9") == ("uniform", 3, 9)
    for bad in ("fixed", "uniform:9:3", "fixed:0", "normal:3"):
        with pytest.raises(ValueError, match="lengths"):
            SimulatorConfig(lengths=bad)


def test_stream_points_follow_sglang_stream_interval():
    assert list(stream_points(0, 5, 1)) == [1, 2, 3, 4, 5]
    assert list(stream_points(0, 12, 5)) == [1, 6, 11]
    assert list(stream_points(1, 6, 5)) == [6]
    assert list(stream_points(6, 10, 5)) == []
