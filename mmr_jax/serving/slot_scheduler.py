"""Continuous batching for `server.OpenAIServer`: requests join and leave a running decode.

One thread runs the batch a step at a time over the KV cache's S slots (`slot_grid`,
`slot_programs`), as vLLM's scheduler does:
  - at each step boundary, waiting requests are admitted first come, first served while their
    rows (prompts x n) find free slots: their prompts are prefilled into those slots and their
    rows decode from the next step on, beside the rows already running;
  - a row that ends (a stop token, its max_tokens, a stop string its stream found, its client
    gone) frees its slot at once, for the next waiting request;
  - every row has its own sampling controls, seed, stop ids and length, so requests with
    different ones share a step; rows of one model decode together (a request for another
    model, e.g. a LoRA adapter, waits until the running rows end).
A request whose rows could never fit (more than S, or longer than a slot) is refused with a
400 when it is submitted; the others wait in the queue, holding only their token ids.
Jobs and updates are `batching`'s: a job gets an `Update` after its first step, every
`chunk_steps` steps and when a row ends; the last has `final`.
"""

from __future__ import annotations

import collections
import logging
import threading

import numpy as np

from mmr_jax.rollout import base
from mmr_jax.serving import batching, slot_grid, token_controls
from mmr_jax.serving.openai_format import HTTPError

log = logging.getLogger(__name__)


class _Row:
    """A row in a slot: its job, index in the job, tokens so far and when it ends."""

    def __init__(self, job, index: int, stops: frozenset, max_new: int):
        self.job, self.index, self.stops, self.max_new = job, index, stops, max_new
        self.ids: list[int] = []
        self.logps: list[float] = []
        self.reason: str | None = None
        self.ready = False  # its prompt is prefilled: it decodes


class _Prefill:
    """A prompt being prefilled: its rows' slots (the first gets the prefill, the others a
    copy), the ids to write (all but the last) and how many are written."""

    def __init__(self, job, slots: list[int], ids: list[int]):
        self.job, self.slots, self.ids, self.done = job, slots, ids, 0


class ContinuousBatcher:
    """The decode thread over `backend` (a `embedded_backend.EmbeddedBackend`, whose
    `slot_engine()` gives the grid, cache and programs); `submit(job)` queues a job."""

    takes_controls = True  # `token_controls`: a bias row per slot, added to its logits

    def __init__(self, backend, *, chunk_steps: int = 8):
        self.backend, self.chunk_steps = backend, chunk_steps
        self.engine = backend.slot_engine()
        self.grid: slot_grid.Grid = self.engine.grid
        s = self.grid.slots
        self._rows: list[_Row | None] = [None] * s
        self._cur = np.zeros(s, np.int32)
        self._pos = np.full(s, self.grid.columns, np.int32)
        self._seed = np.zeros(s, np.uint32)
        self._row_id = np.zeros(s, np.int32)
        self._temperature = np.zeros(s, np.float32)
        self._top_k = np.zeros(s, np.int32)
        self._top_p = np.ones(s, np.float32)
        self._bias = np.zeros((s, backend.vocab_size), np.float32)  # `token_controls`
        self._model: str | None = None
        self._waiting: collections.deque = collections.deque()
        self._prefills: list[_Prefill] = []
        self._cond = threading.Condition()
        self._closed = False
        self.steps = 0
        self.batches: list[int] = []  # jobs admitted at each step boundary that admitted some
        self._thread = threading.Thread(target=self._loop, daemon=True, name="slot-batcher")
        self._thread.start()

    # ---- the queue -----------------------------------------------------------------------------

    def submit(self, job: batching.Job) -> batching.Job:
        self._check_fits(job)
        with self._cond:
            self._waiting.append(job)
            self._cond.notify()
        return job

    def _check_fits(self, job) -> None:
        """A 400 for a request the batch could never hold."""
        g, p = self.grid, job.request.params
        if job.rows > g.slots:
            raise HTTPError(
                400,
                f"this request asks for {job.rows} sequences; this server's KV cache holds "
                f"{g.slots} at once (--kv_cache_gib, --max_num_seqs)",
                param="n",
                code="too_many_sequences",
            )
        longest = max(len(prompt) for prompt in job.request.prompts) + p.max_new_tokens
        if longest > g.columns:
            raise HTTPError(
                400,
                f"prompt + max_tokens ({longest}) exceeds a KV cache slot ({g.columns} tokens)",
                param="max_tokens",
                code="context_length_exceeded",
            )

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._rows)

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._waiting or self.active):
                    self._cond.wait()
                if self._closed:
                    return
                jobs = self._admit()
            try:
                with self.backend.exclusive():
                    if jobs:
                        self._place(jobs)
                    if self._prefills:
                        self._prefill()
                    if any(r is not None and r.ready for r in self._rows):
                        self._step()
            except Exception as e:  # the running rows fail; the server goes on
                log.exception("error in the decode batch")
                self._fail(e)

    def _admit(self) -> list:
        """Waiting jobs that fit in the free slots, first come first served (under the lock)."""
        free = [s for s, r in enumerate(self._rows) if r is None]
        for job in [j for j in self._waiting if j.cancelled]:  # their clients left: drop them
            self._waiting.remove(job)
            job.updates.put(_final(job, [], self.backend))
        jobs = []
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                job.updates.put(_final(job, [], self.backend))
                continue
            running = self._model if self.active or jobs else None
            if (running is not None and job.model != running) or job.rows > len(free):
                break
            self._waiting.popleft()
            self._model = job.model
            job.slots, free = free[: job.rows], free[job.rows :]
            job.admitted_step = self.steps
            jobs.append(job)
        if jobs:
            self.batches.append(len(jobs))
        return jobs

    def _place(self, jobs) -> None:
        """The rows of newly admitted `jobs` into their slots, and their prompts queued for
        prefill (a one-token prompt has nothing to prefill: its rows decode at once)."""
        for job in jobs:
            p, n = job.request.params, job.request.params.n
            stops = frozenset(() if job.request.ignore_eos else self.backend.eos_token_ids)
            stops |= frozenset(p.stop_token_ids)
            seed = p.seed if p.seed is not None else self.backend.engine.next_seed()
            for r, slot in enumerate(job.slots):
                prompt = job.request.prompts[r // n]
                self._rows[slot] = _Row(job, r, stops, p.max_new_tokens)
                self._cur[slot], self._pos[slot] = prompt[-1], len(prompt) - 1
                self._seed[slot], self._row_id[slot] = np.uint32(seed % 2**32), r
                self._temperature[slot] = p.temperature
                self._top_k[slot], self._top_p[slot] = p.top_k, p.top_p
                self._set_bias(slot, job.request.controls, stops)
            for b, prompt in enumerate(job.request.prompts):
                task = _Prefill(job, job.slots[b * n : (b + 1) * n], list(prompt[:-1]))
                if task.ids:
                    self._prefills.append(task)
                else:
                    self._prefilled(task)

    def _prefill(self) -> None:
        """At most `slot_grid.CHUNK` prompt tokens into the cache (chunked prefill, as vLLM's
        token budget per step): the next chunk of a long prompt already started, else the
        first chunks of the queued prompts, first come first served, packed together."""
        for task in [t for t in self._prefills if t.job.cancelled]:
            self._prefills.remove(task)
            for slot in task.slots:
                self._rows[slot].reason = base.FINISH_LENGTH
                self._free(slot)
            self._update(task.job)
        started = [t for t in self._prefills if t.done]
        batch = started[:1]
        if not batch:
            total = 0
            for task in self._prefills:
                size = min(len(task.ids), slot_grid.CHUNK)
                if batch and total + size > slot_grid.CHUNK:
                    break
                batch.append(task)
                total += size
        if not batch:
            return
        pieces = [(t.slots[0], t.done, t.ids[t.done : t.done + slot_grid.CHUNK]) for t in batch]
        self.engine.prefill(self.engine.weights(self._model), pieces)
        for task, (_, _, ids) in zip(batch, pieces, strict=True):
            task.done += len(ids)
            if task.done == len(task.ids):
                self._prefills.remove(task)
                self._prefilled(task)

    def _prefilled(self, task: _Prefill) -> None:
        """The prompt's rows decode from the next step (its other rows get the first's cache)."""
        copies = [(task.slots[0], s) for s in task.slots[1:]]
        if copies and task.ids:
            self.engine.copy_slots(copies)
        for slot in task.slots:
            self._rows[slot].ready = True

    def _step(self) -> None:
        """One decode step of the live rows; rows that end free their slots."""
        live = [s for s, r in enumerate(self._rows) if r is not None and r.ready]
        rows_n = self.grid.rows_for(max(live))
        weights = self.engine.weights(self._model)
        step = np.zeros(rows_n, np.int32)
        for s in live:
            step[s] = len(self._rows[s].ids)
        pos = self._pos[:rows_n].copy()
        idle = np.ones(rows_n, bool)
        idle[live] = False
        pos[idle] = self.grid.columns
        rows = {
            "cur": self._cur[:rows_n],
            "pos": pos,
            "seed": self._seed[:rows_n],
            "row_id": self._row_id[:rows_n],
            "step": step,
            "temperature": np.where(idle, 0.0, self._temperature[:rows_n]).astype(np.float32),
            "top_k": np.where(idle, 0, self._top_k[:rows_n]).astype(np.int32),
            "top_p": np.where(idle, 1.0, self._top_p[:rows_n]).astype(np.float32),
            "bias": self._bias[:rows_n],
            "n_blocks": np.int32(slot_grid.slot_programs.block_count(int(pos[live].max()) + 1)),
        }
        use_filter = bool(
            np.any((rows["top_k"] > 0) | (rows["top_p"] < 1.0)) & np.any(rows["temperature"] > 0)
        )
        tok, logp = self.engine.decode(weights, rows, use_filter=use_filter)
        self.steps += 1
        touched = {}
        for s in live:
            row = self._rows[s]
            row.ids.append(int(tok[s]))
            row.logps.append(float(logp[s]))
            self._cur[s], self._pos[s] = tok[s], self._pos[s] + 1
            job = row.job
            if len(row.ids) == job.request.controls.min_tokens:  # its stop tokens allowed again
                self._set_bias(s, job.request.controls, ())
            if tok[s] in row.stops:
                row.reason = base.FINISH_STOP
            elif len(row.ids) >= row.max_new:
                row.reason = base.FINISH_LENGTH
            elif job.cancelled or row.index in job.stop_rows:
                row.reason = base.FINISH_LENGTH
            touched.setdefault(id(job), job)
            if row.reason is not None:
                self._free(s)
        for job in touched.values():
            self._update(job)

    def _set_bias(self, slot: int, controls, stops) -> None:
        """The slot's bias row: `controls`' base bias, its stops banned under min_tokens."""
        if controls == token_controls.NONE:
            self._bias[slot] = 0.0
            return
        self._bias[slot] = token_controls.base_bias(controls, self.backend.vocab_size)
        if controls.min_tokens and stops:
            self._bias[slot, sorted(stops)] = -np.inf

    def _free(self, slot: int) -> None:
        row = self._rows[slot]
        self._rows[slot] = None
        self._pos[slot] = self.grid.columns
        self._bias[slot] = 0.0
        row.job.done_rows[row.index] = row

    def _update(self, job) -> None:
        """Sends `job` its rows so far when due: after its first step, every `chunk_steps`,
        when a row ended; the final update once every row has."""
        rows = [job.done_rows.get(r) for r in range(job.rows)]
        live = {s: self._rows[s] for s in job.slots if self._rows[s] is not None}
        for row in live.values():
            if row.job is job:
                rows[row.index] = row
        done = len(job.done_rows) == job.rows
        length = max(len(r.ids) for r in rows)
        ended_now = len(job.done_rows) != job.reported_done
        if not (done or ended_now or length == 1 or length % self.chunk_steps == 0):
            return
        job.reported_done = len(job.done_rows)
        update = batching.Update(
            [list(r.ids) for r in rows],
            [list(r.logps) for r in rows],
            [r.reason is not None for r in rows],
            [r.reason or base.FINISH_LENGTH for r in rows],
        )
        job.last = update
        if done:
            job.finished_step = self.steps
        job.updates.put(_final(job, None, self.backend) if done else update)

    def _fail(self, error: Exception) -> None:
        self._prefills.clear()
        jobs = {id(r.job): r.job for r in self._rows if r is not None}
        for s, r in enumerate(self._rows):
            if r is not None:
                self._rows[s] = None
                self._pos[s] = self.grid.columns
        for job in jobs.values():
            job.updates.put(error)


def batcher_for(backend, limits, *, chunk_steps: int = 8, gather_s: float = 0.02):
    """A `ContinuousBatcher` when `backend` has its slot engine enabled, else the batch-at-a-time
    `batching.Batcher` (backends that generate whole batches)."""
    if getattr(backend, "slot_engine", lambda: None)() is not None:
        return ContinuousBatcher(backend, chunk_steps=chunk_steps)
    return batching.Batcher(backend, limits, chunk_steps=chunk_steps, gather_s=gather_s)


def _final(job, ids, backend) -> batching.Update:
    """The job's last update: its rows (`ids` [] for a job cancelled before it ran), with the
    top log-probs when asked."""
    if ids is not None:
        job.last = batching.Update([[]] * job.rows, [[]] * job.rows, [True] * job.rows,
                                        [base.FINISH_LENGTH] * job.rows)  # fmt: skip
    last = job.last
    k = job.request.logprobs
    if k and not job.cancelled and ids is None:
        n = job.request.params.n
        seqs = [(job.request.prompts[r // n], last.ids[r]) for r in range(job.rows)]
        temperature = job.request.params.temperature or 1.0  # greedy: untempered
        last.tops = backend.top_logprobs(seqs, k, temperature=temperature, model=job.model)
    last.final = True
    return last
