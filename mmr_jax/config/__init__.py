"""The run's configuration, from a config file and flags to typed, checked values.

`schema` (the frozen dataclasses every part receives), `checks` (ConfigDict ->
`TrainConfig`, choices and cross-field rules, advisories) and `command_line` (config files,
`--config.a.b=v` overrides and their key checks). Config stays at the edge: the math never sees a
ConfigDict.

May import: `algorithms` (its registries' names are the choices of their keys), `models` (the
model config's names) and `infra` (`user_errors`: a config error is told in one line), and nothing
else of mmr_jax.
"""
