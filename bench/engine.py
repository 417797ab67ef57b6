"""Entry point of the benchmark's engines: the emulator, with TCP_NODELAY on its listening sockets."""
from gevent import monkey

monkey.patch_all()  # as gateway.emulator.cli does, before anything imports socket

import socket  # noqa: E402
import sys  # noqa: E402

from gevent.pywsgi import WSGIServer  # noqa: E402

from gateway.emulator.cli import main  # noqa: E402

_start = WSGIServer.start


def _start_nodelay(self) -> None:
    # vLLM serves through uvicorn, whose sockets send small writes at once. Without this, D's
    # token after the role chunk waits for the reader's delayed ACK on a kept-alive connection:
    # 40 ms added to every turn's TTFT, whichever proxy reads it. Accepted sockets inherit it.
    _start(self)
    self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


if __name__ == "__main__":
    WSGIServer.start = _start_nodelay
    sys.exit(main())
