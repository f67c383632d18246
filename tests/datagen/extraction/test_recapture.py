"""The re-capture cross-check's comparison (datagen/extraction/recapture.py), layer by layer
and position by position, and which samples it takes. The request to a real vLLM server and
the planted faults it catches: tests/real_vllm/test_capture_vllm.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from datagen.extraction.recapture import Recapture, worst_difference
from datagen.extraction.tolerance import Tolerance

N, H, AUX = 20, 16, (1, 3, 4)


def states() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, 3 * H, generator=g), torch.randn(N, H, generator=g)


def recapture(share: float = 0.0) -> Recapture:
    return Recapture("http://127.0.0.1:9", ".", share, AUX, Tolerance(torch.float32,
                                                                       "recompute"))


def test_alike_states_pass_and_each_planted_fault_is_named_by_layer_and_position() -> None:
    aux, final = states()
    check = recapture()
    assert check.differs(aux, final, (aux.clone(), final.clone())) is None
    # within float32's rounding of a second forward: alike
    assert check.differs(aux * (1 + 1e-6), final, (aux, final)) is None

    # the aux rows of one decode step shifted by one position (step 12's row at 13)
    shifted = aux.clone()
    shifted[13] = aux[12]
    found = check.differs(shifted, final, (aux, final))
    assert (found.name, found.position) == ("aux_hidden_state", 13) and found.relative > 0.5

    # a block of finite garbage in the second aux layer only: named by its layer id
    garbage = aux.clone()
    garbage[4:8, H:2 * H] = torch.randn(4, H)
    found = check.differs(garbage, final, (aux, final))
    assert (found.layer, 4 <= found.position < 8) == (3, True)

    # finite garbage in the prompt's final states
    prompt = final.clone()
    prompt[:3] = torch.randn(3, H)
    found = check.differs(aux, prompt, (aux, final))
    assert (found.name, found.layer, found.position < 3) == ("hidden_state", -1, True)


def test_worst_difference_is_relative_per_layer() -> None:
    a = torch.ones(2, 2 * H)
    b = a.clone()
    b[1, H:] = 2.0  # the second layer at position 1: half its size apart
    assert worst_difference(a, b, 2) == (1, 1, 0.5)


def test_the_first_sample_is_always_taken_then_a_share_by_id() -> None:
    samples = [SimpleNamespace(dataset="B1", id=f"s{i}") for i in range(2000)]
    none, some, every = recapture(0.0), recapture(0.05), recapture(1.0)
    assert [none.wanted(s) for s in samples[:3]] == [True, False, False]
    taken = sum(some.wanted(s) for s in samples)
    assert 60 <= taken <= 140  # ~5% of 2,000, the first among them
    assert all(every.wanted(s) for s in samples)
    again = recapture(0.05)
    again.wanted(samples[0])
    # seeded by the id: the same samples in every process
    assert [again.wanted(s) for s in samples[1:]] == [some.wanted(s) for s in samples[1:]]
