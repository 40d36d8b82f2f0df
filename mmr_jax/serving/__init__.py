"""An OpenAI-compatible HTTP server over the embedded sampler (`scripts/serve.py`).

`server` (the routes), `http` (bodies, lengths, the API key, keep-alive), `request_limits`
(the vLLM-like limits, each excess a 400 before anything compiles), `slot_scheduler`
(continuous batching over a KV cache of slots sized by one memory budget: `slot_grid`, its
programs compiled at start-up, `slot_programs`, `slot_engine`), `batching` (jobs, updates,
and whole batches for backends that generate them whole), `embedded_backend` (the sampler,
weights and adapters behind it) and the OpenAI formats: `request_models` (the completion and
chat bodies as pydantic models: every accepted parameter typed, the others refused by name),
`openai_params` (a validated body against the model served -> a request), `openai_choices`,
`openai_format`, `openai_stream`
(chunks sent as they decode). It serves a checkpoint for evaluation and lets the tests run the
vLLM client over real HTTP.

May import: `rollout` (the sampler and engines), `models`, `infra`, `config`. Nothing in the
library imports it: it is an edge, started by scripts/serve.py.
"""
