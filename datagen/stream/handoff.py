"""The handoff a streaming consumer needs before any state exists: the draft vocabulary's
counts from the training set's ids, not from the extraction's files.

The file build counts each shard's ids while it extracts (extractor._write_counts) and the
handoff is written after. A stream's consumer must start first (the sink waits for its
quantum before the first put), so `datagen stream` counts the same ids from the prepared
shards (files.prepare, files.counted_ids: exactly what the extraction keeps and counts) into
the same per-shard count files, then writes vocab_mapping.pt, the draft config and the run
config as `datagen handoff` does. An extraction run later writes the same counts again."""

from __future__ import annotations

from pathlib import Path

from config.settings import Settings
from datagen.errors import BadInput
from datagen.extraction.backends.base import text_config
from datagen.extraction.estimate import default_aux_layer_ids
from datagen.extraction.files import Rejected, counted_ids, prepare, read_shard, relative_path
from datagen.extraction.ledger import shard_states
from datagen.extraction.manifest import shard_name
from datagen.training import handoff, training_set
from datagen.training import vocab_mapping as vm


def count_training_set(settings: Settings) -> tuple[list[str], int]:
    """Write each prepared shard's token counts; (shard names, samples counted)."""
    manifest = training_set.read_manifest(training_set.training_dir(settings.output_dir))
    if not settings.model_path:
        raise BadInput("model_path is not set: the draft vocabulary and config need the "
                       "target's config.json (DATAGEN_MODEL_PATH, --config)")
    config = text_config(settings.model_path)
    aux = list(settings.aux_layer_ids or default_aux_layer_ids(int(config["num_hidden_layers"])))
    out = training_set.extraction_dir(settings)
    out.mkdir(parents=True, exist_ok=True)
    names, total = [], 0
    for shard in shard_states(manifest):
        path = Path(settings.output_dir) / shard.path
        kept = [s for line, rec in read_shard(path)
                if not isinstance(s := prepare(line, rec, settings.train_max_length,
                                               settings.extract_overlong,
                                               int(config["vocab_size"]),
                                               captured=settings.extract_backend == "captured"),
                                  Rejected)]
        counts = vm.count_samples((relative_path(s.idx), *counted_ids(s)) for s in kept)
        name = shard_name(shard.path)
        vm.write_shard_counts(out, name, counts, {
            "shard": str(shard.path), "samples": len(kept), "aux_layer_ids": aux,
            "hidden_size": int(config["hidden_size"]), "max_length": settings.train_max_length,
            "overlong": settings.extract_overlong, "dtype": settings.extract_dtype})
        names.append(name)
        total += len(kept)
    return names, total


def write_stream_handoff(settings: Settings) -> tuple[handoff.Handoff, int]:
    """vocab_mapping.pt, draft_config.json and the run config from the training set's ids;
    with the samples an epoch streams (the consumer's horizon)."""
    names, samples = count_training_set(settings)
    made = handoff.write_handoff(training_set.extraction_dir(settings), names,
                                 settings.model_path, settings.draft_vocab_size,
                                 settings.train_max_length, settings.trust_remote_code)
    return made, samples
