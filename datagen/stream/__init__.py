"""States streamed into SpecForge's data plane instead of written as .ckpt files (issue 45).

    ledger.py    per epoch in Redis: room reserved, published, acknowledged; resident bytes
    sink.py      where the extractor hands a sample's tensors when states_to = "stream"
"""
