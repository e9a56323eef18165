"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

import re
from typing import Any

from zpipe._errors import ZpipeError


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

# the first stage's words for a step a stage could not compute (gen_refused after
# gen_step_failed, zpipe.stage.executors.generation); any other refusal is the
# request's: the scheduler's checks of its prompt and settings
_STEP_FAILED = re.compile(r"^step \d+ failed at stage ")


def sequence_refused(error: str) -> ApiError:
    """A sequence the cluster's first stage refused (``gen_refused``'s text)."""
    if _STEP_FAILED.match(error):
        return ApiError(
            f"the cluster failed while generating: {error}",
            status=500,
            type="server_error",
            code="stage_failed",
        )
    if "do not fit the KV cache" in error:
        return ApiError(
            f"the cluster cannot hold this request: {error}",
            status=400,
            param="max_tokens",
            code="capacity_exceeded",
        )
    if "exceed the model's context" in error:
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
