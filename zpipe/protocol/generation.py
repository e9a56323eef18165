"""The messages of a pipelined generation run (zpipe.coordinator.runs.generation,
zpipe.stage.executors.generation, zpipe.client.runs.generation)::

    client -> coordinator  gen_run_request  the model, its partition or stages, the run's
                                            limits (context, sequences, steps in flight)
    coordinator -> stage   gen_setup        its units, its neighbours (names, endpoints,
                                            keys), the run's limits
    stage -> coordinator   gen_ready        built (or why not)
    coordinator -> client  gen_run_ready    where to send sequences, the stages and bounds

    on the stages' data ports (and the client's sink)
    client -> first stage  gen_submit       a sequence: its prompt (one int64 tensor) and
                                            sampling settings
                           gen_cancel       forget a sequence
                           gen_close        the run is over: every stage frees its caches
                                            (each stage passes it on to the next)
    stage -> next stage    gen_step         one micro-batch: rows (sequence, position,
                                            length, sample index, reservation), the
                                            sampling rows' settings, the packed values
                           gen_free         drop these sequences' caches (passed on)
    last -> first stage    gen_tokens       the token sampled for each sampling row of a
                                            step (the ring)
    stage -> next stage    gen_step_failed  a step a stage could not compute, passed on
                                            round the ring to the first stage
    first stage -> client  gen_token_batch  a step's events, one per sequence that
                                            produced a token in it
                           gen_token        one event of a sequence's stream (an older
                                            first stage's; the client takes both)
                           gen_refused      a sequence the first stage refused, and
                                            the kind of refusal

Rows and sampling settings travel as plain lists; zpipe.generation.wire reads them
(with their meaning, and every value checked).
"""

from __future__ import annotations

from typing import Any, ClassVar

from zpipe.protocol._schema import (
    INT,
    LIST,
    MAP,
    NUM,
    OPT_BOOL,
    OPT_INT,
    OPT_LIST,
    OPT_STR,
    STR,
    TensorMessage,
    WireMessage,
    wire,
    wire_message,
)

# ----------------------------------------------------------------- control


@wire_message
class GenRunRequest(WireMessage):
    """Client -> coordinator: start a generation run. ``partition``: units per stage, in
    order (None: the planner's split over the stages, within their memory)."""

    KIND: ClassVar[str] = "gen_run_request"
    model: dict[str, Any] = wire(MAP)
    sink_endpoint: str = wire(STR)
    max_context: int = wire(INT)
    max_sequences: int = wire(INT)
    steps_in_flight: int = wire(INT)
    chunk_tokens: int = wire(INT)
    wait_for_stages_s: float = wire(NUM)
    stages: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    stage_names: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    partition: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    # each stage's KV cache budget (None: room for max_sequences x max_context tokens)
    kv_budget_bytes: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    dtype: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    # the first stage streams text and honours stop strings, with the tokenizer of
    # the model's checkpoint directory
    text: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class GenSetup(WireMessage):
    """Coordinator -> stage: hold units ``[start, end)`` of ``model`` for run ``run``.

    ``upstream``: who sends this stage steps (the previous stage; for the first
    stage, the last one, whose tokens close the ring, or "" alone); ``downstream``:
    where its output goes (the next stage; for the last, the first stage; "" alone).
    The first stage also takes the client's sequences and streams to its sink
    (``sink_endpoint``, ``client_key``) and runs the scheduler (``kv_budget_tokens``:
    the tokens every stage's cache holds at once, the smallest stage's)."""

    KIND: ClassVar[str] = "gen_setup"
    run: int = wire(INT)
    model: dict[str, Any] = wire(MAP)
    start: int = wire(INT)
    end: int = wire(INT)
    index: int = wire(INT)
    num_stages: int = wire(INT)
    upstream: str = wire(STR)
    downstream: str = wire(STR)
    max_context: int = wire(INT)
    max_sequences: int = wire(INT)
    steps_in_flight: int = wire(INT)
    chunk_tokens: int = wire(INT)
    upstream_key: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    downstream_endpoint: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    downstream_key: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    sink_endpoint: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    client_key: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    kv_budget_bytes: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    kv_budget_tokens: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    dtype: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    text: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)  # the first stage's
    # the data endpoint of whoever sends this stage steps (the upstream stage's; the
    # first stage's is the last one's): without keys, its host is what the data port
    # admits (with the client's, at ``sink_endpoint``, for the first stage)
    upstream_endpoint: str | None = wire(OPT_STR, default=None, omit_if_none=True)


@wire_message
class GenReady(WireMessage):
    """Stage -> coordinator: the setup is built (``error`` empty) or refused."""

    KIND: ClassVar[str] = "gen_ready"
    run: int = wire(INT)
    name: str = wire(STR)
    error: str = wire(STR)


@wire_message
class GenRunReady(WireMessage):
    """Coordinator -> client: the run is set up. ``bounds``: ``[start, end)`` of each
    stage of ``stages``, in order."""

    KIND: ClassVar[str] = "gen_run_ready"
    run: int = wire(INT)
    stages: list[Any] = wire(LIST)
    bounds: list[Any] = wire(LIST)
    first_endpoint: str = wire(STR)
    first_stage: str = wire(STR)
    first_key: str | None = wire(OPT_STR, default=None, omit_if_none=True)


# ----------------------------------------------------------------- data


@wire_message
class GenSubmit(TensorMessage):
    """Client -> first stage: a new sequence; its prompt is the first int64 tensor.
    ``params``: its SamplingParams (zpipe.generation.wire). A sequence sent again
    after a re-plan carries the tokens it already streamed as a second int64 tensor
    (the stream goes on at the next index)."""

    KIND: ClassVar[str] = "gen_submit"
    run: int = wire(INT)
    sequence: int = wire(INT)
    src: str = wire(STR)
    params: dict[str, Any] = wire(MAP)


@wire_message
class GenCancel(WireMessage):
    KIND: ClassVar[str] = "gen_cancel"
    run: int = wire(INT)
    sequence: int = wire(INT)
    src: str = wire(STR)


@wire_message
class GenClose(WireMessage):
    """The run is over: free every cache and stop (each stage passes it downstream)."""

    KIND: ClassVar[str] = "gen_close"
    run: int = wire(INT)
    src: str = wire(STR)


@wire_message
class GenStep(TensorMessage):
    """Stage -> next stage: step ``step``'s rows and the packed values they feed
    (token ids into the first stage's units, hidden states between stages).
    ``rows``: ``[sequence, position, length, sample_index or null, reserved]`` each;
    ``sampling``: the settings of each row with a sample index, in row order."""

    KIND: ClassVar[str] = "gen_step"
    run: int = wire(INT)
    step: int = wire(INT)
    src: str = wire(STR)
    rows: list[Any] = wire(LIST)
    sampling: list[Any] = wire(LIST)


@wire_message
class GenFree(WireMessage):
    KIND: ClassVar[str] = "gen_free"
    run: int = wire(INT)
    src: str = wire(STR)
    sequences: list[Any] = wire(LIST)


@wire_message
class GenTokens(WireMessage):
    """Last stage -> first stage: the token of each sampling row of ``step``, in order."""

    KIND: ClassVar[str] = "gen_tokens"
    run: int = wire(INT)
    step: int = wire(INT)
    src: str = wire(STR)
    tokens: list[Any] = wire(LIST)


@wire_message
class GenStepFailed(WireMessage):
    """Step ``step`` failed at stage ``stage`` (``error``); passed downstream round the
    ring to the first stage, which ends its ``sequences`` and rebuilds the others'
    caches (zpipe.stage.executors.generation_steps.after_failed_step)."""

    KIND: ClassVar[str] = "gen_step_failed"
    run: int = wire(INT)
    step: int = wire(INT)
    src: str = wire(STR)
    stage: str = wire(STR)
    error: str = wire(STR)
    sequences: list[Any] = wire(LIST)


@wire_message
class GenToken(WireMessage):
    """First stage -> client: generated token ``index`` of ``sequence`` (``finish``: the
    sequence's last, and why)."""

    KIND: ClassVar[str] = "gen_token"
    run: int = wire(INT)
    sequence: int = wire(INT)
    index: int = wire(INT)
    token: int = wire(INT)
    src: str = wire(STR)
    text: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    finish: str | None = wire(OPT_STR, default=None, omit_if_none=True)


@wire_message
class GenTokenBatch(WireMessage):
    """First stage -> client: the events of one step, every sequence's that produced
    one, in the order the client hands them on. ``events``: ``[sequence, index,
    token, text or null, finish or null]`` each (zpipe.generation.wire reads them).
    One message per step rather than one per token: the first stage's event loop
    sends a step's S tokens in one frame."""

    KIND: ClassVar[str] = "gen_token_batch"
    run: int = wire(INT)
    src: str = wire(STR)
    events: list[Any] = wire(LIST)


@wire_message
class GenRefused(WireMessage):
    """First stage -> client: sequence ``sequence`` is refused (``error``: why, in
    words). ``kind``: what a program acts on (zpipe.generation.refusals:
    ``capacity``, ``context_length``, ``bad_request``, ``stage_failed``; absent from
    an older first stage)."""

    KIND: ClassVar[str] = "gen_refused"
    run: int = wire(INT)
    sequence: int = wire(INT)
    src: str = wire(STR)
    error: str = wire(STR)
    kind: str | None = wire(OPT_STR, default=None, omit_if_none=True)


MESSAGES: tuple[type[WireMessage], ...] = (
    GenRunRequest,
    GenSetup,
    GenReady,
    GenRunReady,
    GenSubmit,
    GenCancel,
    GenClose,
    GenStep,
    GenFree,
    GenTokens,
    GenStepFailed,
    GenToken,
    GenTokenBatch,
    GenRefused,
)
