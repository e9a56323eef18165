"""What a stage runs for each run kind, beside the lifecycle that starts it.

- :mod:`.inference`: the inference loop (receive, compute in a thread, send).
- :mod:`.sync_training`, :mod:`.training_shard`, :mod:`.training_plane`:
  synchronous training (a schedule's actions, round after round), the shard's
  forward, backward and step, and the glue both training kinds share.
- :mod:`.async_training`, :mod:`.async_shard`, :mod:`.async_repartition`:
  asynchronous 1F1B with weight stashing, and its live re-partition.
- :mod:`.lossy`, :mod:`.lossy_passes`, :mod:`.lossy_recovery`,
  :mod:`.lossy_probes`, :mod:`.lossy_peers`, :mod:`.lossy_report`: a stage's part
  of an EdgePipe run; the pass schedule's decisions are the pure
  :mod:`zpipe.lossy.pass_control`.

The same kinds stand side by side in :mod:`zpipe.coordinator.runs` and
:mod:`zpipe.client.runs`.
"""
