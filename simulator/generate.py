"""POST /generate: faults first, then validation, queueing, and the answer (whole or streamed)."""

import json
import logging
import time
from http import HTTPStatus
from typing import Protocol

from simulator.app import App
from simulator.engine import SimRequest, stream_points
from simulator.errors import ApiError
from simulator.fault import Fault
from simulator.protocol import GenerateCall, build_request, parse_generate, result_body

logger = logging.getLogger(__name__)

DATASET_HEADER = "X-Datagen-Dataset"
DONE_EVENT = b"data: [DONE]\n\n"


class Responder(Protocol):
    """What the HTTP handler offers this module; keeps socket details out of it."""

    headers: object

    def send_json(self, status: int, payload: object) -> None: ...
    def send_partial_then_reset(self, status: int, payload: object) -> None: ...
    def reset_connection(self) -> None: ...
    def start_stream(self) -> None: ...
    def write_chunk(self, data: bytes) -> None: ...
    def end_stream(self) -> None: ...


class _ResetNow(Exception):
    """Raised inside a stream once a `reset` fault should cut it."""


def handle_generate(out: Responder, app: App, raw: bytes) -> None:
    dataset = out.headers.get(DATASET_HEADER)
    try:
        payload = json.loads(raw or b"null")
    except ValueError as exc:
        reject(out, app, ApiError(HTTPStatus.BAD_REQUEST, f"Invalid JSON body: {exc}"), None,
                dataset)
        return
    rid_hint = payload.get("rid") if isinstance(payload, dict) else None
    fault = app.fault.take()
    if fault is not None and suffer_early_fault(out, app, fault, rid_hint, dataset):
        return
    try:
        call = parse_generate(payload, app.config)
        reqs = [build_request(item, app.config, call.stream, dataset) for item in call.items]
        app.engine.submit(reqs)
    except ApiError as err:
        reject(out, app, err, rid_hint, dataset)
        return
    reset_mid = fault is not None and fault.mode == "reset"
    if call.stream:
        _stream(out, app, reqs[0], reset_mid)
    else:
        _respond(out, app, call, reqs, reset_mid)


def suffer_early_fault(out: Responder, app: App, fault: Fault, rid: object,
                        dataset: str | None) -> bool:
    """Answer a down/error500/reset-before fault; False when the request should still run."""
    if fault.mode == "down":
        err = ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "The server is down (simulated fault).")
    elif fault.mode == "error500":
        err = ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "Internal server error (simulated).")
    elif fault.phase == "before":
        _record_reset(app, rid, dataset)
        out.reset_connection()
        return True
    else:
        return False
    reject(out, app, err, rid, dataset)
    return True


def reject(out: Responder, app: App, err: ApiError, rid: object, dataset: str | None) -> None:
    logger.info("rejecting /generate (rid=%s): %s %s", rid, err.status, err.message)
    app.stats.add("requests_rejected")
    app.journal.record("reject", rid if isinstance(rid, str) else None, dataset,
                       status=err.status, message=err.message)
    out.send_json(err.status, err.body())


def _record_reset(app: App, rid: object, dataset: str | None) -> None:
    app.stats.add("requests_reset")
    app.journal.record("reset", rid if isinstance(rid, str) else None, dataset, status=None)


def _respond(out: Responder, app: App, call: GenerateCall, reqs: list[SimRequest],
             reset_mid: bool) -> None:
    bodies = []
    for req in reqs:
        # The engine stops by finishing every request, so this wait always ends.
        req.done.wait()
        latency = req.finished_at - req.created_at
        bodies.append(result_body(req, req.decoded, req.finish_reason, latency))
    payload = bodies if call.is_batch else bodies[0]
    if reset_mid:
        _record_reset(app, reqs[0].rid, reqs[0].dataset)
        out.send_partial_then_reset(HTTPStatus.OK, payload)
    else:
        out.send_json(HTTPStatus.OK, payload)


def _stream(out: Responder, app: App, req: SimRequest, reset_mid: bool) -> None:
    try:
        out.start_stream()
        _pump(out, app, req, reset_mid)
        out.write_chunk(DONE_EVENT)
        out.end_stream()
    except _ResetNow:
        app.engine.abort(req.rid, exact=True)
        _record_reset(app, req.rid, req.dataset)
        out.reset_connection()
    except OSError as exc:
        # SGLang aborts a stream whose client went away; non-stream requests keep running.
        logger.info("stream %s lost its client (%s); aborting it", req.rid, exc)
        app.engine.abort(req.rid, exact=True)
        raise


def _pump(out: Responder, app: App, req: SimRequest, reset_mid: bool) -> None:
    """Send every chunk SGLang would send, up to and including the one with finish_reason."""
    sent = 0
    while True:
        req.progress.wait()
        # Clear before reading: a token made after the read sets the event again.
        req.progress.clear()
        decoded, reason = app.engine.progress_of(req)
        for point in stream_points(sent, decoded, req.stream_interval):
            if reason is not None and point == decoded:
                break  # the final chunk below carries this length
            _emit(out, result_body(req, point, None, time.time() - req.created_at,
                                   streamed=True, first=point == 1), reset_mid)
        sent = decoded
        if reason is not None:
            latency = req.finished_at - req.created_at
            _emit(out, result_body(req, decoded, reason, latency, streamed=True), reset_mid)
            return


def _emit(out: Responder, body: dict, reset_mid: bool) -> None:
    out.write_chunk(b"data: " + json.dumps(body).encode() + b"\n\n")
    if reset_mid:
        raise _ResetNow()
