"""Training: schedules, the ring all-reduce's arithmetic and other pure training rules
(the all-reduce's sockets are :mod:`zpipe.stage.data_parallel`)."""
