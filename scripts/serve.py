"""OpenAI-compatible server (vLLM's routes and shapes) over the embedded JAX sampler.

    python scripts/serve.py --model=checkpoints/smollm2-135m-instruct --port=8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"model": "checkpoints/smollm2-135m-instruct",
         "prompt": "What is 2 + 3?", "max_tokens": 32, "temperature": 0}'
    curl -N localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
         -d '{"model": "checkpoints/smollm2-135m-instruct",
         "messages": [{"role": "user", "content": "What is 2 + 3?"}], "stream": true}'

Serves one checkpoint on a CPU or TPU host to the official `openai` client (models.list,
completions and chat completions, streamed as they are decoded or not, with log-probs and usage;
docs/serving.md), and speaks the routes the vLLM rollout client uses (/v1/completions,
/v1/models, /health, /reset_prefix_cache, and with --weights_dir /collective_rpc,
/v1/load_lora_adapter, /v1/unload_lora_adapter), so the trainer's `rollout.engine='vllm'` path
runs against it unchanged. Limits (--max_num_seqs, --max_model_len, --max_request_tokens,
--max_body_bytes) answer 400 to requests that ask more; --api_key (or $VLLM_API_KEY) requires
`Authorization: Bearer <key>`. See mmr_jax/serving/server.py for what is and is not supported.
Request and library logs go to --log_file; the console shows the address and warnings
(`--verbosity=0`: everything).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmr_jax.infra import compile_cache, console, user_errors
from mmr_jax.models import hub
from mmr_jax.rollout import padding
from mmr_jax.serving import embedded_backend, request_limits, server

_MODEL = flags.DEFINE_string("model", None, "HF checkpoint folder", required=True)
_NAME = flags.DEFINE_string("served_model_name", None, "model name clients use (default: --model)")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "tokenizer folder (default: --model)")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "bind address")
_PORT = flags.DEFINE_integer("port", 8000, "port (0 = any free port)")
_MAX_LEN = flags.DEFINE_integer("max_model_len", None, "prompt + completion limit")
_SEED = flags.DEFINE_integer("seed", 0, "seeds requests that do not give one")
_DEFAULT_MAX_TOKENS = flags.DEFINE_integer(
    "default_max_tokens",
    None,
    "chat completion limit when a request sets no max_tokens (default: the context's room, as "
    "OpenAI; the sampler's cache and cost grow with it)",
)
_MIN_PROMPTS = flags.DEFINE_integer("min_batch_bucket", 1, "smallest padded prompt count")
_MAX_NUM_SEQS = flags.DEFINE_integer(
    "max_num_seqs", 256, "sequences (prompts x n) decoded together; more in one request: 400"
)
_KV_CACHE_GIB = flags.DEFINE_float(
    "kv_cache_gib",
    2.0,
    "the memory budget: GiB of KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE), allocated at start-up "
    "as slots of max_model_len tokens; requests beyond it wait, one that could never fit is a 400",
)
_MAX_REQUEST_TOKENS = flags.DEFINE_integer(
    "max_request_tokens", 2**18, "a request's prompts x n x (prompt + max_tokens) tokens at most"
)
_MAX_BODY_BYTES = flags.DEFINE_integer("max_body_bytes", 4 * 2**20, "request body size limit")
_API_KEY = flags.DEFINE_string(
    "api_key", None, "key clients send as 'Authorization: Bearer <key>' (default $VLLM_API_KEY)"
)
_WEIGHTS_DIR = flags.DEFINE_string(
    "weights_dir",
    None,
    "turns on /collective_rpc (weight reload) and the LoRA adapter routes, for paths inside this "
    "folder (default: those routes are off)",
)
_LOGPROBS_MODE = flags.DEFINE_enum(
    "logprobs_mode",
    "scaled_logprobs",
    ["scaled_logprobs", "processed_logprobs", "raw_logprobs"],
    "reported log-probs: after temperature (default), also after top-k/top-p renormalised "
    "(vLLM's processed_logprobs), or of the raw logits (vLLM's raw_logprobs)",
)
_FORCE_USAGE = flags.DEFINE_bool(
    "enable_force_include_usage",
    False,
    "every streamed reply carries the usage in every chunk, as if the client had asked "
    "stream_options include_usage and continuous_usage_stats (vLLM's flag of the same name)",
)
_CHUNK_STEPS = flags.DEFINE_integer("stream_chunk_steps", 8, "decode steps between stream chunks")
_BATCH_WAIT_MS = flags.DEFINE_float(
    "batch_wait_ms", 20, "once a request arrives, wait this long for others to batch with it"
)
_LOG_FILE = flags.DEFINE_string(
    "log_file", None, "request and library logs (default: mmr_jax_serve_<pid>.log in the temp dir)"
)


def main(argv):
    del argv
    # SIGTERM is a clean stop (exit 0), as Ctrl-C: while loading, an exit; once serving, the
    # serve loop is asked to end (from a thread: shutdown() waits for the loop) and cleans up.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    log_file = _LOG_FILE.value or os.path.join(
        tempfile.gettempdir(), f"mmr_jax_serve_{os.getpid()}.log"
    )
    log_file = console.setup(log_file)
    hub.resolve_checkpoint(_MODEL.value, "--model")  # a wrong path: one line naming the flag
    started = time.perf_counter()
    compile_cache.enable()
    backend = embedded_backend.EmbeddedBackend.from_pretrained(
        _MODEL.value,
        model_name=_NAME.value or _MODEL.value,
        tokenizer_path=_TOKENIZER.value,
        seed=_SEED.value,
        max_model_len=_MAX_LEN.value,
        buckets=padding.MinSizes(min_prompts=_MIN_PROMPTS.value),
        logprobs_mode=_LOGPROBS_MODE.value,
    )
    backend.enable_slots(  # compiles every program requests use, a line each on stderr
        kv_cache_bytes=int(_KV_CACHE_GIB.value * 2**30),
        max_num_seqs=_MAX_NUM_SEQS.value,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    limits = request_limits.Limits(
        max_num_seqs=_MAX_NUM_SEQS.value,
        max_request_tokens=_MAX_REQUEST_TOKENS.value,
        max_body_bytes=_MAX_BODY_BYTES.value,
    )
    srv = server.OpenAIServer(
        backend,
        host=_HOST.value,
        port=_PORT.value,
        default_max_tokens=_DEFAULT_MAX_TOKENS.value,
        limits=limits,
        api_key=_API_KEY.value or os.environ.get("VLLM_API_KEY"),
        weights_dir=_WEIGHTS_DIR.value,
        chunk_steps=_CHUNK_STEPS.value,
        gather_s=_BATCH_WAIT_MS.value / 1000,
        force_include_usage=_FORCE_USAGE.value,
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: srv.stop_serving())
    ready = time.perf_counter() - started
    print(f"ready in {ready:.1f} s", file=sys.stderr, flush=True)
    try:
        print(f"serving {backend.model_name!r} at {srv.url}", flush=True)  # clients parse it
        print(f"logs: {log_file}", flush=True)
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.shutdown()


if __name__ == "__main__":
    user_errors.run(main)
