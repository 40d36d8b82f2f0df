"""Entry point of a grading worker subprocess: `python -m mmr_jax.rewards._worker TIMEOUT_S`."""

import sys

from mmr_jax.rewards import grading

if __name__ == "__main__":
    grading.serve(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
