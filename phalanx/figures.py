"""The names of the figures Phalanx itself reports for a training process, with the metric
batches, under a prefix that scripts may not use. Shared by the ranks that report them
(`phalanx.train`) and the server that summarises them; standard library only."""

from __future__ import annotations

PREFIX = "phalanx/"
STEP_TIME = PREFIX + "step_time_s"
DATA_TIME = PREFIX + "data_time_s"
COMPUTE_TIME = PREFIX + "compute_time_s"
COMM_EXPOSED = PREFIX + "comm_exposed_s"
COMM_TIME = PREFIX + "comm_time_s"
COMM_BYTES = PREFIX + "comm_bytes_per_step"
COMMUNICATION = (STEP_TIME, DATA_TIME, COMPUTE_TIME, COMM_EXPOSED, COMM_TIME, COMM_BYTES)
