"""The `--store` Redis URL read in one place (gateway/redis_url.py) and the lazy client every
Redis user shares: made on first use, tried again a second after it failed."""

from __future__ import annotations

import threading

import pytest

from gateway.front.tenants import storage_url
from gateway.redis_url import Lazy, parse


def test_a_store_url_names_its_kind_and_tls():
    assert (parse("redis://h:6379/0").kind, parse("redis://h:6379/0").tls) == ("primary", False)
    assert parse("unix:///run/redis.sock").kind == "primary"
    assert (parse("rediss+cluster://a:7000,b").kind, parse("rediss+cluster://a").tls) == (
        "cluster",
        True,
    )
    assert parse("redis+sentinel://a:26379/main").kind == "sentinel"
    assert str(parse("rediss://u:p@h:1/2")) == "rediss://u:p@h:1/2"
    for wrong in ("memcached://x", "redis:/x", "local", "REDIS://h"):
        with pytest.raises(ValueError, match="not a Redis URL"):
            parse(wrong)


def test_the_key_limits_read_the_same_url_in_the_limits_librarys_words():
    assert storage_url("local") == ("memory://", {})
    assert storage_url("unix:///s.sock")[0] == "redis+unix:///s.sock"
    assert storage_url("rediss+sentinel://a:26379/main") == (
        "redis+sentinel://a:26379/main",
        {"key_prefix": "pd-gateway-limits", "ssl": True},
    )
    assert storage_url("rediss://h:1/0") == ("rediss://h:1/0", {"key_prefix": "pd-gateway-limits"})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lazy_client_is_made_once_on_first_use():
    made = []
    lazy = Lazy(lambda: made.append(1) or object(), wait=1.0, clock=Clock())
    assert made == []
    assert lazy.get() is lazy.get() and made == [1]


def test_a_client_that_cannot_be_made_is_tried_again_a_second_later():
    clock, tries = Clock(), []

    def make() -> str:
        tries.append(clock.now)
        if len(tries) == 1:
            raise OSError("down")
        return "client"

    lazy = Lazy(make, wait=1.0, clock=clock)
    with pytest.raises(OSError):
        lazy.get()
    clock.now = 100.5
    with pytest.raises(ConnectionError, match="a moment ago"):  # at once, not tried
        lazy.get()
    clock.now = 101.0
    assert lazy.get() == "client" and tries == [100.0, 101.0]


def test_a_failed_call_makes_every_get_fail_at_once_for_a_second():
    clock = Clock()
    lazy = Lazy(lambda: "client", wait=1.0, unavailable=TimeoutError, clock=clock)
    assert lazy.get() == "client"
    lazy.failed()
    with pytest.raises(TimeoutError):
        lazy.get()
    clock.now += Lazy.RETRY_SECONDS
    assert lazy.get() == "client"


def test_callers_wait_for_the_one_making_the_client_at_most_their_wait():
    entered, release = threading.Event(), threading.Event()

    def make() -> str:
        entered.set()
        release.wait()
        return "client"

    lazy = Lazy(make, wait=0.0, clock=Clock())
    maker = threading.Thread(target=lazy.get)
    maker.start()
    entered.wait()
    with pytest.raises(ConnectionError, match="not made yet"):
        lazy.get()
    release.set()
    maker.join()
    assert lazy.get() == "client"
