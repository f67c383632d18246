"""The training handoff: from the records to what SpecForge trains on.

    training_set.py   merge, dedup, shuffle and shard the records (``datagen prepare``)
    handoff.py        the files beside the extracted states; the printed ``specforge train``
    vocab_mapping.py  SpecForge's d2t/t2d rule over the token counts the gpu workers gathered
    draft_config.py   the EAGLE-3 draft config sized from the target's config.json
"""
