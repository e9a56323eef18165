"""One controller per run kind, each sans-IO: events in, commands out.

- :mod:`.base`: what every run kind does alike (connect, end, report a failure)
  and the controller interface the core routes to.
- :mod:`.inference`: an inference stream (PipeEdge).
- :mod:`.sync_training`, :mod:`.sync_balance`: synchronous training (GPipe,
  1F1B-Sync, Asteroid's HPP) and its rebalancing and admission at a replica.
- :mod:`.async_training`, :mod:`.async_replicas`, :mod:`.async_repartition`:
  asynchronous 1F1B (PipeDream, FTPipeHD), its replicas and its live
  re-partition; :mod:`.async_copies`: the copies its stages make without draining.
- :mod:`.lossy`, :mod:`.lossy_remap`, :mod:`.lossy_probe`: an EdgePipe run on
  ordinary stages, its re-mapping after a death and its link measurement.

The same kinds stand side by side in :mod:`zpipe.stage.executors` and
:mod:`zpipe.client.runs`.
"""
