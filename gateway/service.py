"""`Gateway`: one worker's composition root (built after fork), and `complete`, the one call
that runs a completion request: forward or serve → identity → store → P → D → relay."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

from gateway.config import Settings
from gateway.engines.cost import CostModel
from gateway.engines.d_budget import DBudget
from gateway.engines.engine_load import BlockSize, EngineLoad
from gateway.engines.host_counts import HostCounts
from gateway.engines.instances import Instance, Policy, Pool, Prober
from gateway.engines.membership import Membership
from gateway.engines.transport import EngineTransport, still_open
from gateway.engines.upstream import Upstream
from gateway.engines.watch import Watch
from gateway.flow.disagg import Disagg, Work
from gateway.flow.fast_path import FastPath
from gateway.flow.model_pools import ModelPool, ModelPools
from gateway.flow.passthrough import PassThrough, Route, model_of
from gateway.flow.release import Releaser
from gateway.flow.reply import Reply
from gateway.front.admission import Admission, BodyBudget
from gateway.front.anthropic import Edge
from gateway.front.auth import ApiKeys
from gateway.front.owners import Owners
from gateway.front.tenants import NO_TICKET, KeyLimits, Tenants, Ticket
from gateway.parse import ClientRequest, parse
from gateway.reuse.conversation import Conversation, tenant_salt
from gateway.reuse.exactness import Exactness
from gateway.reuse.store import ConversationStore, create_store
from gateway.slots import THREADS_ENV
from gateway.support import logs, metrics
from gateway.support.errors import BadGateway, GatewayError

log = logging.getLogger(__name__)


@dataclass
class Arrival:
    """How a request reached this worker, as much of it as a turn needs (the view reads it off
    the WSGI environ)."""

    route: str  # the path it came on, an app's prefix included: a forward goes there
    port: str  # the port it came on: a worker's private port means it was forwarded
    socket: Any = None  # the client's socket, watched for the client going (gunicorn's)
    model: str = "unknown"  # its model as the metrics label it, once the request was read


class Gateway:
    """Everything one worker process shares between requests; build it after fork."""

    MODELS_TIMEOUT = 5.0  # /v1/models is a metadata call: no engine should take longer

    def __init__(
        self,
        settings: Settings,
        store: ConversationStore | None = None,
        transport: EngineTransport | None = None,
    ) -> None:
        """`store`, `transport`: the conversation store and engine transport to use instead of
        the settings' (tests)."""
        self.settings = settings
        own_store = store is None
        self.store = store if store is not None else create_store(settings)
        concurrency = (
            settings.threads if settings.worker_class == "gthread" else settings.worker_connections
        )
        if (
            settings.upstream_api_key
            and not os.environ.get("GATEWAY_UPSTREAM_API_KEY")
            and settings.upstream_api_key == os.environ.get("OPENAI_API_KEY")
        ):
            # Said where it came from, never what it is: a key an operator did not mean to
            # hand the engines is found this way.
            log.info(
                "the engines get the key in $OPENAI_API_KEY (as the seed proxy does); "
                "--upstream-api-key or GATEWAY_UPSTREAM_API_KEY sets another"
            )
        self.upstream = Upstream(
            settings.connect_timeout,
            settings.read_timeout,
            pool_size=concurrency,
            api_key=settings.upstream_api_key,
            transport=transport,
        )
        policy = Policy(
            routing=settings.routing,
            overload_factor=settings.overload_factor,
            breaker_failures=settings.breaker_failures,
            breaker_cooldown=settings.breaker_cooldown,
            conversations=settings.store_size,
            cost=CostModel(
                settings.route_pull_cost, settings.route_request_tokens, settings.route_move_streams
            ),
        )
        # Each model its own P and D pools (one pool, named "", without --models). Filled from
        # the settings (DNS names resolved), then kept current (gateway.engines.membership).
        specs = settings.model_specs()
        roles = {
            spec.name: {
                role: Pool(role, [], policy, model=spec.name) for role in ("prefill", "decode")
            }
            for spec in specs
        }
        if settings.prefill_on_decode:
            for pools in roles.values():
                pools["prefill"].spill = pools["decode"]
        every_pool = [pool for pools in roles.values() for pool in pools.values()]
        self._every_pool = every_pool
        # What every worker of the host has in flight on each engine, for the costs; outside
        # gunicorn's hooks, this process's alone.
        counts = HostCounts.from_env()
        for pool in every_pool:
            pool.counts = counts
        self._published: set[tuple[str, str]] = set()
        metrics.initialize([spec.name for spec in specs if spec.name])
        # Each worker's view of its engines, published as it applies changes (every half
        # second under gunicorn) and whenever /metrics is asked.
        self.membership = Membership(settings, roles, on_tick=self.publish)
        # Every engine asked at once whether it answers, and again every --probe-interval: the
        # gateway is ready (/health) only once some P and D of a model have answered.
        self.prober = Prober(
            self.upstream.probe, every_pool, settings.probe_interval, self.upstream.served_models
        )
        for pool in every_pool:
            pool.on_down = self.prober.wake
        self.prober.start()
        self.engine_load = EngineLoad(
            lambda instance, timeout: self.upstream.get_bytes(instance, "/metrics", timeout),
            every_pool,
            settings.engine_metrics_interval,
            settings.engine_queue_limit,
            settings.engine_kv_full,
        )
        self.engine_load.start()
        self.owners = Owners(settings, self.upstream)
        # The running worker's threads, if gunicorn runs a threaded one (a host's config may
        # choose it, whatever the app's settings say).
        threads = int(os.environ.get(THREADS_ENV, 0))
        threaded = bool(threads) or settings.worker_class == "gthread"
        limit = settings.turn_limit(threads)
        # Turns of a key under its share wait longer for a place (gateway.front.admission):
        # with gthread each holds a thread, so at most half of those --max-turns leaves free.
        fair: dict[str, Any] = dict(
            fair_wait=settings.admission_fair_wait,
            patient=(
                max(0, (threads or settings.threads) - limit) // 2
                if threaded
                else settings.admission_queue
            ),
        )
        self.admission = Admission(
            limit, settings.admission_queue, settings.admission_wait, settings.retry_after, **fair
        )
        self.bodies = BodyBudget(settings.max_bodies_bytes, settings.retry_after)
        # A request relayed to the worker that owns its conversation holds, for its whole
        # stream, a thread here (gthread: counted with the turns, which need the same threads)
        # or a connection of the worker's pool (gevent: counted apart, within the pool).
        # Uncounted, relays filled every thread while the requests they waited for queued
        # behind them: a deadlock. Its owner admits the turn itself.
        self.relays = (
            self.admission
            if threaded
            else Admission(
                limit,
                settings.admission_queue,
                settings.admission_wait,
                settings.retry_after,
                **fair,
            )
        )
        self.api_keys = ApiKeys(
            settings.api_keys,
            settings.api_keys_file,
            defaults=KeyLimits(settings.key_rpm, settings.key_tpm, settings.key_turns),
        )
        self.tenants = Tenants(settings.store, settings.store_timeout)
        # Tenants apart in the engines' prefix caches as well (auto: where tenants exist).
        self.salted = settings.tenant_cache_salt == "on" or (
            settings.tenant_cache_salt == "auto" and self.api_keys.enabled
        )
        # Entries the store drops unread (replaced, evicted, expired, over budget) and those a
        # turn drops: their D is told to free the blocks, in the background (gateway.flow.release).
        self.releaser = Releaser(
            self.upstream,
            self._prefill_for,
            settings.release_rate,
            sweep=getattr(self.store, "sweep", lambda: None),
        )
        self.store.on_drop = self.releaser.drop
        if own_store:
            # Each D's pinned budget: --pinned-blocks, or derived from what D reports. A local
            # store's workers each keep a share; a shared store keeps one for every host.
            local = settings.store == "local"
            self.store.budget = DBudget(
                settings.pinned_blocks,
                self.engine_load,
                self._decode_at,
                shares=settings.workers if local else 1,
                workers=settings.workers,
                pending=self.releaser.pending,
            )
        self.releaser.start()
        fast_path = FastPath(settings.fast_path_tokens)
        self.pools = ModelPools(
            [
                ModelPool(
                    spec,
                    pools["prefill"],
                    pools["decode"],
                    Disagg(
                        self.store,
                        self.upstream,
                        pools["prefill"],
                        pools["decode"],
                        releaser=self.releaser,
                        attempts=settings.attempts,
                        exactness=self._exactness(pools.values()),
                        fast_path=fast_path,
                        access_log=settings.access_log,
                    ),
                )
                for spec, pools in zip(specs, roles.values(), strict=True)
            ]
        )
        # vLLM's other client routes, passed to an engine of the request's model.
        self.passthrough = PassThrough(self.upstream, self.pools, settings.attempts)
        # The first model's (the only one's, without --models): for embedders and tests.
        first = self.pools.default
        self.prefill, self.decode, self.disagg = first.prefill, first.decode, first.disagg
        self.publish()

    def _exactness(self, pools) -> Exactness:
        """One model's proof of reuse, its partial reuse cut at its engines' block size."""
        settings = self.settings
        return Exactness(
            settings.verify_reuse,
            settings.partial_reuse_tokens,
            BlockSize(settings.kv_block_size, pools, self.engine_load),
        )

    def publish(self) -> None:
        """This worker's view of each engine as gauges: may it be chosen, what runs on it."""
        now = time.monotonic()
        seen: set[tuple[str, str]] = set()
        self.pools.remember()
        for pool in self._every_pool:
            for instance in pool.instances:
                labels = (pool.role, instance.name)
                up = pool.ready(instance) and instance.available(now)
                metrics.ENGINE_UP.labels(*labels).set(1 if up else 0)
                metrics.ENGINE_INFLIGHT.labels(*labels).set(instance.inflight)
                facts = self.engine_load.facts(instance)
                if facts is not None:
                    metrics.ENGINE_KV_BLOCKS.labels(*labels).set(facts.capacity)
                    metrics.ENGINE_BLOCK_SIZE.labels(*labels).set(facts.block_size)
                seen.add(labels)
        for gone in self._published - seen:  # left the pool: nothing runs there, no alarm
            metrics.ENGINE_UP.labels(*gone).set(1)
            metrics.ENGINE_INFLIGHT.labels(*gone).set(0)
            metrics.ENGINE_KV_BLOCKS.labels(*gone).set(0)
            metrics.ENGINE_BLOCK_SIZE.labels(*gone).set(0)
        self._published = seen

    def _decode_at(self, url: str):
        """The D instance at `url`, in whichever model's pool it is (None: in none now)."""
        pool = self.pools.of_decode(url)
        return pool.decode.get(url) if pool is not None else None

    def _prefill_for(self, entry) -> Pool | None:
        """The P pool that can release `entry`: its model's (any P, with one pool)."""
        if self.pools.single:
            return self.prefill
        pool = self.pools.of_decode(entry.decode_url)
        return pool.prefill if pool is not None else None

    def complete(
        self,
        path: str,
        raw: bytes,
        headers: Mapping[str, str],
        arrival: Arrival,
        request_id: str,
        body_held: Callable[[], None] | None = None,
        edge: Edge | None = None,
        endpoint: str = "",
    ) -> Reply:
        """Run one completion request whose whole body is `raw`; raises GatewayError. With
        `edge`, `raw` is another API's request (Anthropic's Messages): run as the chat request
        `edge.chat(raw)` makes of it, its reply made the API's by `edge.reply`; forwarded to
        the conversation's owner as it came, to the route it came on. `endpoint`: the route
        the metrics name, when not `path` (OpenAI's Responses, run as chat).

        The body must be read before this call: bytes still unread in the socket would look to
        the disconnect watcher like a pipelined next request, and it would stop watching.
        The reply's `close` releases what the turn holds (the engine stream, D's in-flight
        count, its admission place, the watcher, and `body_held`, the body's share of the
        worker's body budget, which this call owns from its start): call it when the reply has ended
        or was dropped; a JSON reply comes released.
        """
        held = ExitStack()  # what the turn takes, released last taken first
        if body_held:
            held.callback(body_held)
        try:
            # CPU only: no watcher, no place taken yet
            request = (
                parse(path, raw)
                if edge is None
                else replace(parse(path, edge.chat(raw)), endpoint=edge.endpoint)
            )
            if endpoint:
                request = replace(request, endpoint=endpoint)
            pool, request = self.pools.route(request)  # an unknown model: 404 here
            arrival.model = pool.label(request.body.get("model"))
            metrics.model_seen(arrival.model)
            tenant, limits = self.api_keys.tenant(headers.get("Authorization"))
            conversation = Conversation(request.body, headers, request.conversation_id, tenant)
            owner = (
                self.owners.forward_to(conversation.root())
                if self.owners.may_forward(arrival.port)
                else None
            )
            # Its key's requests and tokens per minute, where the turn runs; then a place for
            # this turn or its relay. Either way 429 with nothing started. Charged once an
            # engine worked for it (`work`), whatever happens after; else given back.
            work = Work()
            ticket = (
                self._counted(held, tenant, limits, len(raw), work) if owner is None else NO_TICKET
            )
            self._admit(
                held,
                self.admission if owner is None else self.relays,
                tenant,
                limits,
                arrival.socket,
            )
            total = self.settings.total_timeout
            held.callback(Watch(arrival.socket, time.monotonic() + total if total else None).stop)
            reply = (
                None
                if owner is None
                else self.owners.forward(owner, arrival.route, raw, headers, arrival.model)
            )
            if reply is not None and body_held:
                body_held()  # relayed: the owner holds the body now, this worker only bytes
            if reply is None:
                if owner is not None:  # its owner is away: served here
                    ticket = self._counted(held, tenant, limits, len(raw), work)
                    if self.relays is not self.admission:
                        self._admit(held, self.admission, tenant, limits, arrival.socket)
                reply = self._serve(
                    pool, request, conversation, headers, request_id, work, arrival.model
                )
                if edge is not None:
                    reply = edge.reply(reply)
                if ticket is not NO_TICKET:
                    reply.headers.update(ticket.headers)
                    held.callback(_charge(ticket, reply))
        except BaseException:
            _release(held.close)  # the error the client sees is the one that stopped it
            raise
        return _holding(held, reply)

    def relay(
        self, target: Instance, route: str, raw: bytes, headers: Mapping[str, str], arrival: Arrival
    ) -> Reply | None:
        """Relay a request to `target`, the worker that holds what it names (a stored
        response's chain: gateway.responses.route), within this worker's relay places and
        watch; None if that worker is away. Its owner counts and admits the turn itself."""
        held = ExitStack()
        try:
            tenant, limits = self.api_keys.tenant(headers.get("Authorization"))
            self._admit(held, self.relays, tenant, limits, arrival.socket)
            total = self.settings.total_timeout
            held.callback(Watch(arrival.socket, time.monotonic() + total if total else None).stop)
            reply = self.owners.forward(target, route, raw, headers)
        except BaseException:
            _release(held.close)
            raise
        if reply is None:
            _release(held.close)
            return None
        return _holding(held, reply)

    def pass_through(
        self,
        route: Route,
        raw: bytes,
        headers: Mapping[str, str],
        target: str,
        arrival: Arrival,
        request_id: str,
        body_held: Callable[[], None] | None = None,
    ) -> Reply:
        """Run one request of vLLM's other routes (gateway.flow.passthrough) whose whole body
        is `raw`, to `target` (its path and query): to an engine of the model it names, within
        its key's limits and a place among the turns, watched as a turn is; raises
        GatewayError. The reply's `close` releases what it holds, as `complete`'s does."""
        held = ExitStack()
        if body_held:
            held.callback(body_held)
        try:
            model, renamed = model_of(route, raw, headers.get("Content-Type", ""))
            pool, rename = self.pools.find(model)  # an unknown model: 404 here
            if rename is not None:
                raw = renamed(rename)
            arrival.model = pool.label(model)
            tenant, limits = self.api_keys.tenant(headers.get("Authorization"))
            work = Work()
            # Its key's requests; its tokens only where the engine runs the model over text
            # (a JSON body's size / 4 until the engine says; an audio file's bytes are no text).
            text = route.computes and route.body == "json"
            ticket = self._counted(held, tenant, limits, len(raw) if text else 0, work)
            self._admit(held, self.admission, tenant, limits, arrival.socket)
            total = self.settings.total_timeout
            held.callback(Watch(arrival.socket, time.monotonic() + total if total else None).stop)
            engine_headers = self._engine_headers(headers, request_id)
            if headers.get("Content-Type"):  # a form's boundary among it
                engine_headers["Content-Type"] = headers["Content-Type"]
            reply = self.passthrough.run(
                route,
                self.passthrough.pool(route, pool),
                target,
                raw,
                engine_headers,
                request_id,
                work,
            )
            reply.headers.update(ticket.headers)
        except BaseException:
            _release(held.close)
            raise
        return _holding(held, reply)

    def refuse_early(self, headers: Mapping[str, str]) -> None:
        """429 before the body is read, for a key whose requests of this window this worker
        has seen spent."""
        self.tenants.refuse_early(*self.api_keys.tenant(headers.get("Authorization")))

    def _counted(
        self, held: ExitStack, tenant: str, limits: KeyLimits, body_bytes: int, work: Work
    ) -> Ticket:
        """Count the request against its key's limits (429 if over). A turn that ends before
        its reply is charged its prompt tokens if an engine worked for it (P prefilled it, or
        D answered), else given back; a reply's own charge (`_charge`) comes first."""
        ticket = self.tenants.admit(tenant, limits, body_bytes)
        if ticket is not NO_TICKET:

            def settle() -> None:
                if work.done:
                    ticket.charge(
                        work.prompt_tokens if work.prompt_tokens is not None else ticket.estimate
                    )
                else:
                    ticket.refund()

            held.callback(settle)
        return ticket

    @staticmethod
    def _admit(
        held: ExitStack,
        admission: Admission,
        tenant: str,
        limits: KeyLimits,
        client: socket.socket | None,
    ) -> None:
        gone = None if client is None else (lambda: not still_open(client))
        held.callback(admission.enter(tenant, limits.weight, limits.turns, gone))

    def _serve(
        self,
        pool: ModelPool,
        request: ClientRequest,
        conversation: Conversation,
        headers: Mapping[str, str],
        request_id: str,
        work: Work,
        model: str,
    ) -> Reply:
        identity = conversation.identity()
        own_salt = request.body.get("cache_salt")
        if self.salted and (own_salt is None or isinstance(own_salt, str)):
            # (A salt that is not a string goes as sent: the engine answers its 400.)
            salt = tenant_salt(headers.get("Authorization"), own_salt)
            request = replace(request, body={**request.body, "cache_salt": salt})
        return pool.disagg.run(
            request, identity, self._engine_headers(headers, request_id), request_id, work, model
        )

    def _engine_headers(self, headers: Mapping[str, str], request_id: str) -> dict[str, str]:
        """What the engine calls of a request carry: its id, its trace context, a credential."""
        # A client's own key is the gateway's to check, not the engines' (--upstream-api-key).
        client_credential = None if self.api_keys.enabled else headers.get("Authorization")
        return self.upstream.headers(
            request_id,
            client_credential,
            logs.traceparent(headers.get("traceparent")),
            headers.get("tracestate"),
        )

    def models(self) -> dict:
        """/v1/models: with one pool, the list of the first D that answers, healthy ones first;
        with several models, every model's (gateway.flow.model_pools)."""
        if self.pools.single:
            answer = self._ask_models(self.decode)
            if answer is None:
                raise BadGateway("no decode instance answered /v1/models")
            return answer
        return self.pools.listing(self._ask_models)

    def _ask_models(self, pool: Pool) -> dict | None:
        now = time.monotonic()
        for instance in sorted(pool.instances, key=lambda i: not i.available(now)):
            try:
                return self.upstream.get_json(
                    instance, "/v1/models", min(self.MODELS_TIMEOUT, self.settings.read_timeout)
                )
            except GatewayError:
                continue
        return None

    def healthy(self) -> bool:
        """Can this worker serve a turn of some model: a P and a D of it ready (answered their
        last probe: none has before the first)?"""
        return any(pool.healthy() for pool in self.pools.pools)

    def health(self) -> str:
        """ "ok": every model can be served; "degraded": some model (the only one) cannot."""
        return "ok" if all(pool.healthy() for pool in self.pools.pools) else "degraded"

    def status(self, debug: bool = False) -> dict:
        """The detailed report (GET /admin/status): engines, breakers, store, this worker."""
        pools = (
            {pool.role: pool.report() for pool in (self.prefill, self.decode)}
            if self.pools.single
            else {
                "models": {
                    m.name: {
                        "healthy": m.healthy(),
                        "prefill": m.prefill.report(),
                        "decode": m.decode.report(),
                    }
                    for m in self.pools.pools
                }
            }
        )
        return {
            "status": self.health(),
            "worker": self.owners.slot,
            "pid": os.getpid(),
            "affinity": self.owners.enabled,
            # Besides gthread's request pool (which grows with concurrency and stays):
            # the main thread, the prober, request watchers. Under gevent, greenlets.
            "threads": sum(
                not t.name.startswith("ThreadPoolExecutor") for t in threading.enumerate()
            ),
            "watchers": Watch.live,
            **self.admission.report(),
            **(
                {"relays_in_flight": self.relays.inflight}
                if self.relays is not self.admission
                else {}
            ),
            "body_bytes_held": self.bodies.held,
            **self.store.report(),
            **pools,
            **({"greenlets": _greenlets()} if debug else {}),
        }

    def close(self) -> None:
        """Stop the background prober and membership loop, and close pooled engine connections (for
        embedders and tests; a gunicorn worker just exits)."""
        self.prober.stop()
        self.engine_load.stop()
        self.membership.stop()
        self.releaser.stop()
        self.upstream.close()


def _charge(ticket: Ticket, reply: Reply) -> Callable[[], None]:
    """The turn's tokens, counted against its key's tokens per minute once the reply ends."""

    def charge() -> None:
        if reply.decoded is not None:
            ticket.charge(reply.decoded.tokens(ticket.estimate))

    return charge


def _holding(held: ExitStack, reply: Reply) -> Reply:
    """`reply`, its `close` releasing what its request holds (`held`) after what the reply
    holds itself (the stream, the engine's count), once, each step even if one before it
    fails; a reply whose body is whole is released now: it goes out regardless."""
    held.callback(reply.close)
    reply.close = held.close
    if reply.stream is None:
        _release(reply.close)
    return reply


def _release(close) -> None:
    try:
        close()
    except Exception:
        log.exception("releasing a turn failed")


def _greenlets() -> int:
    """Live greenlets (gevent workers' requests and watchers); walks the heap, so only on ask."""
    import gc

    from greenlet import greenlet

    return sum(isinstance(o, greenlet) and not o.dead for o in gc.get_objects())
