"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from typing import Any

from zpipe._errors import ZpipeError
from zpipe.generation.refusals import CAPACITY, CONTEXT_LENGTH, STAGE_FAILED


class ApiError(ZpipeError):
    """A request the endpoint refuses, as OpenAI's API would: 400 for a bad value
    (``type`` ``invalid_request_error``, ``param`` the field), 404 for an unknown
    model or path, 405 for a wrong method, 504 when the backend stalls."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response (and of an error event in a stream)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_value(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(message, status=400, param=param, code=code)


def unknown_model(name: object) -> ApiError:
    return ApiError(
        f"The model {name!r} does not exist",
        status=404,
        param="model",
        code="model_not_found",
    )


def context_length_exceeded(param: str, prompt: int, completion: int, limit: int) -> ApiError:
    return ApiError(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the prompt, {completion} for the "
        "completion). Please reduce the prompt or the completion length.",
        status=400,
        param=param,
        code="context_length_exceeded",
    )


def backend_timeout(seconds: float) -> ApiError:
    return ApiError(
        f"the model produced no token within {seconds:g} s",
        status=504,
        type="timeout_error",
        code="backend_timeout",
    )


# ------------------------------------------------------- a cluster's failures
# (zpipe.serve.cluster_backend): what the generation run says, in the API's shape


def sequence_refused(error: str, kind: str | None) -> ApiError:
    """A sequence the cluster's first stage refused: ``gen_refused``'s ``kind``
    (zpipe.generation.refusals) chooses the status and code, its text is the message.
    A refusal without a kind (an older first stage's) is the request's: 400."""
    if kind == STAGE_FAILED:
        return ApiError(
            f"the cluster failed while generating: {error}",
            status=500,
            type="server_error",
            code="stage_failed",
        )
    if kind == CAPACITY:
        return ApiError(
            f"the cluster cannot hold this request: {error}",
            status=400,
            param="max_tokens",
            code="capacity_exceeded",
        )
    if kind == CONTEXT_LENGTH:
        return ApiError(error, status=400, param="max_tokens", code="context_length_exceeded")
    return ApiError(
        f"the cluster refused the request: {error}", status=400, code="sequence_refused"
    )


def cluster_unavailable(error: object) -> ApiError:
    """The generation run could not start, or was lost (a stage or the coordinator
    gone, the stages taken by another run); the next request starts a new one."""
    return ApiError(
        f"the cluster cannot generate now: {error}",
        status=503,
        type="server_error",
        code="cluster_unavailable",
    )


def cluster_timeout(seconds: float) -> ApiError:
    """The run streamed nothing for ``seconds`` while sequences waited: a stalled or
    dead stage."""
    return ApiError(
        f"the cluster produced no token within {seconds:g} s; its generation run is "
        "restarted for the next request",
        status=504,
        type="timeout_error",
        code="cluster_timeout",
    )
