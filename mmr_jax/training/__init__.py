"""A training run: its build from a config, the loop, checkpoints, how it ends, its exports.

`build` builds a run whole from the typed config, top to bottom (`build.run`: mesh, policy,
tokenizer, prompts and held-out problems from `problem_sets`, optimiser and state, the rollout
engine from `engines`, the jitted update); `trainer` is the loop; `checkpoint` (with
`checkpoint_unstacked`, `checkpoint_read`) saves and restores through Orbax; `workdir_guard` keeps
another config from resuming a run; `shutdown` and `hf_export` finish a run; `own_process` runs
one in a child process; `compiled_dry_run` compiles a config's real steps for a virtual pod.

May import: `step` and everything below it, `problems`, `infra`. Not imported by anything
below it; `studies` and `scripts/` import it.
"""
