"""P and D instance pools and the HTTP calls to them; the only module that knows `requests`."""
from __future__ import annotations

import itertools
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import HTTPError as Urllib3Error

from .errors import BadGateway, GatewayError, GatewayTimeout, ServiceUnavailable, UpstreamRejected

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Instance:
    """One engine. `name` (e.g. "prefill[0]") is what clients may see; the URL stays inside."""

    url: str
    role: str
    index: int
    host: str = field(init=False)
    inflight: int = 0

    def __post_init__(self) -> None:
        self.host = urlsplit(self.url).hostname or ""

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


class Pool:
    """The instances of one role and the choice between them."""

    def __init__(self, role: str, urls: list[str]) -> None:
        self.role = role
        self.instances = [Instance(url, role, i) for i, url in enumerate(urls)]
        self._by_url = {i.url: i for i in self.instances}
        self._next = itertools.cycle(self.instances)
        self._lock = threading.Lock()

    def choose(self, prefer: str | None = None) -> Instance:
        """The preferred instance (it holds the conversation's KV) if known, else round robin."""
        if prefer in self._by_url:
            return self._by_url[prefer]
        with self._lock:
            return next(self._next)


class Stream:
    """An open streamed response from an engine; iterate its raw bytes, always `close()`."""

    def __init__(self, response: requests.Response, instance: Instance) -> None:
        self._response = response
        self.instance = instance
        self.content_type = response.headers.get("Content-Type", "text/event-stream")

    def chunks(self) -> Iterator[bytes]:
        """Bytes as they arrive; `read1` returns whatever is buffered instead of filling a block."""
        raw = self._response.raw
        try:
            while True:
                data = raw.read1(65536)
                if not data:
                    return
                yield data
        except (Urllib3Error, requests.RequestException, OSError) as exc:
            raise _translate(exc, self.instance) from exc

    def close(self) -> None:
        self._response.close()


def _translate(exc: Exception, instance: Instance) -> GatewayError:
    log.warning("%s (%s) failed: %r", instance.name, instance.url, exc)
    text = str(exc).lower()
    if isinstance(exc, requests.ConnectTimeout):
        return ServiceUnavailable(f"{instance.name} did not accept a connection in time")
    if isinstance(exc, requests.Timeout) or "timed out" in text:
        return GatewayTimeout(f"{instance.name} timed out")
    if isinstance(exc, requests.ConnectionError) and "refused" in text:
        return ServiceUnavailable(f"{instance.name} refused the connection")
    return BadGateway(f"{instance.name} broke the connection")


def _error_message(response: requests.Response) -> str:
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return message
    except (ValueError, AttributeError):
        pass
    return response.reason or f"HTTP {response.status_code}"


class Upstream:
    """One `requests.Session` per process (created after fork) for all calls to the engines."""

    def __init__(self, connect_timeout: float, read_timeout: float, pool_size: int,
                 api_key: str = "") -> None:
        self.session = requests.Session()
        # pool_block=False: a burst above pool_size opens extra connections instead of
        # waiting forever (requests passes no pool timeout).
        adapter = HTTPAdapter(pool_connections=16, pool_maxsize=pool_size, max_retries=0,
                              pool_block=False)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.timeout = (connect_timeout, read_timeout)
        self.api_key = api_key

    def headers(self, request_id: str, authorization: str | None) -> dict[str, str]:
        out = {"X-Request-Id": request_id, "Accept-Encoding": "identity"}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        elif authorization:
            out["Authorization"] = authorization
        return out

    def _post(self, instance: Instance, path: str, body: dict, headers: dict,
              stream: bool) -> requests.Response:
        try:
            response = self.session.post(
                instance.url + path, data=json.dumps(body, ensure_ascii=False).encode(),
                headers={**headers, "Content-Type": "application/json"},
                timeout=self.timeout, stream=stream)
        except requests.RequestException as exc:
            raise _translate(exc, instance) from exc
        if response.status_code >= 400:
            message = _error_message(response)
            response.close()
            log.warning("%s answered %d: %s", instance.name, response.status_code, message)
            if response.status_code < 500:
                raise UpstreamRejected(message, status=response.status_code)
            raise BadGateway(f"{instance.name} failed with HTTP {response.status_code}: {message}")
        return response

    def post_json(self, instance: Instance, path: str, body: dict, headers: dict) -> dict:
        """POST and parse a JSON object reply, or raise a GatewayError."""
        response = self._post(instance, path, body, headers, stream=False)
        try:
            reply = response.json()
        except ValueError as exc:
            raise BadGateway(f"{instance.name} sent a reply that is not JSON") from exc
        if not isinstance(reply, dict):
            raise BadGateway(f"{instance.name} sent a reply that is not a JSON object")
        return reply

    def open_stream(self, instance: Instance, path: str, body: dict, headers: dict) -> Stream:
        """POST and return the open response once its headers arrived, or raise a GatewayError."""
        return Stream(self._post(instance, path, body, headers, stream=True), instance)

    def probe(self, instance: Instance, timeout: float = 1.0) -> bool:
        """Does the instance answer GET /health with 200?"""
        try:
            with self.session.get(instance.url + "/health", timeout=timeout) as response:
                return response.status_code == 200
        except requests.RequestException:
            return False

    def get_json(self, instance: Instance, path: str) -> dict:
        try:
            response = self.session.get(instance.url + path, timeout=self.timeout)
            response.raise_for_status()
            return response.json()
        except (requests.RequestException, ValueError) as exc:
            raise BadGateway(f"{instance.name} did not answer {path}") from exc
