"""The capacity model: a bounded batch, a FIFO queue, throughput that saturates like a GPU."""

import threading
import time

import requests
from simharness import TIMEOUT, generate, in_background, running_sim, stats, wait_until


def _run_clients(url: str, clients: int, requests_each: int, max_new: int = 10_000) -> list:
    """`clients` threads, each with its own Session, each sending `requests_each` requests."""
    results: list = []
    lock = threading.Lock()

    def client(index: int) -> None:
        with requests.Session() as session:
            for j in range(requests_each):
                resp = generate(url, [index + 1, j + 1], session=session,
                                sampling_params={"max_new_tokens": max_new})
                with lock:
                    results.append(resp)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_running_requests_never_exceed_max_running_requests():
    with running_sim(max_running_requests=4, lengths="fixed:100") as url:
        results = _run_clients(url, clients=12, requests_each=1)
        counters = stats(url)
    assert [r.status_code for r in results] == [200] * 12
    assert all(r.json()["meta_info"]["completion_tokens"] == 100 for r in results)
    assert counters["peak_running"] == 4
    assert counters["requests_finished"] == 12 and counters["tokens_generated"] == 1200


def _tokens_per_s(clients: int, requests_each: int) -> float:
    # Given 8 batch slots and 400-token answers at 0.4-0.8 ms per decode step,
    with running_sim(max_running_requests=8, lengths="fixed:400", time_scale=0.02,
                     prefill_tokens_per_s=1e9) as url:
        started = time.monotonic()
        results = _run_clients(url, clients, requests_each)
        elapsed = time.monotonic() - started
    assert all(r.status_code == 200 for r in results)
    return sum(r.json()["meta_info"]["completion_tokens"] for r in results) / elapsed


def test_throughput_rises_with_the_batch_then_flattens():
    # When 2, 8 and 16 clients send the same 16 requests,
    small = _tokens_per_s(clients=2, requests_each=8)
    full = _tokens_per_s(clients=8, requests_each=2)
    over = _tokens_per_s(clients=16, requests_each=1)
    # Then a full batch beats a small one, and doubling the clients past the batch adds nothing.
    assert small < 0.6 * full
    assert abs(over - full) / full < 0.2


def test_queue_full_is_503():
    with running_sim(max_running_requests=2, max_queued_requests=1,
                     lengths="fixed:5000", time_scale=0.05) as url:
        calls = [in_background(generate, url, [i + 1]) for i in range(3)]
        wait_until(lambda: stats(url)["waiting"] == 1)
        refused = generate(url, [99])
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        for thread, out in calls:
            thread.join(10)
            assert out["result"].status_code == 200
    assert refused.status_code == 503
    assert refused.json() == {"error": {"message": "The request queue is full."}}


def test_four_hundred_concurrent_requests_are_held_and_answered():
    clients = 400
    codes: list[int] = []

    def client(index: int) -> None:
        with requests.Session() as session:
            resp = generate(url, [index + 1], session=session,
                            sampling_params={"max_new_tokens": 10_000})
            codes.append(resp.status_code)

    # Given answers long enough that no request ends before all 400 are in flight,
    with running_sim(max_running_requests=32, lengths="fixed:5000", time_scale=0.05) as url:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        # When all of them are queued or running at once,
        wait_until(lambda: stats(url)["requests_started"] == clients, timeout_s=30)
        counters = stats(url)
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        for thread in threads:
            thread.join(30)
    # Then the batch held at 32, the rest waited, and every connection got its answer.
    assert (counters["running"], counters["waiting"]) == (32, clients - 32)
    assert counters["peak_connections"] >= clients and counters["peak_running"] == 32
    assert codes == [200] * clients


def test_peak_in_flight_counts_every_open_request_not_only_the_batch():
    # Given a batch of 2 and answers long enough that none ends before all 6 have arrived,
    with running_sim(max_running_requests=2, lengths="fixed:5000", time_scale=0.05) as url:
        calls = [in_background(generate, url, [i + 1]) for i in range(6)]
        # When 6 clients have a request open at once,
        wait_until(lambda: stats(url)["requests_started"] == 6)
        counters = stats(url)
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        for thread, _ in calls:
            thread.join(10)
        # ... and then one client sends requests one after the other, each on a new connection,
        requests.post(f"{url}/_sim/reset", timeout=TIMEOUT)
        for i in range(5):
            assert generate(url, [100 + i], sampling_params={"max_new_tokens": 4}).ok
        sequential = stats(url)
    # Then the 4 waiting requests count as open, and a finished request never overlaps the
    # same client's next one (the server drops it before answering).
    assert (counters["peak_in_flight"], counters["peak_running"]) == (6, 2)
    assert sequential["peak_in_flight"] == 1 and sequential["requests_finished"] == 5
