"""The embedded API: a client that is the data source and sink of runs on a cluster.

pipeline_client  PipelineClient: opens the connection, starts streams and training
connection       ClientConnection: the zmq context, control channel, sink and keys
control          ControlChannel: requests to the coordinator, its failure notices
session          RunSession: one run's handshake, sink loop, failure watch, stalls
infer            InferenceRun: an inference stream's source, results and order
train            fit(): a training run's attempts, the I/O (requests, sockets, clock)
training_attempts  TrainingAttempts: the attempts' decisions, sans-IO (events in,
                 commands out); StepLedger: which loss answers which mini-batch
training_run     TrainingRun: one attempt's feed, losses, replicas and weights
options          InferOptions, TrainOptions: a run's settings, checked when made
reports          InferenceReport, TrainReport: what a finished run looked like
batches          splitting batches, the replayable source of mini-batches
failures         the coordinator's failures as typed errors
runs.generation  GenerationRun, GenerateOptions: a generation run's sequences and events
"""

from __future__ import annotations

from zpipe.client.batches import (
    Batch,
    Outputs,
    TrainBatch,
    as_tensors,
    split_microbatches,
    split_minibatch,
)
from zpipe.client.connection import CLIENT_NAME, ClientConnection
from zpipe.client.options import (
    CONSISTENCIES,
    DEFAULT_REPLICATE_EVERY,
    InferOptions,
    TrainOptions,
)
from zpipe.client.pipeline_client import PipelineClient
from zpipe.client.reports import InferenceReport, RunReport, TrainReport
from zpipe.client.runs.fit import fit
from zpipe.client.runs.generation import GenerateOptions

__all__ = [
    "CLIENT_NAME",
    "CONSISTENCIES",
    "DEFAULT_REPLICATE_EVERY",
    "Batch",
    "ClientConnection",
    "GenerateOptions",
    "InferOptions",
    "InferenceReport",
    "Outputs",
    "PipelineClient",
    "RunReport",  # deprecated alias of InferenceReport
    "TrainBatch",
    "TrainOptions",
    "TrainReport",
    "as_tensors",
    "fit",
    "split_microbatches",
    "split_minibatch",
]
