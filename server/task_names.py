"""The names of the scheduler's Celery tasks: the contract between whoever enqueues (the server's
routes, the scheduler's own passes) and the tasks that `scheduler/tasks.py` registers under them.
Arguments are IDs only."""

SCHEDULE_TASK = "phalanx.schedule"  # no arguments: one placement pass
REAP_TASK = "phalanx.reap"  # no arguments: lost agents, hung attempts, leftover checkpoint deletions
DELETE_CHECKPOINTS_TASK = "phalanx.delete_checkpoints"  # (job_id,)
ADVANCE_STUDY_TASK = "phalanx.advance_study"  # (study_id,)
ADVANCE_STUDIES_TASK = "phalanx.advance_studies"  # no arguments: a pass per running study
ADVANCE_SCALING_TASK = "phalanx.advance_scaling"  # no arguments: a step of every running scaling run
RETENTION_TASK = "phalanx.retention"  # no arguments: old metric points thinned, old log lines deleted
