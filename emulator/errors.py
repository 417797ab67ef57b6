"""Emulator errors and the vLLM/OpenAI error envelope each one becomes."""

from __future__ import annotations


class EngineError(Exception):
    """An error with its HTTP status and OpenAI error type; `envelope()` is the response body."""

    code = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def envelope(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(EngineError):
    code = 400
    type = "BadRequestError"


class NotFound(EngineError):
    code = 404
    type = "NotFoundError"


class MethodNotAllowed(EngineError):
    code = 405
    type = "MethodNotAllowed"


class NotImplementedByEmulator(EngineError):
    """vLLM serves this; the emulator does not (vLLM's NotImplementedError is a 501 too)."""

    code = 501
    type = "NotImplementedError"


class Unavailable(EngineError):
    code = 503
    type = "ServiceUnavailableError"


class InternalError(EngineError):
    pass


class KVLoadError(InternalError):
    """A pull failed and --kv-load-failure-policy is fail (vLLM's default)."""


class ClientGone(EngineError):
    """The client left before the request was scheduled; nobody reads the answer."""

    code = 499
    type = "ClientClosedRequest"
