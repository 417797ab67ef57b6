"""OpenAI's Responses API on the P/D flow: `POST /v1/responses` runs as a chat completion
(the previous response's history expanded, the chat path's identity, reuse and relay), its reply
converted at the edge and kept (`store`); `GET`, `DELETE` and `cancel` of a kept response."""
from __future__ import annotations

import weakref
from typing import Callable, Mapping

from gateway.flow.reply import Reply
from gateway.parse import CHAT
from gateway.responses.chain import Chain, create_chain, not_found
from gateway.responses.items import (RESPONSES, chat_body, input_messages, parse_request,
                                     tool_choice)
from gateway.responses.output import EventStream, Shape, new_id, response_of
from gateway.reuse.conversation import tenant_of
from gateway.service import Arrival, Gateway
from gateway.support import jsonio
from gateway.support.errors import BadGateway, BadRequest, GatewayError

_OF: "weakref.WeakKeyDictionary[Gateway, Responses]" = weakref.WeakKeyDictionary()


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

    def create(self, raw: bytes, headers: Mapping[str, str], arrival: Arrival,
               request_id: str, body_held: Callable[[], None] | None = None) -> Reply:
        """One request: the chat request made of it, run by `Gateway.complete` (which owns
        `body_held` from its call on), its reply converted."""
        try:
            request = parse_request(raw)
            tenant = tenant_of(headers.get("Authorization"))
            previous = None
            if request.previous_response_id is not None:
                previous = self.chain.get(tenant, request.previous_response_id)
                if previous is None:
                    raise not_found(request.previous_response_id)
            messages = input_messages(request, previous)
            chat = chat_body(request, messages)
        except BaseException:
            if body_held:
                body_held()
            raise
        shape = Shape(request.body, new_id("resp"), chat.get("model"), tool_choice(request.body))

        def keep(response: dict) -> None:
            if request.store:
                try:
                    self.chain.put(tenant, shape.id, {"messages": messages,
                                                      "response": response})
                except GatewayError:
                    pass       # counted and logged: the reply goes out, the response unkept

        # Forwarded to the conversation's owner worker, it goes there as the chat request it
        # now is (the owner answers chat; it is converted here).
        arrival.route = arrival.route[:len(arrival.route) - len(RESPONSES)] + CHAT
        reply = self.gateway.complete(CHAT, jsonio.dumps(chat), headers, arrival, request_id,
                                      body_held, endpoint=RESPONSES)
        content_type = reply.headers.get("Content-Type") or reply.content_type
        if reply.status != 200:
            return reply           # an engine's or an owner's error, in OpenAI's envelope
        if reply.stream is not None and content_type.startswith("text/event-stream"):
            reply.headers.pop("Content-Type", None)
            reply.stream = EventStream(shape, keep).convert(reply.stream)
            reply.content_type = "text/event-stream"
            return reply
        body = reply.body
        if reply.stream is not None:       # an owner worker's JSON, relayed as bytes
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
        response = response_of(shape, body)
        keep(response)
        reply.headers.pop("Content-Type", None)
        reply.body, reply.content_type = response, "application/json"
        return reply

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
