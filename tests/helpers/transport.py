"""A transport double for the engine calls (`create_app(..., transport=ResponsesTransport())`,
as httpx's `MockTransport` replaces its transport): each call the gateway makes is handed to
`responses`, which the payload tests pin every engine call with (its matchers, its `calls`,
its error naming every mock when none matches), and the mock's reply comes back as an engine's
bytes, read by the gateway's own response class (gateway.engines.transport). Everything above
`Transport.send` is the production path."""

from __future__ import annotations

import io

import requests
from requests.adapters import HTTPAdapter
from requests.models import PreparedRequest
from requests.structures import CaseInsensitiveDict

from gateway.engines.transport import ConnectTimedOut, EngineHTTPResponse, EngineResponse

# Framing is the double's to write: the mock's body is whole.
_FRAMING = {"content-length", "transfer-encoding"}


class Replay:
    """A socket whose reads are `data` (what http.client's response reads from)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(io.BytesIO(self.data))


def reply_from_bytes(raw: bytes, method: str = "POST") -> EngineResponse:
    """An engine's response read from `raw` (a whole HTTP/1.1 reply) as the transport reads one."""
    response = EngineHTTPResponse(Replay(raw), method=method)
    response.begin()
    return EngineResponse(None, None, response)


class ResponsesTransport:
    """Engine calls through `responses`' mocks (requests' `HTTPAdapter.send`, which `responses`
    replaces); requests' errors become the ones the real transport raises for the same failure,
    so the gateway classifies them as it does a real engine's."""

    def __init__(self) -> None:
        self._adapter = HTTPAdapter(max_retries=0)

    def send(self, instance, method, path, body, headers, timeout):
        request = PreparedRequest()
        request.method = method
        request.url = instance.url + path
        request.headers = CaseInsensitiveDict(headers)
        request.body = body
        try:
            reply = self._adapter.send(request, stream=True, timeout=timeout)
            content = reply.raw.read(decode_content=False)
        except requests.ConnectTimeout as exc:
            raise ConnectTimedOut(str(exc)) from exc
        except requests.Timeout as exc:
            raise TimeoutError(str(exc)) from exc
        except requests.RequestException as exc:  # a refusal's OS error stays its cause
            raise ConnectionResetError(str(exc)) from exc
        head = [f"HTTP/1.1 {reply.status_code} {reply.reason or ''}"]
        head += [
            f"{name}: {value}"
            for name, value in reply.raw.headers.items()
            if name.lower() not in _FRAMING
        ]
        head.append(f"Content-Length: {len(content)}")
        raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + content
        return reply_from_bytes(raw, method)

    def close(self) -> None:
        self._adapter.close()
