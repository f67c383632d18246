"""States streamed into SpecForge's data plane instead of written as .ckpt files (issue 45).

    plane.py       mooncake_master + a standalone segment holder on loopback; plane.json
    publisher.py   one sample's states into the feature store, its ref on the channel
    consumer.py    the stock SpecForge consumer's run config and command line
    ledger.py      per epoch in Redis: room reserved, published, acknowledged; resident bytes
    sink.py        where the extractor hands a sample's tensors when states_to = "stream"
"""
