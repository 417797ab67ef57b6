"""What each port shows and who may take it: the public port's /health is status only (200 ok,
or 503 degraded when no D is usable) and the detailed report needs the admin token; each
worker's private port stays the gateway's while its worker is away, and a slot whose private
port is taken serves without owning conversations while the others go on."""

from __future__ import annotations

import os
import signal
import socket

import pytest
import requests

from devtools import workload
from emulator.process import free_port, wait_until
from tests.helpers.servers import gateway_process

# --- the public port shows status only ----------------------------------------------------------


def test_health_answers_503_degraded_when_no_d_is_usable(app, client):
    """What README promises load balancers: 200 ok, or 503 with status degraded."""
    gateway = app.extensions["pd_gateway"].gateway
    assert (client.get("/health").status_code, client.get("/health").get_json()) == (
        200,
        {"status": "ok"},
    )
    gateway.decode.instances[0].down = True  # as a failed connection marks it
    reply = client.get("/health")
    assert (reply.status_code, reply.get_json()) == (503, {"status": "degraded"})


def test_public_health_is_status_only_and_the_report_needs_the_admin_token(fresh_engines):
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], admin_token="s3cret") as gateway:
        public = requests.get(gateway.url + "/health", timeout=5)
        assert public.status_code == 200 and public.json() == {"status": "ok"}
        assert p.url.split("//")[1] not in requests.get(gateway.url + "/health?debug=1").text
        assert requests.get(gateway.url + "/admin/status", timeout=5).status_code == 401
        wrong = {"Authorization": "Bearer s3cres"}
        assert requests.get(gateway.url + "/admin/status", headers=wrong).status_code == 401
        report = requests.get(
            gateway.url + "/admin/status", timeout=5, headers={"Authorization": "Bearer s3cret"}
        ).json()
        assert report["prefill"][0]["url"] == p.url and "watchers" in report
    with gateway_process([p.url], [d.url], admin_token="") as gateway:  # no token: no report
        assert requests.get(gateway.url + "/admin/status", timeout=5).status_code == 404


# --- private listeners nobody else can take -----------------------------------------------------


def _another_user_binds(host: str, port: int) -> bool:
    """Can another local user bind host:port now, as a squatter would (SO_REUSEPORT, which
    Linux honours only between sockets of one uid)? Run as root, the child is uid 65534;
    otherwise it is this uid without SO_REUSEPORT, which no listener of ours lets in either."""
    pid = os.fork()
    if pid == 0:  # the child only makes system calls, then _exits
        code = 1
        try:
            root = os.geteuid() == 0
            if root:
                os.setuid(65534)
            sock = socket.socket()  # owned by the uid that makes it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if root:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            code = 0
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1] == 0


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_private_port_stays_the_gateways_while_its_worker_is_away(fresh_engines):
    """The master holds every slot's private port (bound, never listening): with its worker
    killed and no replacement yet (the master stopped), no other user can bind it, and a
    forward is refused at once (the forwarder waits --owner-wait, then serves). Before, the
    port was free until the replacement came: another user's listener got the forwarded
    requests, with the clients' keys and prompts."""
    p, d = fresh_engines
    with gateway_process([p.url], [d.url], workers=2) as gateway:
        private = gateway.port + 1  # slot 0
        victim = gateway.status(port=private)["pid"]
        os.kill(gateway.process.pid, signal.SIGSTOP)  # no respawn until we say
        try:
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: _zombie(victim), 10, "the killed worker gone")
            assert not _another_user_binds("127.0.0.1", private)
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", private), timeout=10).close()
        finally:
            os.kill(gateway.process.pid, signal.SIGCONT)
        replacement = wait_until(
            lambda: gateway.status(port=private)["pid"], 30, "the replacement on the private port"
        )
        assert replacement != victim


def test_a_slot_whose_port_is_taken_serves_and_the_gateway_goes_on(fresh_engines):
    """A port squatted before start: that worker serves without owning conversations; the
    others own them all (every later turn a hit) and the squatter is never sent a request.
    Before, the worker failed to boot and the master halted the whole gateway (exit 3)."""
    p, d = fresh_engines
    port = free_port("127.0.0.1", 3)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port + 2))  # slot 1's private port
    squatter.listen(16)
    squatter.setblocking(False)
    try:
        with gateway_process([p.url], [d.url], port=port, workers=2) as gateway:
            convs = workload.run(gateway.url, conversations=24, turns=2)
            assert workload.errors(convs) == []
            assert workload.later_hits(convs) == (24, 24)
            assert gateway.process.poll() is None
            with pytest.raises(BlockingIOError):
                squatter.accept()
            assert "slot 1 cannot have its private port" in gateway.log()
    finally:
        squatter.close()
