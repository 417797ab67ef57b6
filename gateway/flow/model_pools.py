"""Several models behind one gateway: each model its own P and D pools (so its own breakers,
probes, DNS names and admin changes) and its own two-stage flow; a request goes to the pool of
the model it names.

A conversation never crosses models: its identity digests the body's `model` (beside every
other prompt-relevant field), so two models' turns never share an entry, and each entry's D
belongs to one pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.config import ModelSpec
from gateway.engines.instances import Pool
from gateway.flow.disagg import Disagg
from gateway.parse import ClientRequest
from gateway.support.errors import NotFound, clip


class ModelNotFound(NotFound):
    """vLLM's answer to a model it does not serve (vllm/entrypoints/serve/engine/serving.py
    `_check_model`, vLLM 0.33.0 ~L49-85)."""

    type = "NotFoundError"

    def __init__(self, model: object, served: list[str]) -> None:
        super().__init__(
            f"The model `{clip(str(model))}` does not exist. Valid aliases: "
            f"{clip(', '.join(served), 2000)}.",
            param="model",
        )


@dataclass(eq=False)
class ModelPool:
    """One model's engines and the flow over them."""

    spec: ModelSpec
    prefill: Pool
    decode: Pool
    disagg: Disagg

    @property
    def name(self) -> str:
        return self.spec.name

    def label(self, given: object) -> str:
        """The model as metrics label a request that names `given`: this pool's name; without
        --models (one pool, named ""), `given` if an engine lists it (vLLM serves the first
        name it lists when none is given), else "unknown": never a client's free text."""
        if self.spec.name:
            return self.spec.name
        for instance in self.decode.instances:
            served = instance.served or ()
            if given is None and served:
                return served[0]
            if given in served:
                return given
        return "unknown"

    def healthy(self) -> bool:
        """Some P and some D ready: not marked down and, where probed, answering."""
        return self.prefill.any_ready() and self.decode.any_ready()


class ModelPools:
    """The models a gateway serves, by every name a client may send."""

    def __init__(self, pools: list[ModelPool]) -> None:
        self.pools = pools
        self.default = pools[0]
        # One pool named "": the settings of --prefill/--decode, any model goes to it.
        self.single = len(pools) == 1 and pools[0].name == ""
        self._by_name: dict[str, tuple[ModelPool, str | None]] = {}
        for pool in pools:
            self._by_name[pool.name] = (pool, None)
            self._by_name.update((alias, (pool, pool.name)) for alias in pool.spec.aliases)
            self._by_name.update((adapter, (pool, None)) for adapter in pool.spec.adapters)
        self.served = [name for pool in pools for name in pool.spec.names]
        self._decodes: dict[str, ModelPool] = {}  # every D each model has had
        self.remember()

    def route(self, request: ClientRequest) -> tuple[ModelPool, ClientRequest]:
        """The pool of the model `request` names, and the request as its engines get it (an
        alias replaced by the model's name). No model: the first, as vLLM serves its first
        name. A model no pool serves: 404, before any engine is called."""
        pool, rename = self.find(request.body.get("model"))
        if rename is not None:
            request = replace(request, body={**request.body, "model": rename})
        return pool, request

    def find(self, model: object) -> tuple[ModelPool, str | None]:
        """The pool of `model`, and the name its engines know it by if the request's is an
        alias (else None). No model: the first pool; a model no pool serves: 404."""
        if self.single or model is None:
            return self.default, None
        found = self._by_name.get(model) if isinstance(model, str) else None
        if found is None:
            raise ModelNotFound(model, self.served)
        return found

    def label(self, model: object) -> str:
        """The metrics' label of a request naming `model`, before it is routed ("unknown" for
        a model no pool serves)."""
        found = (
            (self.default, None)
            if self.single or model is None
            else (self._by_name.get(model) if isinstance(model, str) else None)
        )
        return "unknown" if found is None else found[0].label(model)

    def remember(self) -> None:
        """Note each model's Ds now (called as the instance sets change), so an entry whose D
        has left its pool since (drained, gone from DNS) still finds its model."""
        for pool in self.pools:
            for instance in pool.decode.instances:
                self._decodes[instance.url] = pool

    def of_decode(self, url: str) -> ModelPool | None:
        """The model whose D is, or was, at `url` (an engine serves one model)."""
        if url not in self._decodes:
            self.remember()  # added since the last look
        return self._decodes.get(url)

    def listing(self, ask: Callable[[Pool], dict | None]) -> dict:
        """/v1/models as vLLM answers it, for every model: each pool's own engines' list (`ask`
        its D pool), or, where none answers, entries of the gateway's own; aliases as entries
        of their model's."""
        data = []
        for pool in self.pools:
            answer = ask(pool.decode)
            entries = [m for m in (answer or {}).get("data", []) if isinstance(m, dict)]
            known = {m.get("id") for m in entries}
            entries += [
                _entry(name, pool.name)
                for name in (pool.name, *pool.spec.adapters)
                if name not in known
            ]
            base = next((m for m in entries if m.get("id") == pool.name), entries[0])
            entries += [{**base, "id": alias} for alias in pool.spec.aliases]
            data += entries
        return {"object": "list", "data": data}


def _entry(name: str, root: str) -> dict:
    """A model card as vLLM's /v1/models writes one (vLLM 0.33.0,
    vllm/entrypoints/serve/engine/protocol.py ModelCard ~L105-113), for a model whose engines
    did not answer."""
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": root,
        "parent": None if name == root else root,
        "max_model_len": None,
        "permission": [],
    }
