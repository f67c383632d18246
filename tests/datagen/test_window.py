"""The training window: what a row can train on, and the caps that keep generation inside it."""

from __future__ import annotations

from typing import Any

import pytest

from config.settings import Settings
from datagen.client import Generation
from datagen.generation.job import Job, Prompt
from datagen.generation.records import counted_tokens
from datagen.generation.runner import counted_cap
from datagen.generation.turns import Conversation, generate_turns
from datagen.generation.window import cap_share, room, row_length, trainable
from datagen.training.handoff import loss_mask


def test_trainable_counts_the_generated_tokens_inside_the_window_but_the_last() -> None:
    # SpecForge zeroes the loss of a row's last position (nothing follows it)
    assert trainable(100, 300, 2048, "truncate") == 199  # all of it fits
    assert trainable(1000, 4000, 2048, "truncate") == 1047  # cut at the window
    assert trainable(3000, 4000, 2048, "truncate") == 0  # the prompt fills it
    assert trainable(1000, 4000, 2048, "skip") == 0  # prepare drops the row whole
    assert trainable(1000, 2048, 2048, "skip") == 1047
    assert trainable(100, 101, 2048, "truncate") == 0  # a 1-token answer trains nothing
    assert trainable(100, 102, 2048, "truncate") == 1
    # several turns: only the generated spans, each cut at the window
    assert trainable(0, 30, 25, "truncate", [(4, 9), (11, 16), (18, 30)]) == 5 + 5 + 6
    # a row that ends in template ids after its last turn loses none of its turns
    assert trainable(0, 20, 25, "truncate", [(4, 9), (11, 16)]) == 5 + 5
    # a captured row ends one id before the answer's last (never an input)
    assert row_length(100, 200, captured=True) == 299 and row_length(100, 200, False) == 300
    assert trainable(100, row_length(100, 1, captured=True), 2048, "truncate") == 0


@pytest.mark.parametrize(("n_prompt", "n_total", "window", "spans"), [
    (100, 300, 2048, ()), (1000, 4000, 2048, ()), (3000, 4000, 2048, ()), (5, 6, 64, ()),
    (5, 7, 64, ()), (0, 30, 25, ((4, 9), (11, 16), (18, 30))), (0, 20, 25, ((4, 9), (11, 16))),
    (10, 64, 64, ())])
def test_trainable_is_what_specforge_s_own_normaliser_leaves_in_the_loss_mask(
        n_prompt: int, n_total: int, window: int, spans: tuple[tuple[int, int], ...]) -> None:
    # The row as the extraction writes it (its loss_mask), read by SpecForge's EAGLE-3 offline
    # normaliser at data.max_length = the window: what it leaves at 1 is what trains
    import torch
    from specforge.algorithms.eagle3.data import normalize_offline_sample

    mask = torch.tensor(loss_mask(n_prompt, n_total, spans), dtype=torch.int64)
    raw = {"input_ids": torch.arange(n_total), "loss_mask": mask,
           "hidden_state": torch.zeros(1, n_total, 2),
           "aux_hidden_state": torch.zeros(1, n_total, 6)}
    trained = int(normalize_offline_sample(raw, window)["loss_mask"].sum())
    assert trainable(n_prompt, n_total, window, "truncate", spans) == trained


def test_room_and_the_share_of_a_cap_inside_the_window() -> None:
    assert room(1075, 2048) == 973 and room(3000, 2048) == 0
    assert cap_share(1075, 10240, 2048) == 973 and cap_share(100, 500, 2048) == 500


def test_a_trainable_count_is_read_from_the_record_or_its_lengths() -> None:
    record: dict[str, Any] = {"prompt_ids": [1] * 1500, "output_ids": [2] * 1000,
                              "prompt_tokens": 1500, "completion_tokens": 1000}
    assert counted_tokens(record, "completion") == 1000
    assert counted_tokens(record, "trainable", window=2048) == 548  # written before the field
    assert counted_tokens(record, "trainable") == 1000  # no window to place it in
    assert counted_tokens({**record, "trainable_tokens": 300}, "trainable", window=2048) == 300


def test_admission_reserves_what_a_sample_can_count() -> None:
    job = Job("B1", "s1", "short", "p", 0, 1500, 10240)
    assert counted_cap(Settings(budget_counts="trainable"), job) == 548
    assert counted_cap(Settings(budget_counts="completion"), job) == 10240
    capped = Job("B1", "s1", "short", "p", 0, 1500, 200, turns=3, window=2048)
    assert capped.sample_cap == 548 and Job.from_payload(capped.payload()) == capped


class LongClient:
    """Answers every turn at its max_new_tokens (the response would be longer)."""

    def __init__(self) -> None:
        self.caps: list[int] = []

    def generate(self, ids: list[int], params: dict[str, Any], rid: str,
                 dataset: str | None = None) -> Generation:
        self.caps.append(params["max_new_tokens"])
        out = [7] * params["max_new_tokens"]
        return Generation(out, {"type": "length"}, len(ids), len(out), 0.1, "")


def test_the_turns_of_a_capped_sample_share_the_window_and_the_row_fits_it() -> None:
    # Given: a 4-id prompt, 3 ids of template before each of 2 later turns, a window of 20
    job = Job("B1", "s1", "short", "p", 0, 4, 100, turns=3, window=20)
    prompt = Prompt("s1", "B1", [], [1, 5, 5, 6], [[2, 3, 6]] * 2)
    client = LongClient()
    # When: every turn would run to its cap
    result = generate_turns(client, job, prompt, "rid", {}, True, lambda: "ok")  # type: ignore[arg-type]
    # Then: the 10 free positions are shared (3, 3, then the 4 left) and the row is 20 ids
    assert isinstance(result, Conversation)
    assert client.caps == [3, 3, 4]
    assert len(result.prompt_ids) + len(result.last.output_ids) == 20


def test_turns_capped_by_the_window_are_kept_with_keep_truncated_off() -> None:
    # Given: every turn would run past its share of a 20-token window; keep_truncated off
    job = Job("B1", "s1", "short", "p", 0, 4, 100, turns=3, window=20)
    prompt = Prompt("s1", "B1", [], [1, 5, 5, 6], [[2, 3, 6]] * 2)
    # When: the turns run, each cut at its share
    result = generate_turns(LongClient(), job, prompt, "rid", {}, False,  # type: ignore[arg-type]
                            lambda: "ok")
    # Then: a turn cut by the window is not a truncated generation: the sample is whole
    assert isinstance(result, Conversation) and len(result.turns) == 3
    # And: a turn cut at max_new_tokens short of its share still stops the sample
    short = Job("B1", "s1", "short", "p", 0, 4, 2, turns=3, window=20)
    stopped = generate_turns(LongClient(), short, prompt, "rid", {}, False,  # type: ignore[arg-type]
                             lambda: "ok")
    assert not isinstance(stopped, Conversation) and stopped.reason == "truncated"
