"""Server metrics in the Prometheus text format (version 0.0.4), written by hand: a few counters, one gauge, two
histograms. Updated from the event loop and from the decoding thread, hence the lock."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds  # upper bounds, ascending; +Inf is implied
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip([*map(_number, self.bounds), "+Inf"], self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{name}_sum {_number(self.sum)}", f"{name}_count {total}"]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter[int] = Counter()  # by HTTP status code
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.tau = Histogram((1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0))
        self.tpot = Histogram((0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0))

    def request(self, status: int) -> None:
        with self.lock:
            self.requests[status] += 1

    def generation(self, prompt_tokens: int, completion_tokens: int, tau: float | None, tpot: float | None) -> None:
        """One finished generation; tau and the time per output token where it had decode rounds."""
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            if tau is not None:
                self.tau.observe(tau)
            if tpot is not None:
                self.tpot.observe(tpot)

    def render(self, queue_depth: int) -> str:
        with self.lock:
            blocks = [
                ("treeflash_requests_total", "counter", "HTTP requests answered, by status code",
                 [f'treeflash_requests_total{{code="{code}"}} {n}' for code, n in sorted(self.requests.items())]),
                ("treeflash_prompt_tokens_total", "counter", "prompt tokens of the generations",
                 [f"treeflash_prompt_tokens_total {self.prompt_tokens}"]),
                ("treeflash_completion_tokens_total", "counter", "tokens generated",
                 [f"treeflash_completion_tokens_total {self.completion_tokens}"]),
                ("treeflash_queue_depth", "gauge", "requests waiting for the decoding worker",
                 [f"treeflash_queue_depth {queue_depth}"]),
                ("treeflash_tau", "histogram", "tokens committed per target forward, per generation",
                 self.tau.lines("treeflash_tau")),
                ("treeflash_time_per_output_token_seconds", "histogram",
                 "decode time per token after the first, per generation",
                 self.tpot.lines("treeflash_time_per_output_token_seconds")),
            ]
        return "".join(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n" + "".join(f"{line}\n" for line in lines)
                       for name, kind, help_, lines in blocks)


def _number(x: float) -> str:
    return repr(float(x))
