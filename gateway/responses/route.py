"""OpenAI's Responses API on the P/D flow: `POST /v1/responses` runs as a chat completion
(the previous response's history expanded, the chat path's identity, reuse and relay), its reply
converted at the edge and kept (`store`); `GET`, `DELETE` and `cancel` of a kept response."""

from __future__ import annotations

import re
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import cast

import requests

from gateway.flow.reply import Reply
from gateway.parse import CHAT
from gateway.responses.chain import Chain, create_chain, not_found
from gateway.responses.items import RESPONSES, chat_body, input_messages, parse_request, tool_choice
from gateway.responses.output import EventStream, Shape, response_of
from gateway.reuse.conversation import Conversation, tenant_of
from gateway.service import Arrival, Gateway
from gateway.support import jsonio
from gateway.support.errors import BadGateway, BadRequest, GatewayError

_OF: weakref.WeakKeyDictionary[Gateway, Responses] = weakref.WeakKeyDictionary()
# A response id: resp_, its chain's root (the digest its first request's conversation is owned
# by: gateway.front.owners), 16 hex of its own. With several workers and a local store, every
# request naming it goes to the worker that owns that root, which keeps the chain.
_ID = re.compile(r"resp_([0-9a-f]{32})[0-9a-f]{16}")


def root_of(response_id: str | None) -> str | None:
    """The chain's root a response id carries (None: not an id of this gateway's)."""
    found = _ID.fullmatch(response_id or "")
    return found.group(1) if found else None


def responses_of(gateway: Gateway) -> Responses:
    """The worker's Responses, made on first use (a worker that serves none keeps no store)."""
    found = _OF.get(gateway)
    if found is None:
        found = _OF[gateway] = Responses(gateway, create_chain(gateway.settings))
    return found


class Responses:
    """One worker's Responses routes over its `Gateway` and its stored responses."""

    def __init__(self, gateway: Gateway, chain: Chain) -> None:
        self.gateway, self.chain = gateway, chain

    def create(
        self,
        raw: bytes,
        headers: Mapping[str, str],
        arrival: Arrival,
        request_id: str,
        body_held: Callable[[], None] | None = None,
    ) -> Reply:
        """One request: the chat request made of it, run by `Gateway.complete` (which owns
        `body_held` from its call on), its reply converted."""
        try:
            request = parse_request(raw)
            arrival.model = self.gateway.pools.label(request.body.get("model"))  # if relayed
            tenant = tenant_of(headers.get("Authorization"))
            previous = None
            home = root_of(request.previous_response_id)
            if request.previous_response_id is not None:
                reply = self._at_home(home, raw, headers, arrival, body_held)
                if reply is not None:
                    return reply
                previous = self.chain.get(tenant, request.previous_response_id)
                if previous is None:
                    raise not_found(request.previous_response_id)
            messages = input_messages(request, previous)
            chat = chat_body(request, messages)
            if home is None:  # a chain's first response: its conversation's root
                cid = chat.get("conversation_id")
                home = Conversation(
                    {k: v for k, v in chat.items() if k != "conversation_id"}, headers, cid
                ).root()
                reply = self._at_home(home, raw, headers, arrival, body_held)
                if reply is not None:
                    return reply
        except BaseException:
            if body_held:
                body_held()
            raise
        shape = Shape(
            request.body,
            f"resp_{home}{uuid.uuid4().hex[:16]}",
            chat.get("model"),
            tool_choice(request.body),
        )

        def keep(response: dict) -> None:
            if request.store:
                try:
                    self.chain.put(tenant, shape.id, {"messages": messages, "response": response})
                except GatewayError:
                    pass  # counted and logged: the reply goes out, the response unkept

        # Forwarded to the conversation's owner worker, it goes there as the chat request it
        # now is (the owner answers chat; it is converted here).
        arrival.route = arrival.route[: len(arrival.route) - len(RESPONSES)] + CHAT
        reply = self.gateway.complete(
            CHAT, jsonio.dumps(chat), headers, arrival, request_id, body_held, endpoint=RESPONSES
        )
        content_type = reply.headers.get("Content-Type") or reply.content_type
        if reply.status != 200:
            return reply  # an engine's or an owner's error, in OpenAI's envelope
        if reply.stream is not None and content_type.startswith("text/event-stream"):
            reply.headers.pop("Content-Type", None)
            reply.stream = EventStream(shape, keep).convert(reply.stream)
            reply.content_type = "text/event-stream"
            return reply
        body = reply.body
        if reply.stream is not None:  # an owner worker's JSON, relayed as bytes
            try:
                body = b"".join(reply.stream)
            finally:
                reply.close()
            reply.stream = None
        if isinstance(body, bytes):
            try:
                body = jsonio.loads_engine(body)
            except ValueError as exc:
                raise BadGateway("the chat reply was not JSON") from exc
        # why the cast: a 200 chat reply's body is a JSON object (D's, or an owner's parsed).
        response = response_of(shape, cast(dict, body))
        keep(response)
        reply.headers.pop("Content-Type", None)
        reply.body, reply.content_type = response, "application/json"
        return reply

    def _at_home(
        self,
        home: str | None,
        raw: bytes,
        headers: Mapping[str, str],
        arrival: Arrival,
        body_held: Callable[[], None] | None,
    ) -> Reply | None:
        """The reply of the worker that keeps the chain, relayed (several workers, a local
        store); None when it is this one (or away: then this one answers)."""
        owners = self.gateway.owners
        if home is None or not owners.may_forward(arrival.port):
            return None
        target = owners.forward_to(home)
        if target is None:
            return None
        reply = self.gateway.relay(target, arrival.route, raw, headers, arrival)
        if reply is not None and body_held:
            body_held()  # relayed: the owner holds the body now, this worker only bytes
        return reply

    def at_home(
        self, response_id: str, method: str, route: str, port: str, authorization: str | None
    ) -> tuple[int, bytes] | None:
        """GET, DELETE or cancel of a response another worker keeps (several workers, a local
        store): that worker's status and JSON body; None when this worker keeps it (or that
        one is away: then this one answers)."""
        home, owners = root_of(response_id), self.gateway.owners
        target = owners.forward_to(home) if home is not None and owners.may_forward(port) else None
        if target is None:
            return None
        timeout = (self.gateway.settings.connect_timeout, self.gateway.settings.read_timeout)
        try:
            with requests.Session() as session:
                session.trust_env = False  # loopback: never through $HTTP_PROXY
                answer = session.request(
                    method,
                    target.url + route,
                    timeout=timeout,
                    headers={"Authorization": authorization or ""},
                )
        except requests.RequestException:
            return None
        return answer.status_code, answer.content

    def _record(self, response_id: str, authorization: str | None) -> dict:
        record = self.chain.get(tenant_of(authorization), response_id)
        if record is None:
            raise not_found(response_id)
        return record

    def retrieve(self, response_id: str, authorization: str | None) -> dict:
        """GET /v1/responses/{id}: the response as it was answered."""
        return self._record(response_id, authorization)["response"]

    def cancel(self, response_id: str, authorization: str | None) -> dict:
        """POST /v1/responses/{id}/cancel: only a background response can be cancelled, and the
        gateway runs none, so every response it holds has finished: vLLM's 400
        (serving.py L1177-1193)."""
        self._record(response_id, authorization)
        raise BadRequest("Cannot cancel a synchronous response.", param="response_id")

    def delete(self, response_id: str, authorization: str | None) -> dict:
        """DELETE /v1/responses/{id}: forgotten (OpenAI's deletion object)."""
        if not self.chain.delete(tenant_of(authorization), response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
