"""One training step, as data: the batch a step is built from, and the jitted policy update.

In the order of DESIGN.md's "One training step": `step_batch` drives a step's rollout ->
rewards -> `embeddings` -> advantages (through `experience`, which groups the completions and
applies the algorithms) -> `batch_layout` (full rows or the shared-prompt packing, with
`shape_reuse` choosing the packed length); `train_step` is the jitted update (log-probs,
losses, gradient accumulation, the optimiser).

May import: `algorithms`, `models`, `rollout`, `rewards`, `distributed`, `infra`,
`config`. Nothing here runs a loop, saves a checkpoint or prints.
"""
