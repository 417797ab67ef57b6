"""`pd-gateway check`: a preflight on real engines, whether reuse will work and what fixes it."""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from gateway.config import ModelSpec, Settings
from gateway.engines.discovery import Discovery, Resolver
from gateway.engines.engine_load import parse as parse_metrics
from gateway.engines.instances import KV_TRANSFER_CONFIG, Instance, Pool
from gateway.engines.upstream import Upstream
from gateway.flow.disagg import prefill_counts
from gateway.options import ArgumentParser, SettingsError
from gateway.parse import CHAT, ClientRequest
from gateway.reuse.exactness import Exactness
from gateway.reuse.kv_params import clean_params, decode_body, prefill_body
from gateway.support.errors import GatewayError

# D's reply: long enough that what P would read beyond its own prefix cache is well above
# vLLM's kv_recompute_threshold (64 tokens, nixl/base_scheduler.py L168-172).
REPLY_TOKENS = 128
FOLLOW_UP = "Which of the notes matters most, and why?"


def _history(nonce: str) -> list[dict]:
    """A first turn of a few hundred tokens of plain text (many KV blocks), new to every
    engine's prefix cache (the nonce), so that what P reports is what it read."""
    notes = " ".join(
        f"Note {i}: the decode engine keeps the keys and values of this "
        f"conversation after its reply, so that the next turn's prefill can read "
        f"them instead of computing the whole history again."
        for i in range(1, 13)
    )
    return [{"role": "user", "content": f"Preflight {nonce}. {notes} Summarise the notes."}]


@dataclass
class Engine:
    """What one engine says of itself: GET /health, /v1/models and /metrics."""

    instance: Instance
    reachable: bool = False
    models: list[str] | None = None
    block_size: int = 0  # 0: not said (vllm:cache_config_info)
    capacity: int = 0  # blocks
    prefix_caching: bool | None = None

    def as_dict(self) -> dict:
        i = self.instance
        return {
            "name": i.name,
            "role": i.role,
            "model": i.model,
            "url": i.public_url,
            "reachable": self.reachable,
            "models": self.models,
            "block_size": self.block_size or None,
            "capacity": self.capacity or None,
            "prefix_caching": self.prefix_caching,
        }


@dataclass
class Check:
    status: str  # "ok", "warn" (reuse works, less well) or "fail" (reuse will not work)
    subject: str
    message: str
    fix: str = ""


@dataclass
class Report:
    engines: list[Engine] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def add(self, status: str, subject: str, message: str, fix: str = "") -> None:
        self.checks.append(Check(status, subject, message, fix))

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.checks)

    @property
    def ok(self) -> bool:
        return not self.count("fail")

    def verdict(self) -> str:
        failures, warnings = self.count("fail"), self.count("warn")
        counts = (
            f"{failures} failure{'s' * (failures != 1)}, {warnings} warning{'s' * (warnings != 1)}"
        )
        return f"reuse will work ({counts})" if self.ok else f"reuse will NOT work ({counts})"

    def text(self) -> str:
        lines = []
        for engine in self.engines:
            i = engine.instance
            lines.append(f"{i.name}  {i.public_url}")
            if not engine.reachable:
                lines.append("  reachable       no")
                continue
            caching = {True: "on", False: "off", None: "not said"}[engine.prefix_caching]
            lines += [
                "  reachable       yes (GET /health 200)",
                f"  models          {', '.join(engine.models or []) or 'not listed'}",
                f"  block size      {engine.block_size or 'not said'}",
                "  capacity        "
                + (f"{engine.capacity} blocks" if engine.capacity else "not said"),
                f"  prefix caching  {caching}",
            ]
        lines.append("")
        for check in self.checks:
            status = "FAIL" if check.status == "fail" else check.status
            lines.append(f"{status:5} {check.subject}: {check.message}")
            if check.fix:
                lines.append(f"      fix: {check.fix}")
        lines += ["", self.verdict()]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "verdict": self.verdict(),
            "engines": [e.as_dict() for e in self.engines],
            "checks": [vars(c) for c in self.checks],
        }


class Checker:
    """Asks each engine what it is, then runs one real P -> D -> P turn per D."""

    def __init__(self, upstream: Upstream, timeout: float) -> None:
        self.upstream = upstream
        self.timeout = timeout
        self.report = Report()

    def inspect(self, instance: Instance) -> Engine:
        engine = Engine(instance)
        self.report.engines.append(engine)
        engine.reachable = self.upstream.probe(instance, self.timeout)
        if not engine.reachable:
            self.report.add(
                "fail",
                instance.name,
                f"not reachable: GET {instance.public_url}"
                f"/health did not answer 200 within {self.timeout:g} s",
                "start the engine, or give its URL (host and HTTP port)",
            )
            return engine
        engine.models = self.upstream.served_models(instance, self.timeout)
        try:
            page = parse_metrics(self.upstream.get_bytes(instance, "/metrics", self.timeout))
        except Exception:  # down, slow, or not vLLM's page: what it says is unknown
            page = None
        facts = page.facts() if page is not None else None
        if facts is not None:
            engine.block_size, engine.capacity = facts.block_size, facts.capacity
            engine.prefix_caching = facts.prefix_caching
        else:
            self.report.add(
                "warn",
                instance.name,
                "GET /metrics has no vllm:cache_config_info: "
                "block size, capacity and prefix caching unknown",
            )
        if engine.prefix_caching is False:
            # vLLM's default is on (config/cache.py L257).
            self.report.add(
                "warn",
                instance.name,
                "prefix caching is off: P recomputes every "
                "history D did not keep, and D recomputes what P sends it",
                "drop --no-enable-prefix-caching (vLLM's default is on)",
            )
        return engine

    def model(self, spec: ModelSpec, model: str, engines: list[Engine]) -> None:
        """Every engine serves the model, and P's and D's block sizes agree."""
        listed = [e for e in engines if e.reachable and e.models is not None]
        for engine in engines:
            if engine.reachable and engine.models is None:
                self.report.add(
                    "warn",
                    engine.instance.name,
                    "GET /v1/models did not list "
                    "its models (an engine started with --api-key needs "
                    "--upstream-api-key)",
                )
        wrong = [e for e in listed if e.models is not None and model not in e.models]
        for engine in wrong:
            self.report.add(
                "fail",
                engine.instance.name,
                f"serves {', '.join(engine.models or ())}, not {model}",
                f"start it with --served-model-name {model}"
                + ("" if spec.name else " (every P and D of one pool serves one model)"),
            )
        if listed and not wrong and len(listed) == sum(e.reachable for e in engines):
            self.report.add("ok", model, "every engine serves it")
        sizes = {
            role: {e.block_size for e in engines if e.instance.role == role and e.block_size}
            for role in ("prefill", "decode")
        }
        if not (sizes["prefill"] and sizes["decode"]):
            return
        if len(sizes["prefill"] | sizes["decode"]) == 1:
            self.report.add(
                "ok", model, f"P's and D's block sizes agree ({sizes['prefill'].pop()})"
            )
            return
        # Each reader asserts at its NIXL handshake that its block size is a multiple of the
        # remote's (kv_connector/utils.py L541-547, from nixl/base_worker.py ~L2553, ~L2721):
        # D reads P's blocks (turn 1) and P reads D's (the next turn), so they must be equal.
        shown = "; ".join(f"{e.instance.name} {e.block_size}" for e in engines if e.block_size)
        self.report.add(
            "fail",
            model,
            f"P's and D's block sizes differ ({shown}): an engine "
            "that reads another's blocks needs a block size that is a multiple of "
            "the other's (vLLM's NIXL handshake asserts it), and D reads P's "
            "blocks, P reads D's",
            "start every P and D of the model with one --block-size",
        )

    def turn(self, p: Instance, d: Instance, model: str) -> None:
        """Turn 1 on P then D, the next turn's prefill on P with D's params, and /tokenize."""
        subject = f"{p.name} -> {d.name}"
        nonce = uuid.uuid4().hex[:12]
        history = _history(nonce)
        first = {"model": model, "messages": history}
        try:
            p_reply = self._post(p, prefill_body(first, None), nonce, "1p")
        except GatewayError as exc:
            self.report.add(
                "fail",
                subject,
                f"P's prefill failed: {exc.message}",
                "give the engines' key with --upstream-api-key (they run with --api-key)"
                if exc.status in (401, 403)
                else f"start P with {KV_TRANSFER_CONFIG}",
            )
            return
        p_params = p_reply.get("kv_transfer_params")
        if not (isinstance(p_params, dict) and p_params.get("do_remote_prefill")):
            self.report.add(
                "fail",
                subject,
                "P's prefill returned no kv_transfer_params: P has "
                "no KV connector, so D cannot read its blocks",
                f"start P with {KV_TRANSFER_CONFIG}",
            )
            return
        self.report.add("ok", subject, "P's prefill returns kv_transfer_params")

        # Exactly REPLY_TOKENS tokens, none of them an end-of-turn a detokenized reply would
        # drop (ignore_eos would let the model emit them): min_tokens keeps EOS back till then.
        asked = {
            **first,
            "max_tokens": REPLY_TOKENS,
            "min_tokens": REPLY_TOKENS,
            "return_token_ids": True,
            "stream": False,
        }
        try:
            d_reply = self._post(d, decode_body(asked, p_reply, p), nonce, "1d")
        except GatewayError as exc:
            self.report.add(
                "fail",
                subject,
                f"D's decode with P's params failed: {exc.message}",
                f"start D with {KV_TRANSFER_CONFIG}, and let D reach P's NIXL side "
                f"channel: start P with VLLM_NIXL_SIDE_CHANNEL_HOST={p.host} (the "
                "gateway tells D the host of P's URL)",
            )
            return
        given = d_reply.get("kv_transfer_params")
        d_params: dict = given if isinstance(given, dict) else {}
        choice = (d_reply.get("choices") or [{}])[0]
        choice = choice if isinstance(choice, dict) else {}
        kept = bool(d_params.get("do_remote_decode"))
        if kept:
            self.report.add(
                "ok",
                subject,
                "D keeps its blocks for the next turn "
                "(kv_transfer_params with do_remote_decode, "
                f"{d_params.get('remote_num_tokens')} tokens)",
            )
        else:
            self.report.add(
                "fail",
                subject,
                "D returned no kv_transfer_params after the turn "
                f"(finish {choice.get('finish_reason')}): it keeps no blocks for the "
                "next turn's P to read, as vLLM does without bidirectional KV "
                "transfer (bidirectional_kv_xfer, off by default)",
                f"start D with {KV_TRANSFER_CONFIG}",
            )
        prompt_ids: Any = d_reply.get("prompt_token_ids")
        output_ids: Any = choice.get("token_ids")
        has_ids = isinstance(prompt_ids, list) and isinstance(output_ids, list) and output_ids
        if has_ids:
            self.report.add("ok", subject, "D returns prompt_token_ids and token_ids")
        else:
            self.report.add(
                "warn",
                subject,
                "D returned no prompt_token_ids and token_ids "
                "(return_token_ids, vLLM 0.10.2+): the gateway cannot token-verify "
                "turns, so reasoning and tool-call turns never reuse",
                "run vLLM 0.10.2 or later on D",
            )

        reply = (choice.get("message") or {}).get("content") or ""
        second = {
            "model": model,
            "messages": [
                *history,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": FOLLOW_UP},
            ],
        }
        if kept:
            self.read(p, d, second, d_params, nonce, subject)
        self.tokens(p, second, prompt_ids + output_ids[:-1] if has_ids else None, nonce, subject)

    def read(
        self, p: Instance, d: Instance, second: dict, d_params: dict, nonce: str, subject: str
    ) -> None:
        """The next turn's prefill on P with D's params, as the gateway sends it (no decode:
        P's blocks go after vLLM's kv_lease_duration, 30 s)."""
        params = clean_params(d_params)
        if params is None:
            self.report.add(
                "fail",
                subject,
                "D's kv_transfer_params lack a field the gateway "
                "needs (remote_block_ids, remote_engine_id, remote_request_id, "
                "remote_port): it stores none",
                f"run D with {KV_TRANSFER_CONFIG}",
            )
            return
        params["remote_host"] = d.host  # as the gateway keeps them (flow/disagg.py)
        try:
            reply = self._post(p, prefill_body(second, params), nonce, "2p")
        except GatewayError as exc:
            self.report.add(
                "fail",
                subject,
                f"P's next-turn prefill with D's params failed: {exc.message}",
                self._side_channel(d),
            )
            return
        held = params.get("remote_num_tokens")
        prompt, cached, result = prefill_counts(reply, held)
        said = f"P reported {cached} of {prompt} prompt tokens cached; D held {held}"
        if result == "read":
            self.report.add("ok", subject, f"P reads D's blocks ({said})")
        elif result == "recomputed":
            # P reads D's blocks only with bidirectional transfer on itself too (vLLM 0.33.0
            # nixl/pull_scheduler.py L130-134), only what reaches kv_recompute_threshold beyond
            # its own prefix cache (L89-102), and only from where D's side channel listens.
            self.report.add(
                "fail",
                subject,
                f"P recomputed what D held instead of reading it ({said})",
                f"start P with {KV_TRANSFER_CONFIG} as well (P reads "
                "D's blocks only with it), with kv_recompute_threshold (64 by "
                "default) below the tokens a reply adds; and " + self._side_channel(d),
            )
        elif result == "own_cache":
            self.report.add(
                "warn",
                subject,
                f"P's own prefix cache held more than D offered ({said}): the read was not tested",
            )
        else:
            self.report.add(
                "warn",
                subject,
                "P reported no cached tokens "
                "(kv_transfer_params.remote_prefill_cached_tokens or "
                "usage.prompt_tokens_details.cached_tokens): whether it read D's "
                "blocks is unknown",
                "start P with --enable-prompt-tokens-details",
            )

    def tokens(
        self, p: Instance, second: dict, held: list | None, nonce: str, subject: str
    ) -> None:
        """/tokenize on P renders the next turn as the gateway asks it to, and whether its
        tokens extend what D holds (prompt + generated - 1: the last token was never fed)."""
        # why the cast: `second` is a plain chat (model, messages): tokenize_body renders it.
        body = cast(dict, Exactness.tokenize_body(ClientRequest(CHAT, second, False, None)))
        try:
            tokens = self.upstream.tokenize(
                p, body, self.upstream.headers(f"check-{nonce}-t", None)
            )
        except GatewayError as exc:
            # Under --verify-reuse auto every chat reuse is proven by /tokenize: the template
            # probe, or token verification (gateway/reuse/exactness.py).
            self.report.add(
                "fail",
                subject,
                f"POST /tokenize on P failed ({exc.message}): "
                "under --verify-reuse auto, the gateway's default, it proves every "
                "reuse with /tokenize, so none would happen",
                "serve POST /tokenize on P (vLLM's server does), or run the "
                "gateway with --verify-reuse off",
            )
            return
        self.report.add("ok", subject, f"POST /tokenize on P answers ({len(tokens)} tokens)")
        if held is None:
            return
        if len(tokens) > len(held) and tokens[: len(held)] == held:
            self.report.add(
                "ok",
                subject,
                f"the next turn's tokens extend this turn's "
                f"{len(held)} (prompt + reply - 1, what D keeps): the chat template "
                "keeps the prefix property",
            )
            return
        apart = next(
            (k for k, (a, b) in enumerate(zip(tokens, held, strict=False)) if a != b),
            min(len(tokens), len(held)),
        )
        self.report.add(
            "warn",
            subject,
            f"the next turn's tokens part from this turn's "
            f"{len(held)} at token {apart} (the chat template rewrites earlier "
            "text): the gateway token-verifies such turns and reuses the shared "
            "prefix",
        )

    def _post(self, instance: Instance, body: dict, nonce: str, step: str) -> dict:
        headers = self.upstream.headers(f"check-{nonce}-{step}", None)
        return self.upstream.post_json(instance, CHAT, body, headers, read_timeout=self.timeout)

    @staticmethod
    def _side_channel(d: Instance) -> str:
        # vLLM's side channel says "localhost" unless told (envs.py L1721-1723); the gateway
        # sends P the host of D's URL instead (flow/disagg.py), which must be where it listens.
        return (
            f"let P reach D's NIXL side channel: start D with "
            f"VLLM_NIXL_SIDE_CHANNEL_HOST={d.host} (the gateway tells P the host of D's URL)"
        )


def check(
    specs: list[ModelSpec], upstream: Upstream, timeout: float, discovery: Discovery | None = None
) -> Report:
    """Every engine of every model, then one turn per D, each with a P in rotation. A URL with
    a DNS name stands for each of its addresses, as in the gateway (`discovery`)."""
    checker = Checker(upstream, timeout)
    discovery = discovery or Discovery(Resolver(), enabled=False)
    for spec in specs:
        pools = []
        for role, urls in (("prefill", spec.prefill), ("decode", spec.decode)):
            pools.append(Pool(role, [], model=spec.name))
            discovery.seed(pools[-1], urls)
        engines = [checker.inspect(i) for pool in pools for i in pool.instances]
        prefills = [e.instance for e in engines if e.reachable and e.instance.role == "prefill"]
        decodes = [e.instance for e in engines if e.reachable and e.instance.role == "decode"]
        # One pool of --prefill and --decode serves whatever model a request names: its P's.
        model = spec.name or next((m for e in engines if e.models for m in e.models), "")
        if not model:
            if prefills and decodes:
                checker.report.add(
                    "fail",
                    "models",
                    "no engine lists a model (GET /v1/models)",
                    "give the model with --models 'NAME;prefill=URL;decode=URL'",
                )
            continue
        checker.model(spec, model, engines)
        for k in range(max(len(prefills), len(decodes)) if prefills and decodes else 0):
            checker.turn(prefills[k % len(prefills)], decodes[k % len(decodes)], model)
    return checker.report


def _timeout(value: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="pd-gateway check",
        description="Check real P and D engines before serving: each answers, what it serves, "
        "its KV cache, and one real P -> D -> P turn per D, as the gateway runs it. "
        "Exit 0 when reuse will work, 1 when not (each failure with its fix). The "
        "engines are given as to pd-gateway (GATEWAY_* variables too).",
    )
    # Several values, or the flag again, as the gateway's (gateway.options.add_arguments).
    parser.add_argument(
        "--prefill", nargs="+", action="extend", help="P instance URLs, as the gateway's"
    )
    parser.add_argument(
        "--decode", nargs="+", action="extend", help="D instance URLs, as the gateway's"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        action="extend",
        help="'NAME;prefill=URL,URL;decode=URL', as the gateway's",
    )
    parser.add_argument("--models-file", help="a TOML file of [[model]] tables, as the gateway's")
    parser.add_argument(
        "--upstream-api-key",
        help="Bearer key sent to the engines (default $OPENAI_API_KEY), as the gateway's",
    )
    parser.add_argument(
        "--timeout",
        type=_timeout,
        default=30.0,
        help="seconds each engine call may take (default: 30)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {
        name: getattr(args, name)
        for name in ("prefill", "decode", "models", "models_file", "upstream_api_key")
        if getattr(args, name) is not None
    }
    try:
        settings = Settings.from_env(**given)  # GATEWAY_* beneath the flags, as the gateway
    except SettingsError as exc:
        parser.error(str(exc))
    upstream = Upstream(
        min(args.timeout, 5.0), args.timeout, pool_size=4, api_key=settings.upstream_api_key
    )
    discovery = Discovery(
        Resolver(settings.resolve_nameserver), enabled=settings.resolve_interval > 0
    )
    try:
        report = check(settings.model_specs(), upstream, args.timeout, discovery)
    finally:
        upstream.close()
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
