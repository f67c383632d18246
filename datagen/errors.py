"""Errors of the pipeline.

    DatagenError
    ├── RetryableError        the same call may succeed later
    │   ├── ServerUnavailable     connection refused/reset, 5xx, 503 queue full, timeout
    │   │   └── CaptureFailed         the server answered, its states file did not come
    │   │                             whole (capture_states): the sample is run again
    │   ├── LedgerUnavailable     Redis down or restarting
    │   ├── StreamUnavailable     a put into SpecForge's data plane failed (the shard is retried)
    │   │   └── ConsumerStopped       the SpecForge consumer a stream waits on ended or failed
    │   └── EngineLost            a gpu worker's model engine stopped (the shard is retried)
    └── PermanentError        retrying cannot help: dead-letter with the reason
        ├── BadRequest            SGLang answered 400 (over-long input, bad parameter)
        ├── BadInput              a prompt record that cannot be used
        ├── StorageError          the output folder cannot be written
        ├── StatesNotShared       the capture server writes its states where this worker
        │                         does not see them (another folder): every sample would fail
        └── ConsumerFailed        the SpecForge consumer a stream feeds failed, or never came
                                  up: nothing published now would be trained on
"""


class DatagenError(Exception):
    """Root of every error this project raises on purpose."""


class RetryableError(DatagenError):
    pass


class ServerUnavailable(RetryableError):
    pass


class CaptureFailed(ServerUnavailable):
    pass


class LedgerUnavailable(RetryableError):
    pass


class StreamUnavailable(RetryableError):
    pass


class ConsumerStopped(StreamUnavailable):
    pass


class EngineLost(RetryableError):
    pass


class PermanentError(DatagenError):
    pass


class BadRequest(PermanentError):
    pass


class BadInput(PermanentError):
    pass


class StorageError(PermanentError):
    pass


class StatesNotShared(PermanentError):
    pass


class ConsumerFailed(PermanentError):
    pass
