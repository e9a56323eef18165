"""The coordinator: a thin I/O shell around pure controllers.

::

    server.Coordinator   the shell: ROUTER socket, CURVE keys, timers, state files;
        │                parses each message into its protocol class, which
        │                becomes an event (events.py), and carries out the
        │                commands (commands.py)
        ├─ jobs.JobRunner      gathers (profiles, link probes, waiting for stages)
        │                      and planning off the event loop, fed back as events
        └─ core.CoordinatorCore     pure: membership, registration, liveness,
              │                     deaths, routing to the run; flows.FlowRunner
              │                     drives every multi-step conversation
              ├─ starting          run_request -> plan -> a run controller
              ├─ inference.InferenceController   a stream: assign, connect, recover
              └─ training.SyncTrainingController  1F1B/GPipe training: replicas,
                                                  rebalancing, admission

Where a decision is made: who is alive or dead, :mod:`~zpipe.coordinator.membership`;
which stages a run gets, how a plan is repaired, where a resumed stage gets its
units' weights, :mod:`~zpipe.coordinator.decisions` (calling :mod:`zpipe.recovery`);
when a training run changes shape, :mod:`~zpipe.coordinator.runs.sync_balance`.
A new run kind is a new controller module with the interface of
:class:`~zpipe.coordinator.runs.base.RunController`.
"""
