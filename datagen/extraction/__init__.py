"""Phase 2, extraction: the target model's hidden states for every sample of the training set.

    ledger.py      where each shard stands in Redis (done, leased, taken, dead); no torch
    estimate.py    disk bytes and GPU hours of a run, the disk check; no torch
    runner.py      one shard start to end (the task's core); the reaper of dead runs
    extractor.py   a shard's samples -> batches -> rows -> backend -> staging -> files
    batching.py    length-sorted batches, packed rows
    backends/      the model side behind base.Backend: hf, hf_tp, sglang
    replica.py     a replica over N ranks: the launcher, rank 0's Leader, the other ranks
    pipeline.py    overlap of forward, device->host copy and file writes
    files.py       shard input, sample validation, file layout and atomic writes
    manifest.py    per shard, the samples whose file is complete; extraction.json

The shards themselves come from ``datagen prepare`` (datagen/training/training_set.py). Only
extractor.py, backends/, pipeline.py and files.py import torch (replica.py only in functions);
importing this package does not.
"""
