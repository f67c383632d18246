"""Phase 2, extraction: the target model's hidden states for every sample of the training set.

    ledger.py      where each shard stands in Redis (done, leased, dead); no torch
    estimate.py    disk bytes and GPU hours of a run, the disk check; no torch
    runner.py      one shard start to end: check, run, dead-letter, mark done (the task's core)
    extractor.py   a shard's samples -> length-sorted batches -> packed rows -> files
    backends/      the model side: load, aux-layer capture, forward of one packed row
    pipeline.py    overlap of forward, device->host copy and file writes
    files.py       shard input, sample validation, file layout and atomic writes
    manifest.py    per shard, the samples whose file is complete

The shards themselves come from ``datagen prepare`` (datagen/training_set.py). Only
extractor.py, backends/, pipeline.py and files.py import torch; importing this package does not.
"""
