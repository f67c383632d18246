"""How close to its budget any admission rule can stop a dataset: a discrete-event model.

The precise rule of ``admit.lua`` with perfect information (each request's progress known
exactly, E[L | L > p] from the true length distribution), so what is left of the overshoot
is the lengths' own randomness, not the estimates. Lengths lognormal (mean 3,700, σ=1)
capped at 10,240, one request decodes 1,000 tokens/s. Reports per case: mean and max
overshoot, the share of datasets within the goal (max(0.5% of the budget, one mean
response of 3,700)), and the time from 95% of the budget to the close. Also the floor of
any rule that counts whole responses and never stops a dataset short: admitting one request
at a time at the end, the overshoot is the renewal excess, E[L²] / (2 E[L]). And, for small
budgets, the precise rule against one request at a time.

    .venv/bin/python bench/sim_budget_floor.py            # ~1 min
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import random
from dataclasses import dataclass

CAP, MEAN, SIGMA = 10240, 3700.0, 1.0
RATE = 1000.0  # tokens/s of one request
MU = math.log(MEAN) - SIGMA * SIGMA / 2


class Lengths:
    """The true conditional moments E[L | L > p], Var[L | L > p] from a large sample."""

    def __init__(self, n: int = 200_000, seed: int = 7):
        rng = random.Random(seed)
        self.pool = sorted(min(CAP, rng.lognormvariate(MU, SIGMA)) for _ in range(n))
        self.s1 = [0.0] * (n + 1)
        self.s2 = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            self.s1[i] = self.s1[i + 1] + self.pool[i]
            self.s2[i] = self.s2[i + 1] + self.pool[i] ** 2
        self.mean, self.var = self.cond(-1.0)

    def cond(self, p: float) -> tuple[float, float]:
        i = bisect.bisect_right(self.pool, p)
        if i >= len(self.pool):
            return float(CAP), 0.0
        k = len(self.pool) - i
        m = self.s1[i] / k
        return m, max(0.0, self.s2[i] / k - m * m)

    def renewal_excess(self, above: float) -> tuple[float, float]:
        """E[excess] and P(excess > above) of a renewal process crossing a level."""
        m = self.s1[0] / len(self.pool)
        second = self.s2[0] / len(self.pool)
        tail = sum(max(0.0, x - above) for x in self.pool) / len(self.pool)
        return second / (2 * m), tail / m


@dataclass
class Result:
    overshoot: int
    from_95_s: float
    wasted: float


def run(lengths: Lengths, budget: int, threads: int, margin_sd: float, seed: int,
        abort: bool = False) -> Result:
    rng = random.Random(seed)
    now, committed, next_id = 0.0, 0, 0
    in_flight: dict[int, tuple[float, int]] = {}
    ends: list[tuple[float, int]] = []
    t95 = None

    def admit() -> None:
        nonlocal next_id
        while len(in_flight) < threads and committed < budget:
            if in_flight:  # nothing in flight: always admit (never stop short)
                expected, var = 0.0, lengths.var
                for start, _ in in_flight.values():
                    m, v = lengths.cond((now - start) * RATE)
                    expected += m
                    var += v
                if committed + expected + lengths.mean + margin_sd * math.sqrt(var) > budget:
                    return
            length = int(min(CAP, rng.lognormvariate(MU, SIGMA)))
            in_flight[next_id] = (now, length)
            heapq.heappush(ends, (now + length / RATE, next_id))
            next_id += 1

    admit()
    close = None
    while ends:
        now, rid = heapq.heappop(ends)
        committed += in_flight.pop(rid)[1]
        if t95 is None and committed >= 0.95 * budget:
            t95 = now
        if committed >= budget and close is None:
            close = now
            if abort:  # abort_on_close: what is in flight is discarded
                wasted = sum(min(n, (now - s) * RATE) for s, n in in_flight.values())
                return Result(committed - budget, close - (t95 or close), wasted)
        admit()
    return Result(committed - budget, (close or now) - (t95 or now), 0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds-small", type=int, default=300)
    p.add_argument("--rounds-large", type=int, default=40)
    args = p.parse_args()
    lengths = Lengths()
    print("| budget | requests in flight | rule | mean overshoot | max | within goal "
          "| 95% → close (median) |")
    print("|---|---|---|---|---|---|---|")
    cases = [(300_000, 37, args.rounds_small), (2_000_000, 150, args.rounds_large)]
    for budget, threads, rounds in cases:
        goal = max(0.005 * budget, MEAN)
        rules = [(f"precise, k = {k}", k, False) for k in (1.0, 1.5, 2.0, 3.0)]
        rules.append(("precise, k = 1, abort_on_close", 1.0, True))
        for name, k, abort in rules:
            res = [run(lengths, budget, threads, k, s, abort) for s in range(rounds)]
            over = sorted(r.overshoot for r in res)
            close = sorted(r.from_95_s for r in res)
            print(f"| {budget:,} | {threads} | {name} | {100 * sum(over) / rounds / budget:.2f}% "
                  f"| {100 * over[-1] / budget:.2f}% "
                  f"| {sum(o <= goal for o in over) / rounds:.0%} | {close[rounds // 2]:.1f} s |")
    print("\n| budget | rule | mean overshoot | within goal |")
    print("|---|---|---|---|")
    for budget in (15_000, 40_000, 100_000):
        goal = max(0.005 * budget, MEAN)
        for name, k in (("precise, k = 1", 1.0), ("one request at a time", 1e9)):
            over = [run(lengths, budget, 150, k, s).overshoot for s in range(args.rounds_small)]
            print(f"| {budget:,} | {name} | {sum(over) / len(over):,.0f} "
                  f"| {sum(o <= goal for o in over) / len(over):.0%} |")
    excess, beyond = lengths.renewal_excess(MEAN)
    print(f"\nOne request at a time at the end (the floor): E[overshoot] = {excess:,.0f} tokens; "
          f"P(overshoot > {MEAN:,.0f}) = {beyond:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
