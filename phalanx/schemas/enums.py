"""States and choices shared by specs, the agent protocol and API responses (no pydantic here)."""

from __future__ import annotations

import enum


class SlotType(enum.StrEnum):
    CPU = "cpu"
    GPU = "gpu"


class Precision(enum.StrEnum):
    FP32 = "32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"


class JobState(enum.StrEnum):
    QUEUED = "QUEUED"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PRUNED = "PRUNED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES


TERMINAL_JOB_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.PRUNED})


class AgentState(enum.StrEnum):
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    LOST = "LOST"


class NodeState(enum.StrEnum):
    """One node of an allocation, as its agent sees it."""

    ASSIGNED = "ASSIGNED"  # placed; the agent has not launched torchrun yet
    RUNNING = "RUNNING"  # torchrun is up on that agent
    EXITED = "EXITED"  # torchrun ended (exit code recorded); its slots are free again


class StudyState(enum.StrEnum):
    RUNNING = "RUNNING"  # the driver asks for trials and tells their results
    STOPPED = "STOPPED"  # by a user: its running trials were paused (checkpoint and leave); resumable
    COMPLETED = "COMPLETED"  # n_trials done, timeout, or target value reached
    FAILED = "FAILED"  # max_failed_trials reached

    @property
    def is_terminal(self) -> bool:
        return self in (StudyState.COMPLETED, StudyState.FAILED)


class ScalingState(enum.StrEnum):
    RUNNING = "RUNNING"  # one size after another: a job each, killed once measured
    COMPLETED = "COMPLETED"  # every size measured
    FAILED = "FAILED"  # a size could not be measured (its job failed, reported too little, timed out)
    CANCELLED = "CANCELLED"  # by a user: the size being measured was killed

    @property
    def is_terminal(self) -> bool:
        return self is not ScalingState.RUNNING


class TrialState(enum.StrEnum):
    """An Optuna trial's state as Phalanx last told it (Optuna's own names)."""

    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"
    FAIL = "FAIL"


class Direction(enum.StrEnum):
    MINIMIZE = "minimize"
    MAXIMIZE = "maximize"
