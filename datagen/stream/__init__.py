"""Issue 45: states straight into SpecForge's consumer through its own data plane.

    plane.py       mooncake_master + a standalone segment holder on loopback; plane.json
    publisher.py   one sample's states into the feature store, its ref on the channel
    consumer.py    the stock SpecForge consumer's run config and command line
"""
