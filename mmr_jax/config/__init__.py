"""The run's configuration, from a config file and flags to typed, checked values.

`config_types` (the frozen dataclasses every part receives), `config_checks` (ConfigDict ->
`TrainConfig`, choices and cross-field rules, advisories) and `config_overrides` (config files,
`--config.a.b=v` overrides and their key checks). Config stays at the edge: the math never sees a
ConfigDict.

May import: `models` (the model config's names) and `infra` (`user_errors`: a config error is
told in one line), and nothing else of mmr_jax.
"""
