"""Why a generation run refused a sequence, as a kind a program can act on.

The first stage refuses a sequence (``gen_refused``) for one of a few reasons, and
a caller answers each differently (``zpipe serve``: 400 with a different code, or
500 for a stage's failure). The stage's text explains; the kind decides:

    capacity        its prompt + max_tokens can never fit the run's KV cache
    context_length  its prompt + max_tokens exceed the run's context
    bad_request     anything else wrong with the request (empty prompt, ids
                    outside the vocabulary, bad settings, a duplicate id)
    stage_failed    a step with its tokens failed at a stage (not the request's
                    fault; the run's other sequences go on)
"""

from __future__ import annotations

from typing import Final, Literal

from zpipe._errors import ConfigError

RefusalKind = Literal["capacity", "context_length", "bad_request", "stage_failed"]
CAPACITY: Final = "capacity"
CONTEXT_LENGTH: Final = "context_length"
BAD_REQUEST: Final = "bad_request"
STAGE_FAILED: Final = "stage_failed"
REFUSAL_KINDS: Final[tuple[RefusalKind, ...]] = (
    CAPACITY,
    CONTEXT_LENGTH,
    BAD_REQUEST,
    STAGE_FAILED,
)


class RequestRefused(ConfigError):
    """A request the scheduler refuses, with its :data:`RefusalKind`."""

    def __init__(self, message: str, kind: RefusalKind) -> None:
        super().__init__(message)
        self.kind: RefusalKind = kind


def refusal_kind(exc: BaseException) -> RefusalKind:
    """The kind of a refusal the first stage caught while taking a request: the
    scheduler's own where it said one, else the request's fault."""
    return exc.kind if isinstance(exc, RequestRefused) else BAD_REQUEST


def kind_from_wire(value: object) -> RefusalKind | None:
    """A ``gen_refused``'s kind as this side knows it; None when a peer sent none (an
    older first stage) or one this version does not know (a newer one's)."""
    for kind in REFUSAL_KINDS:
        if value == kind:
            return kind
    return None
