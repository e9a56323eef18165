"""One pipeline stage: ``python -m zpipe.stage`` on each device.

Where each part lives (decisions in pure modules, I/O in the shells)::

    runtime.StageRuntime        the process: sockets, tasks; carries out commands
      lifecycle.StageLifecycle    pure: registration, assignments, liveness, which
                                  data message is computed, restart-or-fail
        commands                    what it asks the shell to do (send, start a job, ...)
      supervision                 receive loops that survive one bad message;
                                  tasks that never die silently
      ports                       control / data / probe sockets and keys
      coordinator_link            messages to the coordinator (control or bulk
                                  connection), the coordinator's clock
      jobs.StageJobs              long requests beside the control loop
      dataplane.DataPlane         the assignment being built, the one running
        assignment                  building shards (kept for a repeated run)
          emulated_compute            --emulate-compute: shards that sleep for their
                                      profiled time and ship the real shapes
        dataport.DataPort           data in: key, framing, sender and epoch checks
        inference.InferenceLoop     receive -> compute (thread) -> send
        training_plane.TrainingPlane  neighbours, ring, sends of a training run
          trainer.TrainingExecutor      runs the schedule's F/B/ALLREDUCE/STEP actions
          async_trainer.AsyncTrainingExecutor  asynchronous 1F1B (F/B/STEP/AGG, the
                                        feed's end), over async_shard.AsyncShard
          data_parallel.RingAllReduce   the data-parallel group's gradient ring
                                        (its arithmetic: training.ring)
      snapshots.SnapshotService   weights, backups and unit fetches for recovery
        held_copies.CopyHolder      the snapshots and peers' copies held here, and
                                    the peer requests that keep or fetch them
          peer_policy                 pure: whose backups are kept, who may fetch units
      measurements                profiles and link measurements for the planner
      linkprobe.ProbeResponder    the probe port (link probes, peer requests), with
                                  a token bucket per peer (transport.ratelimit)
"""
