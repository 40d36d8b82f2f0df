"""Requests decoded together, in chunks of steps, for `server.OpenAIServer`.

Each request is a `Job`; one thread (`Batcher`) takes every job waiting when it is free (after
waiting `gather_s` for requests sent at the same time to arrive), groups
those that can share one decode call (same model and sampling controls; no explicit seed, whose
tokens must not depend on other requests) up to `max_num_seqs` rows, and decodes them with the
backend held (`Backend.exclusive()`: a weight reload waits for the whole batch, top log-probs
included). It runs the decode `chunk_steps` at a time (`sampler.start`: the loop resumes without
recompiling) and after each chunk hands each job its rows' tokens so far (`Update`); rows a job
no longer wants (its max_tokens reached, a stop string found, the client gone) are ended at the
next chunk, and the batch ends when no job wants more. Requests arriving meanwhile wait for the
next batch, and are batched together there (not continuous batching: rows do not join a running
decode). `scripts/serve.py` serves the embedded sampler continuously instead (`slot_scheduler`,
which takes the same `Job`s and sends the same `Update`s); this batcher serves backends that
generate whole batches (`Finished`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import numpy as np

from mmr_jax.rollout import base
from mmr_jax.serving import openai_params, request_limits

log = logging.getLogger(__name__)

FIRST_CHUNK = 2  # steps before the first tokens go out: time to first token ~ prefill + 2 steps


@dataclasses.dataclass
class Update:
    """A job's rows so far (prompt-major, b * n + i): ids and log-probs, and per row whether it
    is finished and why (`base.FINISH_STOP` / `FINISH_LENGTH`)."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]
    reasons: list[str]
    tops: list | None = None  # with `final`: `Backend.top_logprobs` of each row, when asked
    final: bool = False


class Job:
    """One request in the batcher: `updates` receives `Update`s (the last has `final`) or an
    exception; `stop_rows` / `cancel()` end rows early (read by the batcher between chunks)."""

    def __init__(self, request: openai_params.Request, model: str):
        self.request, self.model = request, model
        self.updates: queue.Queue = queue.Queue()
        self.stop_rows: set[int] = set()
        self.cancelled = False
        # Continuous batching (`slot_scheduler`): its rows' slots, ended rows, ends reported.
        self.slots: list[int] = []
        self.done_rows: dict = {}
        self.reported_done = 0

    @property
    def rows(self) -> int:
        return len(self.request.prompts) * self.request.params.n

    def cancel(self) -> None:
        self.cancelled = True

    def key(self) -> tuple:
        """Jobs with equal keys share a decode call."""
        r, p = self.request, self.request.params
        solo = id(self) if p.seed is not None else None
        return (
            self.model,
            p.temperature,
            p.top_p,
            p.top_k,
            p.n,
            p.stop_token_ids,
            r.ignore_eos,
            solo,
        )

    def wants(self, row: int, length: int, done: bool) -> bool:
        return not (
            self.cancelled
            or done
            or row in self.stop_rows
            or length >= self.request.params.max_new_tokens
        )


class Finished:
    """A finished `RolloutBatch` behind the interface of `sampler.start`'s `Sampling`, for
    backends that generate whole batches."""

    def __init__(self, batch: base.RolloutBatch):
        self.batch, self.finished = batch, True

    def advance(self, steps=None) -> None:
        pass

    def cancel(self, rows) -> None:
        pass

    def progress(self):
        b, n, t = self.batch.tokens.shape
        lengths = self.batch.mask.reshape(b * n, t).sum(-1)
        stopped = np.asarray(
            [r == base.FINISH_STOP for rs in self.batch.finish_reasons for r in rs]
        )
        return (
            lengths,
            self.batch.tokens.reshape(b * n, t),
            self.batch.logprobs.reshape(b * n, t),
            stopped,
        )


class Batcher:
    """The decode thread over `backend` (a `server.Backend`); `submit(job)` queues a job."""

    takes_controls = False  # logit_bias, allowed_token_ids, min_tokens: the slot batch's only

    def __init__(
        self,
        backend: Any,
        limits: request_limits.Limits,
        *,
        chunk_steps: int = 8,
        gather_s: float = 0.02,
    ):
        self.backend, self.limits, self.chunk_steps = backend, limits, chunk_steps
        self.gather_s = gather_s
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.batches: list[int] = []  # jobs per batch run (tests, benchmarks)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="batcher")
        self._thread.start()

    def submit(self, job: Job) -> Job:
        with self._cond:
            self._waiting.append(job)
            self._cond.notify()
        return job

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _take(self) -> list[Job] | None:
        """The next batch: the oldest waiting job and the waiting jobs that share its key."""
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            # Requests sent together arrive a few ms apart: wait that long for them, so that
            # they share this batch rather than wait for the whole of it.
            deadline = time.monotonic() + self.gather_s
            while not self._closed and (left := deadline - time.monotonic()) > 0:
                if sum(j.rows for j in self._waiting) >= self.limits.max_num_seqs:
                    break
                self._cond.wait(timeout=left)
            if self._closed:
                return None
            first = self._waiting.popleft()
            jobs, rows, rest = [first], first.rows, collections.deque()
            while self._waiting:
                job = self._waiting.popleft()
                fits = rows + job.rows <= self.limits.max_num_seqs
                if fits and job.key() == first.key() and not job.cancelled:
                    jobs.append(job)
                    rows += job.rows
                else:
                    rest.append(job)
            self._waiting = rest
            return [j for j in jobs if not j.cancelled]

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            if not jobs:
                continue
            self.batches.append(len(jobs))
            try:
                with self.backend.exclusive():
                    self._run(jobs)
            except Exception as e:
                log.exception("error decoding a batch of %d requests", len(jobs))
                for job in jobs:
                    job.updates.put(e)

    def _run(self, jobs: list[Job]) -> None:
        first = jobs[0].request
        prompts = [p for job in jobs for p in job.request.prompts]
        params = dataclasses.replace(
            first.params, max_new_tokens=max(j.request.params.max_new_tokens for j in jobs)
        )
        call = self.backend.start(
            prompts,
            params,
            model=jobs[0].model,
            ignore_eos=first.ignore_eos,
            n_slots=request_limits.n_slots(params.n),
        )
        starts = np.cumsum([0] + [j.rows for j in jobs])
        steps = FIRST_CHUNK
        while True:
            call.advance(steps)
            steps = self.chunk_steps
            lengths, toks, logps, stopped = call.progress()
            done = np.ones_like(stopped) if call.finished else ~self._live(call, lengths, stopped)
            wanted = False
            for job, lo in zip(jobs, starts[:-1], strict=False):
                update = _update(job, lengths[lo:], toks[lo:], logps[lo:], stopped[lo:], done[lo:])
                job.updates.put(update)
                ends = [r for r in range(job.rows) if update.finished[r]]
                call.cancel([lo + r for r in ends])
                wanted |= not all(update.finished)
            if call.finished or not wanted:
                break
        for job in jobs:
            job.updates.put(self._final(job))

    @staticmethod
    def _live(call, lengths, stopped) -> np.ndarray:
        """Rows still decoding: neither stopped nor at max_new_tokens."""
        return ~stopped & (lengths < call.max_new)

    def _final(self, job: Job) -> Update:
        """The job's last update: nothing new, with the top log-probs when asked (computed under
        the same hold of the backend as the tokens)."""
        last = job.last
        k = job.request.logprobs
        if k and not job.cancelled:
            n = job.request.params.n
            seqs = [(job.request.prompts[r // n], last.ids[r]) for r in range(job.rows)]
            temperature = job.request.params.temperature or 1.0  # greedy: untempered
            last.tops = self.backend.top_logprobs(seqs, k, temperature=temperature, model=job.model)
        last.final = True
        return last


def _update(job: Job, lengths, toks, logps, stopped, done) -> Update:
    """`job`'s rows (the first `job.rows` of the arrays) as an `Update`; rows it no longer wants
    are finished (reason: stop when they stopped, else length)."""
    ids, lps, finished, reasons = [], [], [], []
    cap = job.request.params.max_new_tokens
    for r in range(job.rows):
        length = min(int(lengths[r]), cap)
        ids.append(toks[r, :length].tolist())
        lps.append(logps[r, :length].tolist())
        reasons.append(
            base.FINISH_STOP if stopped[r] and length == lengths[r] else base.FINISH_LENGTH
        )
        finished.append(not job.wants(r, length, bool(done[r])))
    job.last = Update(ids, lps, finished, reasons)
    return job.last
