"""Errors the simulator answers with an HTTP status.

    ApiError              carries the status and the message of SGLang's error body
    ├── DuplicateRid          400, a request with this rid is still in flight
    └── QueueFull             503, --max-queued-requests reached
"""

from http import HTTPStatus


class ApiError(Exception):
    """A request the server refuses; the message goes into `{"error": {"message": ...}}`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message

    def body(self) -> dict:
        return {"error": {"message": self.message}}


class DuplicateRid(ApiError):
    def __init__(self, rid: str) -> None:
        super().__init__(HTTPStatus.BAD_REQUEST, f"Duplicate request ID detected: {rid}")


class QueueFull(ApiError):
    def __init__(self) -> None:
        super().__init__(HTTPStatus.SERVICE_UNAVAILABLE, "The request queue is full.")
