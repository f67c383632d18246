"""The handoff folder against SpecForge's own rules, computed from the files themselves:
records -> `prepare` (online rows, length report) -> extraction of every shard on a tiny
random Llama (CPU) -> vocab_mapping.pt, draft_config.json and the run config."""

from __future__ import annotations

import json
import random
import shlex
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl
from sglang_fixture import in_ci
from specforge_a6b6b02 import (
    SCHEMA_FIELDS,
    TRAIN_FLAGS,
    reference_counts,
    reference_mappings,
)

from config.settings import Settings
from datagen.builders.tiny_model import INDEX_NAME, build_tiny_llama
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.extraction.manifest import load_done, shard_name
from datagen.training import handoff
from datagen.training import vocab_mapping as vm
from datagen.training.training_set import extraction_dir, prepare, read_manifest, training_dir

VOCAB = 300
HIDDEN = 32
LAYERS = 8     # aux ids [1, 3, 4]
MAX_LENGTH = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model"), VOCAB, hidden_size=HIDDEN,
                            num_layers=LAYERS)


def skewed_ids(rng: random.Random, n: int) -> list[int]:
    # a few frequent ids and a long tail: the draft vocabulary's cut falls among ties
    return [rng.choice((3, 4, 5, 6)) if rng.random() < 0.4 else rng.randrange(VOCAB)
            for _ in range(n)]


def write_records(out: Path, dataset: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        prompt, output = skewed_ids(rng, rng.randint(1, 45)), skewed_ids(rng, rng.randint(1, 40))
        recs.append({"v": 1, "id": f"{dataset}-{i}", "dataset": dataset, "rid": f"r{i}",
                     "messages": [{"role": "user", "content": "q"}], "prompt_ids": prompt,
                     "output_ids": output, "finish_reason": "stop",
                     "prompt_tokens": len(prompt), "completion_tokens": len(output),
                     "truncated": False, "time": 1000.0 + i})
    write_jsonl(out / "records" / dataset / "h-1.jsonl", recs)


@pytest.fixture(scope="module")
def extracted(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A prepared and fully extracted training set; one shard is run a second time with its
    counts file gone (everything done before), as a resumed shard is."""
    out = tmp_path_factory.mktemp("run")
    write_records(out, "A1", 23, seed=1)
    write_records(out, "B1", 19, seed=2)
    settings = Settings(output_dir=str(out), shard_samples=8, train_max_length=MAX_LENGTH,
                        model_path=str(model_dir))
    tset = prepare(settings, {}, None)
    folder = extraction_dir(settings)
    cfg = ExtractionConfig(model_path=str(model_dir), output_dir=str(folder), dtype="float32",
                           device="cpu", max_length=MAX_LENGTH, batch_tokens=512,
                           writer_threads=2, max_pending_writes=4)
    names = [shard_name(s["path"]) for s in tset.shards]
    with Extractor(cfg) as ex:
        for shard in tset.shards:
            ex.run_shard(out / shard["path"])
        (folder / vm.COUNTS_DIR / f"{names[0]}.json").unlink()
        assert ex.run_shard(out / tset.shards[0]["path"]).skipped_done > 0
    return settings, tset, folder, names


def test_vocab_mapping_equals_specforge_computed_from_the_files(extracted, model_dir):
    settings, _, folder, names = extracted
    made = handoff.write_handoff(folder, names, str(model_dir), 50, MAX_LENGTH)
    mapping = torch.load(made.vocab_mapping, weights_only=True)
    ref_d2t, ref_t2d = reference_mappings(reference_counts(str(folder), MAX_LENGTH), 50, VOCAB)
    assert mapping["d2t"].dtype == torch.int64 and mapping["t2d"].dtype == torch.bool
    assert mapping["d2t"].tolist() == ref_d2t.tolist()
    assert mapping["t2d"].tolist() == ref_t2d.tolist()
    assert mapping["d2t"].shape == (50,) and mapping["t2d"].shape == (VOCAB,)
    # the default 32000 is capped at this target's 300-token vocabulary, as SpecForge needs
    whole = handoff.write_handoff(folder, names, str(model_dir), 32000, MAX_LENGTH)
    assert whole.draft_vocab_size == VOCAB
    assert torch.load(whole.vocab_mapping, weights_only=True)["t2d"].all()


def test_draft_and_run_config_name_what_was_extracted(extracted, model_dir):
    settings, _, folder, names = extracted
    made = handoff.write_handoff(folder, names, str(model_dir), 50, MAX_LENGTH)
    draft = json.loads(made.draft_config.read_text())
    target = json.loads((model_dir / "config.json").read_text())
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert (draft["hidden_size"], draft["vocab_size"], draft["draft_vocab_size"]) == (
        target["hidden_size"], VOCAB, 50)
    run = json.loads(made.run_config.read_text())
    for section, body in run.items():
        fields = SCHEMA_FIELDS[section] if isinstance(body, dict) else SCHEMA_FIELDS[""]
        assert (set(body) if isinstance(body, dict) else {section}) <= fields, section
    assert run["data"] == {"hidden_states_path": str(folder.resolve()), "max_length": MAX_LENGTH}
    assert Path(run["model"]["vocab_mapping_path"]) == made.vocab_mapping
    assert Path(run["model"]["target_model_path"], INDEX_NAME).is_file()
    argv = shlex.split(handoff.train_command(made.run_config))
    assert argv[:2] == ["specforge", "train"]
    assert {a for a in argv[2:] if a.startswith("-")} <= TRAIN_FLAGS
    assert Path(argv[argv.index("--config") + 1]) == made.run_config
    text = handoff.describe(made)
    assert str(made.folder) in text and handoff.train_command(made.run_config) in text
    assert handoff.existing(folder) and "specforge train --config" in handoff.existing(folder)


def specforge_readers() -> None:
    """SpecForge's package, which `make install` puts in .venv without its GPU pins
    (requirements/specforge-readers.txt); missing, the test skips, and in CI fails."""
    try:
        import specforge  # noqa: F401
    except ImportError as exc:
        if in_ci():
            pytest.fail(f"CI must read the handoff with SpecForge's own code: {exc}",
                        pytrace=False)
        pytest.skip(f"SpecForge's package is not installed ({exc}): run `make install`")


def test_specforges_own_code_reads_the_handoff(extracted, model_dir):
    """SpecForge's own code (PyPI `specforge` 0.2.0): its schema validates the run config,
    its offline counter gives the counts (and order) the shards gathered, its target-head
    loader loads the tiny model through the index."""
    specforge_readers()
    from specforge.config import schema

    _, _, folder, names = extracted
    made = handoff.write_handoff(folder, names, str(model_dir), 50, MAX_LENGTH)
    cfg = schema.Config.from_file(str(made.run_config))
    assert cfg.mode == "offline" and cfg.data.max_length == MAX_LENGTH

    from specforge.modeling.target.target_head import TargetHead
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    theirs = count_effective_feature_tokens(str(folder), max_length=MAX_LENGTH,
                                            target_vocab_size=VOCAB)
    ours = vm.merge_counts(vm.read_shard_counts(folder / vm.COUNTS_DIR / f"{n}.json")[0]
                           for n in names)
    assert list(theirs.items()) == list(ours.items())
    head = TargetHead.from_pretrained(str(model_dir))
    assert tuple(head.fc.weight.shape) == (VOCAB, HIDDEN)


def test_online_rows_are_the_files_input_ids_and_loss_masks(extracted):
    settings, _, folder, _ = extracted
    rows = [json.loads(x) for x in
            (training_dir(settings.output_dir) / handoff.ONLINE_ROWS_NAME).read_text().splitlines()]
    done = load_done(folder)
    assert len(rows) == len(done) > 0
    for row in rows:
        data = torch.load(folder / done[(row["dataset"], row["id"])], weights_only=True)
        assert row["input_ids"] == data["input_ids"].tolist()
        assert row["loss_mask"] == data["loss_mask"].tolist()


def test_length_rule_report_matches_what_extraction_kept(extracted):
    settings, tset, folder, _ = extracted
    rule = read_manifest(training_dir(settings.output_dir))["length_rule"]
    assert rule["train_max_length"] == MAX_LENGTH
    shards = [json.loads(x) for s in tset.shards
              for x in (Path(settings.output_dir) / s["path"]).read_text().splitlines()]
    done = load_done(folder)
    for ds, counts in rule["datasets"].items():
        mine = [s for s in shards if s["dataset"] == ds]
        kept = [s for s in mine if (ds, s["id"]) in done]
        assert counts["dropped"] == len(mine) - len(kept) > 0
        lengths = {s["id"]: len(s["prompt_ids"]) + len(s["output_ids"]) for s in mine}
        stored = {s["id"]: torch.load(folder / done[(ds, s["id"])], weights_only=True)
                  ["input_ids"].numel() for s in kept}
        assert counts["cut"] == sum(1 for i, n in stored.items() if n < lengths[i]) > 0
        assert counts["cut_tokens"] == sum(lengths[i] - n for i, n in stored.items())
        assert all(n <= MAX_LENGTH for n in stored.values())
    assert "train_max_length drops" in "\n".join(handoff_lines(tset))


def handoff_lines(tset) -> list[str]:
    from datagen.training.training_set import render

    return render(tset).splitlines()


def test_tiny_model_index_lists_every_tensor(model_dir):
    from safetensors import safe_open

    index = json.loads((model_dir / INDEX_NAME).read_text())["weight_map"]
    files = sorted(model_dir.glob("*.safetensors"))
    assert len(files) >= 2  # sharded, as a hub checkpoint is
    stored = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            stored.update({k: f.name for k in fh.keys()})  # noqa: SIM118
    assert index == stored
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(index)
