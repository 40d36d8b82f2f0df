"""What each process of a run takes for itself, and how the results come back together.

- its share of a batch of prompts (`share`: contiguous, so a group never spans two processes),
  sampled by its own engine (`ShareEngine`);
- its vLLM server (`rollout_url`: `rollout.url` lists one URL per process; one URL for every
  process only where nothing reloads weights there, as in evaluation);
- per-prompt results of every share gathered in process order (`gather_rows`: one all-gather
  of one int32 array in a fixed shape, so it compiles once), of which the completions of a
  generation round are one case (`gather_rollouts`).
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from mmr_jax.distributed import collectives, weight_sync
from mmr_jax.distributed.errors import ProcessIdError, RolloutUrlError
from mmr_jax.rollout import base as rollout_base

# A field of `gather_rows`: (the shape of one prompt's entry, its dtype).
Spec = tuple[tuple[int, ...], type]
_WORD_DTYPES = (np.int32, np.float32, np.bool_)


def share(num: int, processes: int, index: int) -> slice:
    """The contiguous items of process `index` among `num` (sizes differ by at most one)."""
    if not 0 <= index < processes:
        raise ProcessIdError(f"process {index} out of range for {processes} processes")
    base, extra = divmod(num, processes)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


def share_slices(num: int, processes: int | None = None) -> list[slice]:
    """Every process's `share` of `num` items, in process order."""
    processes = jax.process_count() if processes is None else processes
    return [share(num, processes, p) for p in range(processes)]


def rollout_url(url: str, processes: int, index: int, *, syncs_weights: bool = False) -> str:
    """Process `index`'s server among `url`, a comma-separated list of URLs.

    A list of one URL per process gives process i the i-th (one vLLM server per host); '' lets
    each process launch its own. One URL serves every process only where the caller never
    reloads weights there (evaluation). `syncs_weights` (training): several processes sharing
    one server would each reload their weights and reset its prefix cache in the middle of the
    others' requests, so one URL for several processes, or a URL listed twice, raises
    `RolloutUrlError` (aliases of one host, such as localhost and 127.0.0.1, are not detected).
    Any other length raises `RolloutUrlError` too.
    """
    urls = [u.strip() for u in url.split(",")]
    if len(urls) == 1 and (not syncs_weights or processes == 1 or not urls[0]):
        return urls[0]
    if syncs_weights and len(urls) == 1:
        raise RolloutUrlError(
            f"rollout.url gives one server ({urls[0]}) to {processes} processes: each would "
            "reload its weights there and reset the prefix cache in the middle of the others' "
            "requests. Give one server per process, comma-separated (process i uses the i-th), "
            "e.g. --config.rollout.url=http://a:8000,http://b:8000; or '' (each process "
            "launches its own server); or run one process"
        )
    if not all(urls) or len(urls) != processes:
        raise RolloutUrlError(
            f"rollout.url lists {len(urls)} URLs ({url!r}) for {processes} process(es): give "
            + ("" if syncs_weights else "one URL (every process uses it) or ")
            + "one per process, comma-separated (process i uses the i-th)"
        )
    servers = [u.rstrip("/") for u in urls]
    if syncs_weights and len(set(servers)) < len(servers):
        twice = sorted({u for u in servers if servers.count(u) > 1})
        raise RolloutUrlError(
            f"rollout.url lists {twice} more than once ({url!r}): processes sharing a server "
            "would reload their weights there and reset the prefix cache in the middle of each "
            "other's requests; give each process a server of its own"
        )
    if not 0 <= index < processes:
        raise ProcessIdError(f"process {index} out of range for {processes} processes")
    return urls[index]


def _words(x: np.ndarray, dtype) -> np.ndarray:
    """`x` as int32 words: float32 bit-exact (a view), bools as 0 / 1."""
    x = np.ascontiguousarray(x, dtype)
    return x.astype(np.int32) if dtype == np.bool_ else x.view(np.int32)


def _from_words(w: np.ndarray, dtype) -> np.ndarray:
    w = np.ascontiguousarray(w)
    return w.astype(bool) if dtype == np.bool_ else w.view(dtype)


def gather_rows(
    local: Mapping[str, np.ndarray] | None,
    *,
    sizes: Sequence[int],
    specs: Mapping[str, Spec],
) -> dict[str, np.ndarray]:
    """Per-prompt arrays of every process's share, concatenated in process order.

    `specs[k] = (shape, dtype)`: entry k of one prompt, the same on every process (int32, float32
    or bool); `local[k]` is [sizes[this process], *shape] (`local` is None where that size is 0).
    Packed into one int32 array [max(sizes), W] and gathered once (a collective).
    """
    for k, (_, dtype) in specs.items():
        if np.dtype(dtype).type not in _WORD_DTYPES:
            raise TypeError(f"field {k}: {np.dtype(dtype)} is not int32, float32 or bool")
    widths = {k: int(np.prod(shape, dtype=np.int64)) for k, (shape, _) in specs.items()}
    packed = np.zeros((max(sizes), sum(widths.values())), np.int32)
    if local is not None:
        b, col = sizes[jax.process_index()], 0
        if any(len(local[k]) != b for k in specs):
            raise ValueError(f"local fields of {[len(v) for v in local.values()]} rows, not {b}")
        for k, (_, dtype) in specs.items():
            packed[:b, col : col + widths[k]] = _words(local[k], dtype).reshape(b, widths[k])
            col += widths[k]
    gathered = collectives.allgather(packed)  # [P, max(sizes), W]
    rows = np.concatenate([gathered[p, :size] for p, size in enumerate(sizes)], axis=0)
    out, col = {}, 0
    for k, (shape, dtype) in specs.items():
        out[k] = _from_words(rows[:, col : col + widths[k]], dtype).reshape(-1, *shape)
        col += widths[k]
    return out


def rollout_specs(n: int, max_len: int) -> dict[str, Spec]:
    """`gather_rows` fields of a `RolloutBatch` with `n` completions of at most `max_len`."""
    return {
        "tokens": ((n, max_len), np.int32),
        "mask": ((n, max_len), np.bool_),
        "logprobs": ((n, max_len), np.float32),
        "truncated": ((n,), np.bool_),
    }


def rollout_fields(
    batch: rollout_base.RolloutBatch, max_len: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """`batch` as `rollout_specs` fields (time padded to `max_len`, tokens with `pad_id`)."""
    pad = [(0, 0), (0, 0), (0, max_len - batch.tokens.shape[-1])]
    return {
        "tokens": np.pad(batch.tokens, pad, constant_values=pad_id),
        "mask": np.pad(batch.mask, pad),
        "logprobs": np.pad(batch.logprobs, pad),
        "truncated": np.asarray(batch.finish_reasons) == rollout_base.FINISH_LENGTH,
    }


def rollout_from_rows(rows: Mapping[str, np.ndarray]) -> rollout_base.RolloutBatch:
    """The `RolloutBatch` of gathered `rollout_specs` fields, trimmed to its longest completion
    (as one engine returns it)."""
    t = int(max(1, rows["mask"].sum(-1).max(initial=1)))
    finish = np.where(rows["truncated"], rollout_base.FINISH_LENGTH, rollout_base.FINISH_STOP)
    return rollout_base.RolloutBatch(
        tokens=np.ascontiguousarray(rows["tokens"][..., :t]),
        mask=np.ascontiguousarray(rows["mask"][..., :t]),
        logprobs=np.ascontiguousarray(rows["logprobs"][..., :t]),
        finish_reasons=finish.tolist(),
    )


def gather_rollouts(
    local: rollout_base.RolloutBatch | None,
    *,
    sizes: Sequence[int],
    n: int,
    max_len: int,
    pad_id: int = 0,
) -> rollout_base.RolloutBatch:
    """The `RolloutBatch` of every process's share, concatenated in process order.

    `sizes[p]`: the prompt count of process p (known to all: `share`); `local` is None where it is
    0. Every share is padded to the largest count and `max_len` tokens (`gather_rows`).
    """
    fields = None if local is None else rollout_fields(local, max_len, pad_id)
    return rollout_from_rows(gather_rows(fields, sizes=sizes, specs=rollout_specs(n, max_len)))


class ShareEngine:
    """A rollout engine for one process of many: samples this process's share of the prompts
    with `engine` (process-local weights).

    `generate_local` returns this process's completions alone (the trainer scores them here and
    gathers the scores, `experience.generate_and_score`); `generate` returns every process's
    (evaluation). The share's rows keep their index in the whole batch (the embedded engine's
    `first_row`, the vLLM engine's `first_prompt`), so they draw the random numbers they would
    in one process: the tokens are those of a one-process run, up to float rounding. Weight sync
    copies the global weights into this process first (`local_copy`, a collective: every
    process syncs together): one whole copy per process, of the arrays not copied before (under
    LoRA the adapters alone: the base copied with the engine is kept; `weight_sync`).
    """

    def __init__(self, engine):
        self.engine = engine
        self.pad_id = getattr(engine, "pad_id", 0)

    def generate_local(
        self, prompt_ids: Sequence[Sequence[int]], params: rollout_base.SamplingParams
    ) -> rollout_base.RolloutBatch | None:
        """This process's share of `prompt_ids` sampled (None when the share is empty)."""
        mine = share_slices(len(prompt_ids))[jax.process_index()]
        if mine.stop == mine.start:
            return None
        accepts = inspect.signature(self.engine.generate).parameters
        kwargs = {}
        if "first_row" in accepts:
            kwargs["first_row"] = mine.start * params.n
        if "first_prompt" in accepts:
            kwargs["first_prompt"] = mine.start
        return self.engine.generate(list(prompt_ids[mine]), params, **kwargs)

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: rollout_base.SamplingParams
    ) -> rollout_base.RolloutBatch:
        """Every process's completions of `prompt_ids` (a collective)."""
        local = self.generate_local(prompt_ids, params)
        sizes = [s.stop - s.start for s in share_slices(len(prompt_ids))]
        return gather_rollouts(
            local, sizes=sizes, n=params.n, max_len=params.max_new_tokens, pad_id=self.pad_id
        )

    def sync_weights(self, model: nnx.Module, *, version: int) -> None:
        if getattr(self.engine, "syncs_adapters_only", False):  # vLLM under LoRA
            # The base stays global and unread (the server has it): no copy of it here.
            graphdef, adapters, others = nnx.split(model, nnx.LoRAParam, ...)
            model = nnx.merge(graphdef, weight_sync.local_copy(adapters), others)
        else:
            model = weight_sync.local_model(model)
        self.engine.sync_weights(model, version=version)
        # `nnx.merge` leaves reference cycles: the copy handed over would outlive the engine's
        # use until Python's cyclic GC ran, a model's worth of memory more (measured on SmolLM2:
        # +770 MB resident per process, benchmarks/weight_sync.py). The young generations only.
        del model
        gc.collect(1)

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()
