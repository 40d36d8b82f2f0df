"""The named errors of a multi-process run: each stops it before a step, or stops every process."""

from __future__ import annotations


class DistributedError(RuntimeError):
    """A multi-process run cannot start or go on."""


class ProcessIdError(DistributedError, ValueError):
    """--process_id is not in [0, --num_processes)."""


class CoordinatorUnreachableError(DistributedError):
    """No coordinator answered at --coordinator_address within the start-up timeout."""


class ConfigMismatchError(DistributedError):
    """The processes of one run were started with different configs."""


class BatchSplitError(DistributedError, ValueError):
    """The batch's prompts do not split evenly over the processes."""


class RolloutUrlError(DistributedError, ValueError):
    """`rollout.url` lists neither one URL nor one per process, or one server for several training
    processes (each would reload it and reset its prefix cache in the middle of the others'
    requests)."""


class PeerLostError(DistributedError):
    """Another process of the run died (its collectives failed); this one stops too."""
