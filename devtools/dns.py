"""A tiny DNS server on loopback (dnslib, a test extra) whose answers a test changes while the
gateway runs: the stand-in for a Kubernetes headless Service, one A record per pod.
"""

from __future__ import annotations

import threading

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from emulator.process import free_port


class _Records(BaseResolver):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: dict[str, list[str]] = {}  # "decode.test." -> ["127.0.0.11", ...]
        self.failing = False  # answer SERVFAIL to everything
        self.queries = 0

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).lower()
        with self.lock:
            self.queries += 1
            if self.failing:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            addresses = self.names.get(name)
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for address in addresses:
                reply.add_answer(RR(name, QTYPE.A, rdata=A(address), ttl=1))
        return reply  # AAAA: no records (NOERROR, empty)


class LoopbackDNS:
    """`set("decode.test", [...])` changes the answer at once; `failing = True` makes every
    query fail. Use as a context manager; `nameserver` is the --resolve-nameserver value."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.records = _Records()
        self.port = free_port(host)
        self.nameserver = f"{host}:{self.port}"
        self.server = DNSServer(
            self.records,
            address=host,
            port=self.port,
            logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data"),
        )
        self.server.start_thread()

    def set(self, name: str, addresses: list[str]) -> None:
        with self.records.lock:
            self.records.names[name.lower().rstrip(".") + "."] = list(addresses)

    @property
    def failing(self) -> bool:
        return self.records.failing

    @failing.setter
    def failing(self, value: bool) -> None:
        with self.records.lock:
            self.records.failing = value

    @property
    def queries(self) -> int:
        return self.records.queries

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> LoopbackDNS:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
