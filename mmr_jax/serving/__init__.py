"""An OpenAI-compatible HTTP server over the embedded sampler (`scripts/serve.py`).

`server` (the routes), `serve_http` (bodies, lengths, the API key, keep-alive), `serve_limits`
(the vLLM-like limits, each excess a 400 before anything compiles), `serve_batcher` (requests
that arrive together decoded as one batch), `serve_backend` (the sampler, weights and adapters
behind it) and the OpenAI formats: `openai_params` (every accepted parameter honoured or refused
by name), `openai_choices`, `openai_format`, `openai_stream` (chunks sent as they decode). It
serves a checkpoint for evaluation and lets the tests run the vLLM client over real HTTP.

May import: `rollout` (the sampler and engines), `models`, `infra`, `config`. Nothing in the
library imports it: it is an edge, started by scripts/serve.py.
"""
