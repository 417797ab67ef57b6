"""Settings: defaults < GATEWAY_* env < flags; seed-proxy flags; errors name the flag."""

from __future__ import annotations

from dataclasses import fields

import pytest

from gateway.config import SETTINGS, Settings, SettingsError, build_parser


def test_every_default_passes_its_validator():
    for s in SETTINGS:
        assert s.apply(s.default, s.flag) == s.default, s.name
    assert Settings() == Settings.from_env({})


def test_every_field_is_a_flag_and_a_variable():
    assert [s.name for s in SETTINGS] == [f.name for f in fields(Settings)]
    help_text = build_parser().format_help()
    assert all(s.flag in help_text and s.env in help_text for s in SETTINGS)
    assert Settings().prefill is not Settings().prefill  # list defaults are not shared


def test_env_then_flags_override_defaults():
    env = {"GATEWAY_PORT": "9000", "GATEWAY_WORKERS": "3", "GATEWAY_DECODE": "d1:1,d2:2"}
    s = Settings.from_args(["--workers", "4"], environ=env)
    assert (s.port, s.workers) == (9000, 4)
    assert s.decode == ["http://d1:1", "http://d2:2"]


def test_seed_proxy_flags_are_accepted():
    s = Settings.from_args(
        [
            "--port",
            "8000",
            "--prefiller-host",
            "127.0.0.1",
            "--prefiller-port",
            "8100",
            "--decoder-hosts",
            "10.0.0.2",
            "10.0.0.3",
            "--decoder-ports",
            "8200",
            "8201",
        ],
        environ={},
    )
    assert s.prefill == ["http://127.0.0.1:8100"]
    assert s.decode == ["http://10.0.0.2:8200", "http://10.0.0.3:8201"]


def test_new_style_urls():
    s = Settings.from_args(
        ["--prefill", "http://a:1", "b:2", "--decode", "https://c:3"], environ={}
    )
    assert s.prefill == ["http://a:1", "http://b:2"] and s.decode == ["https://c:3"]


@pytest.mark.parametrize(
    "env,name",
    [
        ({"GATEWAY_WORKERS": "0"}, "GATEWAY_WORKERS"),
        ({"GATEWAY_WORKER_CLASS": "sync"}, "GATEWAY_WORKER_CLASS"),
        ({"GATEWAY_PREFILL": "nohost"}, "GATEWAY_PREFILL"),
        ({"GATEWAY_PORT": "x"}, "GATEWAY_PORT"),
    ],
)
def test_bad_env_values_name_the_variable(env, name):
    with pytest.raises(SettingsError, match=name):
        Settings.from_env(env)


def test_bad_flag_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        Settings.from_args(["--worker-class", "sync"], environ={})
    assert "--worker-class: 'sync' is not one of gevent, gthread" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides,flag",
    [
        ({"port": 0}, "--port"),
        ({"affinity": "maybe"}, "--affinity"),
        ({"routing": "random"}, "--routing"),
        ({"store": "memcached://x"}, "--store"),
    ],
)
def test_bad_keyword_names_the_flag(overrides, flag):
    with pytest.raises(SettingsError, match=flag):
        Settings(**overrides)


def test_round_trip_through_environment():
    s = Settings(prefill=["http://a:1", "http://b:2"], workers=2, store_ttl=10.5)
    assert Settings.from_env(s.to_env()) == s


def test_list_flags_given_again_add_engines():
    s = Settings.from_args(
        ["--prefill", "http://a:1", "--prefill", "b:2,c:3", "--decode", "d:4", "--decode", "e:5"],
        environ={"GATEWAY_PREFILL": "http://env:9"},
    )
    assert s.prefill == ["http://a:1", "http://b:2", "http://c:3"]  # the flags replace the env
    assert s.decode == ["http://d:4", "http://e:5"]
    seed = Settings.from_args(
        [
            "--decoder-host",
            "10.0.0.2",
            "--decoder-host",
            "10.0.0.3",
            "--decoder-port",
            "8200",
            "--decoder-port",
            "8201",
        ],
        environ={},
    )
    assert seed.decode == ["http://10.0.0.2:8200", "http://10.0.0.3:8201"]
    assert Settings.from_env({"GATEWAY_DECODE": "d1:1 d2:2"}).decode == [
        "http://d1:1",
        "http://d2:2",
    ]


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--max_turns", "3"], "unrecognized argument --max_turns (did you mean --max-turns?)"),
        (["--bogus", "1"], "unrecognized argument --bogus\n"),  # nothing close: no guess
        (
            ["--store-tll", "5", "--workerz", "2"],
            "unrecognized arguments --store-tll (did you mean --store-ttl?), "
            "--workerz (did you mean --workers?)",
        ),
        # An abbreviation several flags begin with: argparse's own check, answered the same way.
        (
            ["--prefil", "http://a:1"],
            "ambiguous argument --prefil, the start of --prefill, --prefill-on-decode, "
            "--prefiller-host, --prefiller-hosts, --prefiller-port, --prefiller-ports "
            "(did you mean --prefill?)",
        ),
    ],
)
def test_a_mistyped_flag_gets_two_lines_not_the_usage(capsys, argv, said):
    with pytest.raises(SystemExit) as exited:
        Settings.from_args(argv, environ={})
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("pd-gateway: error: " + said.rstrip("\n"))
    assert err.endswith("\npd-gateway --help lists every flag\n") and err.count("\n") == 2
    assert "usage:" not in err


def test_check_takes_its_flags_as_the_gateway(capsys):
    from gateway.check import build_parser as check_parser

    args = check_parser().parse_args(["--prefill", "http://a:1", "--prefill", "http://b:2"])
    assert args.prefill == ["http://a:1", "http://b:2"]
    with pytest.raises(SystemExit):
        check_parser().parse_args(["--timout", "3"])
    assert capsys.readouterr().err == (
        "pd-gateway check: error: unrecognized argument --timout "
        "(did you mean --timeout?)\n"
        "pd-gateway check --help lists every flag\n"
    )
