"""The data plane: micro-batches stage to stage, losses and failures back, all-reduce.

On the stages' PUSH/PULL data sockets (and the client's sink)::

    data     activations of micro-batch ``mb`` (training pieces: ``rows`` [lo, hi) of
             a micro-batch of ``total`` rows, which data-parallel groups split);
             with ``end`` (asynchronous training), no batch from ``mb`` on follows
    grad     the gradient of the receiver's outputs
    labels   labels for the last stage (``samples``: the mini-batch's size, which
             the loss is averaged over)
    loss     a micro-batch's loss, last stage -> client
    error    a micro-batch that failed: ``stage`` is where, ``src`` the last hop
    allreduce  one segment of one chunk of a data-parallel group's all-reduce
             (zpipe.stage.data_parallel), one tensor frame per dtype bucket

A piece may hold no rows, and then no tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from zpipe.protocol._schema import (
    INT,
    LIST,
    NUM,
    OPT_BOOL,
    STR,
    TensorMessage,
    WireMessage,
    wire,
    wire_message,
)

if TYPE_CHECKING:
    import torch  # annotations only: the protocol imports no torch


@wire_message
class Data(TensorMessage):
    KIND: ClassVar[str] = "data"
    run: int = wire(INT)
    mb: int = wire(INT)
    src: str = wire(STR)
    rows: list[Any] | None = wire(LIST, default=None)
    total: int | None = wire(INT, default=None)
    # asynchronous training: no batch numbered ``mb`` or later follows (no rows)
    end: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)

    @staticmethod
    def of_microbatch(
        *, run: int, mb: int, src: str, tensors: tuple[torch.Tensor, ...], epoch: int
    ) -> Data:
        """A whole micro-batch's activations (no rows, no end): what
        ``Data(run=run, mb=mb, src=src, tensors=tensors, epoch=epoch)`` builds, in one
        update of its dict. An inference stage builds one per micro-batch, and a frozen
        dataclass's ``__init__`` sets each field through ``object.__setattr__``
        (bench/_relay_counts.py --opcodes)."""
        built = object.__new__(Data)
        # the generated __init__'s order: the bases' fields first
        built.__dict__.update(
            epoch=epoch, tensors=tensors, run=run, mb=mb, src=src, rows=None, total=None, end=None
        )
        return built


@wire_message
class Grad(TensorMessage):
    KIND: ClassVar[str] = "grad"
    run: int = wire(INT)
    mb: int = wire(INT)
    src: str = wire(STR)
    rows: list[Any] = wire(LIST)
    total: int = wire(INT)


@wire_message
class Labels(TensorMessage):
    KIND: ClassVar[str] = "labels"
    run: int = wire(INT)
    mb: int = wire(INT)
    src: str = wire(STR)
    samples: int = wire(INT)
    rows: list[Any] = wire(LIST)
    total: int = wire(INT)


@wire_message
class Loss(WireMessage):
    KIND: ClassVar[str] = "loss"
    run: int = wire(INT)
    mb: int = wire(INT)
    step: int = wire(INT)
    loss: float = wire(NUM)
    src: str = wire(STR)


@wire_message
class MicroBatchError(WireMessage):
    """Kind ``error``: a micro-batch that failed at ``stage``; ``src`` is the last hop."""

    KIND: ClassVar[str] = "error"
    run: int = wire(INT)
    mb: int = wire(INT)
    src: str = wire(STR)
    stage: str = wire(STR)
    message: str = wire(STR)


@wire_message
class AllReduce(TensorMessage):
    KIND: ClassVar[str] = "allreduce"
    round: int = wire(INT)
    step: int = wire(INT)
    chunk: int = wire(INT)
    seg: int = wire(INT)
    src: int = wire(INT)


MESSAGES: tuple[type[WireMessage], ...] = (Data, Grad, Labels, Loss, MicroBatchError, AllReduce)
