"""A training run: its build from a config, the loop, checkpoints, how it ends, its exports.

`build` turns the typed config into the run's parts (mesh, policy, optimiser, engine) and
`problem_sets` into its prompts and held-out problems; `trainer` is the loop; `checkpoint` (with
`checkpoint_unstacked`, `checkpoint_read`) saves and restores through Orbax; `workdir_guard` keeps
another config from resuming a run; `shutdown` and `hf_export` finish a run; `own_process` runs
one in a child process; `compiled_dry_run` compiles a config's real steps for a virtual pod.

May import: `step` and everything below it, `problems`, `infra`. Not imported by anything
below it; `studies` and `scripts/` import it.
"""
