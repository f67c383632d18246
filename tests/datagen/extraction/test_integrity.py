"""The state check (datagen/extraction/integrity.py) on the CPU with a real tiny Llama:
each sample's final states give back the log-probabilities the record carries, and a file
whose states are one position off is never trained: the shard reports it as a failure with
the measured gap, its manifest line never appears, and the tallies say what was checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl

from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.extraction.files import prepare
from datagen.extraction.integrity import StateCheck, StateCheckFailed
from datagen.generation.records import pack_logprobs, unpack_logprobs

VOCAB, HIDDEN, LAYERS = 256, 64, 6
AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from datagen.builders.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("m") / "llama", VOCAB,
                            hidden_size=HIDDEN, num_layers=LAYERS)


def generated(model: Path, prompt: list[int], n: int) -> tuple[list[int], list[float], dict]:
    """Greedy output ids, their log-probabilities and the states of prompt + output[:-1],
    as a capture server would give them (float32, transformers standing in for vLLM)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)[0].tolist()
        ids = out[:-1]
        res = hf(torch.tensor([ids]), output_hidden_states=True)
    output = out[len(prompt):]
    logp = torch.log_softmax(res.logits[0].float(), -1)
    lps = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]
    hs = res.hidden_states
    states = {"input_ids": torch.tensor(ids, dtype=torch.int64),
              "aux_hidden_state": torch.cat([hs[a + 1][0] for a in AUX], -1).contiguous(),
              "hidden_state": hs[-1][0].contiguous()}
    return output, lps, states


def save_captured(path: Path, states: dict) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(states, str(path), {"aux_layer_ids": json.dumps(list(AUX))})


def test_logprobs_pack_into_a_record_compactly_and_back() -> None:
    values = [-0.25, -3.5, -9999.0]
    text = pack_logprobs(values)
    assert unpack_logprobs(text) == values and len(text) == 16
    with pytest.raises(ValueError):
        unpack_logprobs("not base64!")


def captured_shard(model: Path, tmp_path: Path, run: Path) -> Path:
    """A shard of three samples captured under ``run``, the second's states one position
    late (the states of position t stored at t + 1)."""
    recs = []
    for idx, prompt in enumerate([[1, 5, 9], [2, 7, 7, 30, 4], [3, 100]]):
        output, lps, states = generated(model, prompt, 12)
        if idx == 1:
            states["hidden_state"] = torch.roll(states["hidden_state"], 1, 0).contiguous()
        save_captured(run / "states" / f"r{idx}.safetensors", states)
        recs.append({"idx": idx, "id": f"s{idx}", "dataset": "B1", "prompt_ids": prompt,
                     "output_ids": output, "states": f"states/r{idx}.safetensors",
                     "output_logprobs": pack_logprobs(lps)})
    return write_jsonl(tmp_path / "shard.jsonl", recs)


def test_the_captured_backend_checks_each_file_and_dead_letters_an_off_by_one(
        model: Path, tmp_path: Path) -> None:
    # Given: three captured samples with the server's logprobs; the second's states are
    # planted one position late (the states of position t stored at t + 1)
    run = tmp_path / "run"
    shard = captured_shard(model, tmp_path, run)
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                           aux_layer_ids=AUX, dtype="float32", device="cpu", max_length=64,
                           backend="captured", run_dir=str(run), check_atol_nats=1e-3,
                           check_positions_cpu=5)

    # When: the shard is extracted
    with Extractor(cfg) as ex:
        result = ex.run_shard(shard)

    # Then: the two true files are written, each checked at 5 positions (the CPU's bound);
    # the planted one is a failure naming its gap, and has no file nor manifest line
    assert result.written == 2
    assert [(f.idx, f.reason.split(":")[0]) for f in result.failures] == [(1, "state check")]
    assert "nats at position" in result.failures[0].reason
    assert not (tmp_path / "hs" / "rows_0-2000" / "data_1.ckpt").exists()
    lines = [json.loads(x) for x in
             next((tmp_path / "hs" / "manifest").glob("*.jsonl")).read_text().splitlines()]
    assert sorted(e["idx"] for e in lines) == [0, 2]
    assert all(e["checked"] == 5 and e["gap"] < 1e-3 for e in lines)
    tally = result.check.as_dict()
    assert tally["checked"] == 3 and tally["failed"] == 1 and tally["positions"] == 15
    assert tally["worst_gap"] > 1e-3


def test_the_hf_backend_checks_its_own_states_against_the_record(model: Path,
                                                                  tmp_path: Path) -> None:
    # Given: a record with its logprobs, and one whose logprobs were another sample's
    output, lps, _ = generated(model, [1, 5, 9], 10)
    other, other_lps, _ = generated(model, [4, 4, 4], 10)
    recs = [{"idx": 0, "id": "a", "dataset": "B1", "prompt_ids": [1, 5, 9],
             "output_ids": output, "output_logprobs": pack_logprobs(lps)},
            {"idx": 1, "id": "b", "dataset": "B1", "prompt_ids": [1, 5, 9],
             "output_ids": output, "output_logprobs": pack_logprobs(other_lps)},
            {"idx": 2, "id": "c", "dataset": "B1", "prompt_ids": [4, 4, 4],
             "output_ids": other}]  # no logprobs: written, not checked
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                           aux_layer_ids=AUX, dtype="float32", device="cpu", max_length=64,
                           check_atol_nats=1e-3, check_positions_cpu=0)

    with Extractor(cfg) as ex:
        result = ex.run_shard(shard)

    assert result.written == 2 and [f.idx for f in result.failures] == [1]
    assert result.check.as_dict()["checked"] == 2 and result.check.unchecked == 1
    assert result.check.positions == 20  # every position (check_positions_cpu 0)


def test_a_cpu_checks_a_fixed_bounded_subset_of_positions(model: Path) -> None:
    output, lps, states = generated(model, [1, 5, 9], 20)
    rec = {"idx": 0, "id": "s", "dataset": "B1", "prompt_ids": [1, 5, 9],
           "output_ids": output, "states": "x", "output_logprobs": pack_logprobs(lps)}
    sample = prepare(1, rec, 64, "truncate", VOCAB, captured=True)
    cpu = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 4)
    first = cpu.rows(sample, sample.length)
    assert len(first) == 4 and first == cpu.rows(sample, sample.length)  # seeded by the id
    assert cpu.check(sample, states["hidden_state"]).positions == 4
    # the last output id (not an input of the captured row) is checked too
    every = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 0)
    assert [r[1] for r in every.rows(sample, sample.length)] == output


def one_sample(model: Path, prompt: list[int], n: int) -> tuple[object, dict]:
    """A captured sample (files.Sample) with its server logprobs, and its true states."""
    output, lps, states = generated(model, prompt, n)
    rec = {"idx": 0, "id": "s", "dataset": "B1", "prompt_ids": prompt, "output_ids": output,
           "states": "x", "output_logprobs": pack_logprobs(lps)}
    return prepare(1, rec, 64, "truncate", VOCAB, captured=True), states


def test_a_nan_anywhere_in_the_states_fails_the_sample(model: Path) -> None:
    # Given: a sample's true states, and copies with one NaN planted: in a final state the
    # check measures, in a prompt position's aux state (never measured), an inf in aux
    sample, states = one_sample(model, [1, 5, 9, 11], 12)
    check = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 0)
    aux, final = states["aux_hidden_state"], states["hidden_state"]
    assert check.check(sample, final, aux).positions == 12  # the true ones pass

    def planted(tensor: torch.Tensor, position: int, value: float) -> torch.Tensor:
        out = tensor.clone()
        out[position, 7] = value
        return out

    cases = [("hidden_state", aux, planted(final, 5, float("nan")), 5),
             ("aux_hidden_state", planted(aux, 1, float("nan")), final, 1),
             ("aux_hidden_state", planted(aux, 9, float("inf")), final, 9)]
    for name, a, f, position in cases:
        # When / Then: each fails, naming the tensor and the first bad position
        with pytest.raises(StateCheckFailed) as failed:
            check.check(sample, f, a)
        assert f"{name} holds 1 values that are not finite" in str(failed.value)
        assert failed.value.result.nonfinite == 1
        assert failed.value.result.position == position


def test_wrong_states_with_one_nan_and_unwritten_bits_fail(model: Path) -> None:
    # Given: states all one position late plus a NaN (the NaN made the gap NaN, and NaN > 0
    # is false), and bf16 buffers never written (random bits: what torch.empty may hold)
    sample, states = one_sample(model, [1, 5, 9, 11], 12)
    check = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 0)
    shifted = torch.roll(states["hidden_state"], 1, 0)
    shifted[6, 0] = float("nan")
    g = torch.Generator().manual_seed(0)
    unwritten = torch.randint(-2 ** 15, 2 ** 15, states["hidden_state"].shape, generator=g,
                              dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    # When / Then: neither passes
    for final in (shifted, unwritten):
        with pytest.raises(StateCheckFailed):
            check.check(sample, final, states["aux_hidden_state"])
    # and finite random bits (no NaN or inf among them): failed too
    finite = torch.where(torch.isfinite(unwritten), unwritten, torch.zeros_like(unwritten))
    with pytest.raises(StateCheckFailed):
        check.check(sample, finite)
    # states so large that their logits overflow fail as such, not as a NaN gap
    ones = StateCheck(torch.ones(VOCAB, HIDDEN), torch.device("cpu"), 1e-3, 0)
    with pytest.raises(StateCheckFailed, match="logits that are not finite at 12 of 12"):
        ones.check(sample, torch.full_like(states["hidden_state"], 3e38))


def test_a_nan_in_a_captured_file_is_dead_lettered_even_with_check_states_off(
        model: Path, tmp_path: Path) -> None:
    # Given: two captured samples; the second's aux states hold a NaN at a prompt position
    run = tmp_path / "run"
    recs = []
    for idx, prompt in enumerate([[1, 5, 9], [2, 7, 7, 30, 4]]):
        output, lps, states = generated(model, prompt, 8)
        if idx == 1:
            states["aux_hidden_state"][2, 3] = float("nan")
        save_captured(run / "states" / f"r{idx}.safetensors", states)
        recs.append({"idx": idx, "id": f"s{idx}", "dataset": "B1", "prompt_ids": prompt,
                     "output_ids": output, "states": f"states/r{idx}.safetensors",
                     "output_logprobs": pack_logprobs(lps)})
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)
    for check_states in (True, False):
        out = tmp_path / f"hs-{check_states}"
        cfg = ExtractionConfig(model_path=str(model), output_dir=str(out),
                               aux_layer_ids=AUX, dtype="float32", device="cpu",
                               max_length=64, backend="captured", run_dir=str(run),
                               check_atol_nats=1e-3, check_states=check_states,
                               keep_captured_states=True)

        # When: the shard is extracted
        with Extractor(cfg) as ex:
            result = ex.run_shard(shard)

        # Then: the NaN sample is a state-check failure counted as failed, never written
        assert result.written == 1
        assert [f.idx for f in result.failures] == [1]
        assert "aux_hidden_state holds 1 values that are not finite" in result.failures[0].reason
        assert result.failures[0].check.nonfinite == 1
        assert result.check.failed == 1
        assert not list(out.rglob("data_1.ckpt"))


def test_chunked_logits_measure_what_all_at_once_does(model: Path) -> None:
    # the logits of 5 positions at a time, or of all 20 at once: the same gaps, the same
    # worst position, for true states and for states one position late
    sample, states = one_sample(model, [1, 5, 9], 20)
    final = states["hidden_state"]
    checks = [StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 0)
              for _ in range(2)]
    checks[0].chunk_positions, checks[1].chunk_positions = 5, 0
    assert checks[0].chunk(VOCAB) == 5 and StateCheck(torch.ones(1), torch.device("cpu"),
                                                      0.0, 0).chunk(163840) == 409
    for states_given in (final, torch.roll(final, 1, 0)):
        chunked, whole = (c.measure(sample, states_given) for c in checks)
        assert chunked.positions == whole.positions == 20
        assert chunked.position == whole.position
        assert chunked.gap == pytest.approx(whole.gap, abs=1e-6)
        assert chunked.excess == pytest.approx(whole.excess, abs=1e-6)


def prompt_logprobs(model: Path, prompt: list[int]) -> list[float]:
    """Prompt id j + 1's log-probability given the ids before it, as vLLM's prompt_logprobs
    answer it (transformers standing in for vLLM)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    return [float(logp[j, prompt[j + 1]]) for j in range(len(prompt) - 1)]


def test_garbage_in_the_prompt_positions_fails_only_with_the_prompts_logprobs(
        model: Path) -> None:
    # Given: a captured sample whose prompt positions' final states are garbage (a prefill
    # chunk gone wrong: finite, other states), the output positions' true; once with the
    # record's prompt_logprobs (check_prompt_states), once without
    prompt = [1, 5, 9, 11, 40, 41, 42, 43]
    output, lps, states = generated(model, prompt, 6)
    rec = {"idx": 0, "id": "s", "dataset": "B1", "prompt_ids": prompt, "output_ids": output,
           "states": "x", "output_logprobs": pack_logprobs(lps)}
    without = prepare(1, rec, 64, "truncate", VOCAB, captured=True)
    with_prompt = prepare(1, {**rec, "prompt_logprobs": pack_logprobs(
        prompt_logprobs(model, prompt))}, 64, "truncate", VOCAB, captured=True)
    check = StateCheck.for_model(str(model), torch.device("cpu"), 1e-3, 0)
    final = states["hidden_state"]
    assert check.check(with_prompt, final).positions == 7 + 6  # the true states pass
    garbage = final.clone()
    garbage[1:len(prompt) - 1] = torch.flip(final[1:len(prompt) - 1], (0,)) * 3

    # When / Then: without the prompt's log-probabilities it passes (only output positions)
    assert check.check(without, garbage).positions == 6
    # and with them it fails at a prompt position
    with pytest.raises(StateCheckFailed) as failed:
        check.check(with_prompt, garbage)
    assert 1 <= failed.value.result.position < len(prompt) - 1
    assert failed.value.result.positions == 13


def test_a_record_whose_prompt_logprobs_do_not_follow_its_prompt_is_rejected() -> None:
    rec = {"idx": 0, "id": "s", "dataset": "B1", "prompt_ids": [1, 2, 3], "output_ids": [4, 5, 6],
           "prompt_logprobs": pack_logprobs([-1.0])}  # two prompt ids after the first
    rejected = prepare(1, rec, 64, "truncate", VOCAB)
    assert "prompt_logprobs is not one float32 per prompt id" in rejected.reason
    assert prepare(1, {**rec, "prompt_logprobs": pack_logprobs([-1.0, -2.0])}, 64,
                   "truncate", VOCAB).prompt_logprobs == (-1.0, -2.0)
