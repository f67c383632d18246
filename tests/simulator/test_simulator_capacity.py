"""The capacity model: a bounded batch, a FIFO queue, throughput that saturates like a GPU."""

import threading

import requests
from simharness import (
    TIMEOUT,
    generate,
    in_background,
    running_sim,
    stall,
    stats,
    unstall,
    wait_until,
)


def test_running_requests_never_exceed_max_running_requests():
    # Given a batch of 4, when 12 requests arrive at once (one batch /generate, so that how
    # fast clients send cannot decide how many overlap),
    with running_sim(max_running_requests=4, lengths="fixed:100") as url:
        resp = generate(url, [[i + 1] for i in range(12)],
                        sampling_params={"max_new_tokens": 10_000})
        counters = stats(url)
    # Then all are answered, and never more than 4 ran at once.
    assert resp.status_code == 200
    assert [r["meta_info"]["completion_tokens"] for r in resp.json()] == [100] * 12
    assert counters["peak_running"] == 4
    assert counters["requests_finished"] == 12 and counters["tokens_generated"] == 1200


def _tokens_per_s(batch: int, calls: int) -> float:
    """Tokens per simulated second when `calls` batches of `batch` requests are sent in turn.

    Each call hands the server all its requests at once (a batch /generate), so they start and
    finish together, and the engine is idle between calls; throughput is read off the
    engine's own clock (decode_s), so neither a starved client nor a late-waking engine
    thread on a loaded machine changes the figure.
    """
    # Given 8 batch slots and 400-token answers at 0.4-0.8 ms per decode step,
    with running_sim(max_running_requests=8, lengths="fixed:400", time_scale=0.02,
                     prefill_tokens_per_s=1e9) as url:
        for call in range(calls):
            ids = [[call + 1, j + 1] for j in range(batch)]
            resp = generate(url, ids, sampling_params={"max_new_tokens": 10_000})
            assert resp.status_code == 200
            assert [r["meta_info"]["completion_tokens"] for r in resp.json()] == [400] * batch
        counters = stats(url)
    assert counters["tokens_generated"] == 400 * batch * calls
    return counters["tokens_generated"] / counters["decode_s"]


def test_throughput_rises_with_the_batch_then_flattens():
    # When the same 16 requests come 2, 8 and 16 at a time,
    small = _tokens_per_s(batch=2, calls=8)
    full = _tokens_per_s(batch=8, calls=2)
    over = _tokens_per_s(batch=16, calls=1)
    # Then a full batch beats a small one (2 / 1.25 steps against 8 / 2 per unit step), and
    # sending more than the batch holds at once adds nothing.
    assert small < 0.6 * full
    assert abs(over - full) / full < 0.05


def test_queue_full_is_503():
    with running_sim(max_running_requests=2, max_queued_requests=1,
                     lengths="fixed:5000", time_scale=0.05) as url:
        stall(url)  # none of the three ends before the fourth arrives
        calls = [in_background(generate, url, [i + 1]) for i in range(3)]
        wait_until(lambda: stats(url)["waiting"] == 1)
        refused = generate(url, [99])
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        for thread, out in calls:
            thread.join(120)
            assert out["result"].status_code == 200
    assert refused.status_code == 503
    assert refused.json() == {"error": {"message": "The request queue is full."}}


def test_four_hundred_concurrent_requests_are_held_and_answered():
    clients = 400
    codes: list[int] = []

    def client(index: int) -> None:
        with requests.Session() as session:
            # Held until every request is in: far longer than TIMEOUT on a loaded machine.
            resp = session.post(f"{url}/generate", timeout=(300, 600), json={
                "input_ids": [index + 1], "sampling_params": {"max_new_tokens": 10_000}})
            codes.append(resp.status_code)

    # Given a server whose decode steps are stalled (a step lasts hours), so no request ends
    # before all 400 are in flight however long the clients take to send them,
    with running_sim(max_running_requests=32, lengths="fixed:5000", time_scale=0.05) as url:
        stall(url)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        # When all of them are queued or running at once,
        wait_until(lambda: stats(url)["requests_started"] == clients, timeout_s=300)
        counters = stats(url)
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        for thread in threads:
            thread.join(300)
    # Then the batch held at 32, the rest waited, and every connection got its answer.
    assert (counters["running"], counters["waiting"]) == (32, clients - 32)
    assert counters["peak_connections"] >= clients and counters["peak_running"] == 32
    assert codes == [200] * clients


def test_peak_in_flight_counts_every_open_request_not_only_the_batch():
    # Given a batch of 2 and a stalled decode, so that none ends before all 6 have arrived,
    with running_sim(max_running_requests=2, lengths="fixed:5000", time_scale=0.05) as url:
        stall(url)
        calls = [in_background(generate, url, [i + 1]) for i in range(6)]
        # When 6 clients have a request open at once,
        wait_until(lambda: stats(url)["requests_started"] == 6)
        counters = stats(url)
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        for thread, _ in calls:
            thread.join(120)
        # ... and then one client sends requests one after the other, each on a new connection,
        unstall(url)
        requests.post(f"{url}/_sim/reset", timeout=TIMEOUT)
        for i in range(5):
            assert generate(url, [100 + i], sampling_params={"max_new_tokens": 4}).ok
        sequential = stats(url)
    # Then the 4 waiting requests count as open, and a finished request never overlaps the
    # same client's next one (the server drops it before answering).
    assert (counters["peak_in_flight"], counters["peak_running"]) == (6, 2)
    assert sequential["peak_in_flight"] == 1 and sequential["requests_finished"] == 5
