"""Studies: grids of training runs with seeds, their paired statistics and reports.

`study` runs a grid (resumable, one run at a time), `on_hosts` the same on several hosts,
`design` sizes a study before it runs, `paired_stats` (t intervals, exact sign-flip
p-values) and `reporting` turn finished runs into tables and plots.

May import: `training`, `problems`, `infra`, `distributed`, `config`. The top of the
package: nothing in mmr_jax imports it.
"""
