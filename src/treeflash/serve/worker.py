"""One decoding thread serving the requests in arrival order, behind a bounded queue.

`Worker` runs one request at a time through `engine.generate`; `BatchWorker` decodes up to `--max-batch` requests
together (batching.BatchEngine): a request joins the batch between rounds as soon as a slot is free, and leaves it
when it ends. Either way the thread (torch releases the GIL, so the event loop keeps answering meanwhile) posts each
request's text to its asyncio queue as it comes. A request ends early when its client leaves, its stop string shows
up or its deadline passes: the engine asks `Job.should_stop` before every round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..batching import BatchEngine
from ..engine import GenerationResult, generate
from ..verify import Sampling
from .metrics import Metrics
from .openai_api import APIError
from .text import TextStream

log = logging.getLogger(__name__)

RECENT_JOBS = 16  # the finished generations whose mean service time estimates Retry-After
MIN_RETRY_AFTER_S = 1


class QueueFull(Exception):
    pass


@dataclass
class Finished:
    text: str  # the whole output, cut at a stop string
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    completion_tokens: int
    result: GenerationResult


@dataclass
class Job:
    """One request: its prompt and settings, and the events it receives from the worker, in order:
    ("text", str)*, then ("done", Finished) or ("error", APIError)."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    text: TextStream
    deadline: float  # clock() after which the request ends with a timeout error
    clock: Callable[[], float] = time.monotonic
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False

    def cancel(self) -> None:
        """The client left: stop at the next round (or skip the job, still queued)."""
        self.cancelled.set()

    def should_stop(self) -> bool:
        self.timed_out = self.timed_out or self.clock() > self.deadline
        return self.cancelled.is_set() or self.text.stopped or self.timed_out

    def on_token(self, token: int) -> None:
        if delta := self.text.add(token):
            self.post("text", delta)

    def post(self, kind: str, value) -> None:  # from the worker thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


Decode = Callable[[Job], GenerationResult]


def engine_decoder(target, drafter, budget: int | str, max_budget: int) -> Decode:
    """Decoding through `engine.generate`: the same call as `treeflash generate`, so the same tokens."""

    def decode(job: Job) -> GenerationResult:
        return generate(target, drafter, job.prompt, job.max_tokens, job.sampling, budget, seed=job.seed,
                        on_token=job.on_token, max_budget=max_budget, should_stop=job.should_stop)

    return decode


class Worker:
    slots = 1  # requests decoded at once

    def __init__(self, decode: Decode, eos_ids: frozenset[int] = frozenset(), max_queue: int = 16,
                 metrics: Metrics | None = None):
        self.decode, self.eos_ids = decode, eos_ids
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)  # None: the end
        self.metrics = metrics or Metrics()
        self.thread = threading.Thread(target=self._run, name="treeflash-decode", daemon=True)
        # seconds each recent generation took (appended by the decoding thread; a deque's append is atomic)
        self.service_s: deque[float] = deque(maxlen=RECENT_JOBS)

    @property
    def depth(self) -> int:
        """Requests waiting (the one decoding excluded)."""
        return self.queue.qsize()

    def retry_after(self) -> int:
        """Seconds a turned-away client should wait: until the requests waiting now have been served, at the recent
        mean service time shared by the slots; at least MIN_RETRY_AFTER_S (also before any generation ended)."""
        recent = list(self.service_s)
        mean = sum(recent) / len(recent) if recent else 0.0
        return max(MIN_RETRY_AFTER_S, math.ceil(self.depth * mean / self.slots))

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def close(self) -> None:
        """Finish every queued job, then stop the thread."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                self._serve(job)
            except Exception:  # a bug must not take the server down: this request fails, the next one runs
                log.exception("decoding failed")
                job.post("error", APIError(500, "internal error while decoding", type="server_error"))

    def _serve(self, job: Job) -> None:
        if self._stale(job):
            return
        self._finish(job, self.decode(job))

    @staticmethod
    def _stale(job: Job) -> bool:
        """A job whose client left, or whose deadline passed, while it was queued: answered, not decoded."""
        if job.cancelled.is_set():
            job.post("error", APIError(499, "the client closed the request"))
            return True
        if job.should_stop():
            job.post("error", _timeout())
            return True
        return False

    def _finish(self, job: Job, result: GenerationResult) -> None:
        self._measure(job, result)
        if job.timed_out and not job.text.stopped:
            job.post("error", _timeout())
            return
        if rest := job.text.finish():
            job.post("text", rest)
        stopped = job.text.stopped or (result.tokens and result.tokens[-1] in self.eos_ids)
        job.post("done", Finished(job.text.text, "stop" if stopped else "length", len(job.text.tokens), result))

    def _measure(self, job: Job, result: GenerationResult) -> None:
        self.service_s.append(result.seconds)
        decode_s = result.seconds - result.prefill_s
        tpot = decode_s / (len(result.tokens) - 1) if len(result.tokens) > 1 else None
        self.metrics.generation(len(job.prompt), len(job.text.tokens), result.tau if result.rounds else None, tpot)


class BatchWorker(Worker):
    """Up to `engine`'s max_batch requests decoded together; the queue holds those waiting for a slot."""

    def __init__(self, engine: BatchEngine, eos_ids: frozenset[int] = frozenset(), max_queue: int = 16,
                 metrics: Metrics | None = None):
        super().__init__(None, eos_ids, max_queue, metrics)
        self.engine = engine
        self.slots = engine.slots.max_batch

    def _run(self) -> None:
        closing = False
        while not (closing and not len(self.engine)):
            while not closing and not self.engine.full:  # admit between rounds; wait only when idle
                try:
                    job = self.queue.get(block=not len(self.engine))
                except queue.Empty:
                    break
                if job is None:  # close(): every job queued before it has been admitted
                    closing = True
                elif not self._stale(job):
                    self._admit(job)
            try:
                for request in self.engine.step():
                    self._finish(request.data["job"], request.result)
            except Exception:  # a bug must not take the server down: this batch fails, the next requests run
                log.exception("decoding failed")
                for request in self.engine.abort():
                    request.data["job"].post("error", APIError(500, "internal error while decoding",
                                                               type="server_error"))

    def _admit(self, job: Job) -> None:
        try:
            request = self.engine.add(job.prompt, job.max_tokens, job.sampling, job.seed, job.on_token,
                                      job.should_stop)
        except Exception:
            log.exception("prefill failed")
            job.post("error", APIError(500, "internal error while decoding", type="server_error"))
            return
        request.data["job"] = job


def _timeout() -> APIError:
    return APIError(504, "the request ran longer than the server's --timeout; ask for fewer tokens",
                    code="timeout", type="server_error", headers={"x-should-retry": "false"})
