"""The client's side of each run kind: the data source, the sink, the decisions.

- :mod:`.inference`: an inference stream (source, sink, order, recovery).
- :mod:`.fit`: :func:`~zpipe.client.fit`, training from Python; its attempts'
  decisions are the pure :mod:`.training_attempts`, one attempt's feed
  :mod:`.sync_training`, and :mod:`.async_training`, :mod:`.async_repartition`
  the asynchronous kind's attempt and live re-partition.
- :mod:`.lossy`: an EdgePipe run on ordinary stages.

The same kinds stand side by side in :mod:`zpipe.coordinator.runs` and
:mod:`zpipe.stage.executors`.
"""
