"""The `GatewayError` hierarchy, and the one place an error becomes the OpenAI error envelope:
a response (as Werkzeug's `HTTPException.get_response`) or, mid-stream, a final SSE event.
Every JSON body the gateway answers with is serialized here too (`json_response`)."""

from __future__ import annotations

from collections.abc import Callable

from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response

from gateway.support import jsonio


def clip(text: str, limit: int = 200) -> str:
    """What a message quotes of a client (a model's name, an engine's echo of one), at most
    `limit` characters: a body of 32 MiB must not become a log line, or an error, of as much."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class GatewayError(Exception):
    """An error a client sees; subclasses fix the HTTP status and the OpenAI error type."""

    status = 500
    type = "internal_error"
    # Did the engine fail (count it against the instance, try another)? Not for the client's
    # own mistakes, its disconnect, or the request's deadline.
    instance_fault = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        instance_fault: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        if instance_fault is not None:
            self.instance_fault = instance_fault

    @classmethod
    def from_http(cls, exc: HTTPException) -> GatewayError:
        """Werkzeug's own errors (404 route, 405 method, ...) in this hierarchy."""
        status = exc.code or 500
        kind = BadRequest if status < 500 else GatewayError
        return kind(exc.description or exc.name, status=status)

    def envelope(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }

    def headers(self) -> dict[str, str]:
        """Response headers this error adds (Retry-After, WWW-Authenticate)."""
        return {}

    def response(
        self, request_id: str | None = None, envelope: Callable[[GatewayError], dict] | None = None
    ) -> Response:
        """This error as the client's HTTP response (in `envelope`'s shape: another API's)."""
        response = json_response(
            self.envelope() if envelope is None else envelope(self), self.status
        )
        response.headers.update(self.headers())
        if request_id:
            response.headers["X-Request-Id"] = request_id
        return response


def json_response(body: object, status: int = 200) -> Response:
    """A JSON reply as the gateway sends them all: compact, one line, as vLLM's, whatever JSON
    settings the Flask app it is mounted on has (its jsonify would apply them)."""
    data = jsonio.dumps(body) + b"\n"
    return Response(data, status=status, content_type="application/json")


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"

    def __init__(self, message: str, allowed: list[str]) -> None:
        super().__init__(message)
        self.allowed = allowed

    def headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allowed)}


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"


class Overloaded(GatewayError):
    """This worker has as many turns in flight as it may (admission control): try later."""

    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class UpstreamRejected(GatewayError):
    """An engine refused the request with a 4xx; its status and message go to the client."""

    type = "invalid_request_error"


class BadGateway(GatewayError):
    """An engine failed: refused the connection, broke it, or answered with a 5xx or garbage."""

    status = 502
    type = "upstream_error"
    instance_fault = True


class ClientGone(GatewayError):
    """The client closed its connection; nobody is left to answer (nginx's 499)."""

    status = 499
    type = "client_closed_request"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    instance_fault = True


class GatewayTimeout(GatewayError):
    status = 504
    type = "timeout"
    instance_fault = True


def error_event(error: GatewayError, done: bool = True) -> bytes:
    """The SSE error event of a stream that failed after its first byte, then [DONE]."""
    event = b"data: " + jsonio.dumps(error.envelope()) + b"\n\n"
    return event + b"data: [DONE]\n\n" if done else event
