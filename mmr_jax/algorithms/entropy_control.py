"""Adaptive entropy coefficient: a bang-bang controller that holds the policy's entropy near a
target (Skywork-OR1 "adaptive entropy control", He et al. 2025, section 3.2). TRL's adaptive
entropy differs: it applies the coefficient only while the entropy is at or below the target,
and raises it at equality (docs/algorithms.md, "Entropy bonus, fixed or adaptive").

After each step k with mean token entropy H_k, with step size delta and bounds [lo, hi]:

    c_{k+1} = clip(c_k + delta * sign(target - H_k), lo, hi)

so the bonus -c * H in the loss grows while the entropy sits below the target and shrinks while
it sits above (no change when equal). Scalars in, scalar out; jit-able.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Control:
    """The controller's constants (hashable: part of the train step's static config)."""

    target: float  # entropy the controller aims at (nats per token), > 0
    step: float  # delta, the coefficient's change per training step, > 0
    low: float  # lower bound of the coefficient, >= 0
    high: float  # upper bound of the coefficient, >= low


def update(coef: jax.Array, entropy: jax.Array, control: Control) -> jax.Array:
    """c_{k+1} from c_k = `coef` and the step's mean token entropy (module docstring).

    Args:
      coef: float32 [] the coefficient used in this step.
      entropy: float [] the step's mean token entropy H_k (no gradient).
      control: target, step size and bounds.

    Returns:
      float32 [] the coefficient of the next step.
    """
    direction = jnp.sign(control.target - jax.lax.stop_gradient(entropy))
    new = coef + control.step * direction.astype(jnp.float32)
    return jnp.clip(new, control.low, control.high).astype(jnp.float32)
