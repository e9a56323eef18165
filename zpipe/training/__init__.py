"""Training: schedules, all-reduce and the training executor."""
