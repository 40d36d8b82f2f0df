"""Problems: where prompts come from and how a policy is measured on them.

`data` (problem files, prompts, generated arithmetic), `data_sources` (the public datasets by
name and offline folders), `tasks` (named training tasks with held-out sets) and `evaluation`
(n samples per problem, math-verify grading, unbiased pass@k per benchmark).

May import: `rewards`, `rollout` (the engine interface), `distributed`, `infra`.
"""
