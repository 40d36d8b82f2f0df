"""A sampler call in progress (`sampler.start`): its decode run in chunks, read back as it goes.

Legend: B prompts, G samples per prompt (`n`), N rows (B * G real ones), T new-token slots.
"""

from __future__ import annotations

import numpy as np

from mmr_jax.rollout import base, decode_loop

LoopStats = decode_loop.LoopStats


class Sampling:
    """A `sample` call in progress (`start`): `advance(steps)` decodes up to `steps` more steps
    (None: to the end) and `decoded()` / `batch()` read what the rows hold so far."""

    def __init__(self, loop, *, num_prompts, n, n_slots, max_new, stops, pad_id):
        self.loop, self.num_prompts, self.n = loop, num_prompts, n
        self.max_new, self.stops, self.pad_id = max_new, stops, pad_id
        # The real rows b * n_slots + i (i < n) of the padded layout, prompt-major.
        self.real_rows = (np.arange(num_prompts)[:, None] * n_slots + np.arange(n)).reshape(-1)

    @property
    def stats(self) -> LoopStats:
        return self.loop.stats

    @property
    def finished(self) -> bool:
        return self.loop.finished

    def advance(self, steps: int | None = None) -> None:
        self.loop.advance(steps)

    def cancel(self, rows) -> None:
        """Ends rows (indices b * n + i) at the next `advance`."""
        self.loop.cancel(self.real_rows[np.asarray(rows, int)])

    def decoded(self):
        """(tokens [B * G, T], log-probs [B * G, T], stopped [B * G], done [B * G]) so far."""
        real, loop = self.real_rows, self.loop
        return loop.toks[real], loop.logps[real], loop.stopped[real], loop.done[real]

    def progress(self):
        """(lengths [B * G], tokens [B * G, T], log-probs, stopped [B * G]) so far: a row's
        length is its tokens up to its stop token when stopped, else the steps run."""
        toks, logps, stopped, _ = self.decoded()
        return (
            row_lengths(toks, stopped, self.stops, min(self.loop.t, self.max_new)),
            toks,
            logps,
            stopped,
        )

    def batch(self) -> base.RolloutBatch:
        toks, logps, stopped, _ = self.decoded()
        args = (self.num_prompts, self.n, self.max_new, self.stops, self.pad_id)
        return to_batch(toks, logps, stopped, *args)


class Whole:
    """`decode_loop.Chunked`'s interface over one call of the uncompacted, unchunked loop."""

    def __init__(self, run, size):
        self._run, self.finished = run, False
        self.stats = LoopStats(loop_rows=(size,))

    def advance(self, steps=None):
        if steps is not None:
            raise ValueError("chunked decoding (steps) is single-device, with compaction")
        if not self.finished:
            self.toks, self.logps, self.stopped, device_steps = (np.asarray(x) for x in self._run())
            self.done, self.finished = np.ones_like(self.stopped), True
            self.stats.decode_steps = int(np.max(device_steps))

    def cancel(self, rows):
        raise ValueError("cancel needs chunked decoding")


def row_lengths(toks, stopped, stops, steps: int) -> np.ndarray:
    """Tokens of each row [N]: up to its first stop id when `stopped`, else `steps`."""
    toks = toks[:, :steps]
    is_stop = np.isin(toks, np.asarray(stops, np.int32)) if stops else np.zeros_like(toks, bool)
    first_stop = np.where(is_stop.any(-1), is_stop.argmax(-1) + 1, steps)
    return np.where(stopped, first_stop, steps)


def to_batch(toks, logps, stopped, num_prompts, n, max_new, stops, pad_id) -> base.RolloutBatch:
    """Device outputs [N, T] (T new-token slots) -> a host `RolloutBatch` [B, G, T], T cut to the
    longest completion."""
    real = num_prompts * n
    toks, logps, stopped = toks[:real, :max_new], logps[:real, :max_new], stopped[:real]
    lengths = row_lengths(toks, stopped, stops, max_new)
    t = max(1, int(lengths.max()))
    mask = np.arange(t)[None, :] < lengths[:, None]
    toks = np.where(mask, toks[:, :t], pad_id).astype(np.int32)
    logps = np.where(mask, logps[:, :t], 0.0).astype(np.float32)
    reasons = np.where(stopped, base.FINISH_STOP, base.FINISH_LENGTH).reshape(num_prompts, n)
    return base.RolloutBatch(
        tokens=toks.reshape(num_prompts, n, t),
        mask=mask.reshape(num_prompts, n, t),
        logprobs=logps.reshape(num_prompts, n, t),
        finish_reasons=reasons.tolist(),
    )
