"""One training step, as data: the batch a step is built from, and the jitted policy update.

In the order of docs/design.md's "One step": `pipeline` is the host side of a step, read top
to bottom: rollout -> rewards -> `embeddings` (through `experience`, which groups the
completions) -> reweighting and advantages -> `batch_layout` (full rows or the shared-prompt
packing, with `shape_reuse` choosing the packed length) -> reference / old log-probs;
`train_step` is the jitted update (log-probs, losses, gradient accumulation, the optimiser),
`minibatch` one minibatch of it. Every jitted function of a step is built here.

May import: `algorithms`, `models`, `rollout`, `rewards`, `distributed`, `infra`,
`config`. Nothing here runs a loop, saves a checkpoint or prints.
"""
