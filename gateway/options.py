"""Settings declared once: a dataclass field carries its default, converter and help.

`option(...)` makes such a field; the rest turns a settings dataclass into command-line flags
(`--name-with-dashes`), reads its environment variables and converts values, naming the flag or
variable when one is bad. It imports nothing from gateway, so the emulator uses it as well.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

_KEY = "option"


class SettingsError(ValueError):
    """A setting has a value we cannot use; the message names the flag or variable."""


@dataclass(frozen=True)
class Option:
    """One setting: its field name, default, converter (which validates) and help text."""

    name: str
    default: Any
    convert: Callable[[Any], Any]
    help: str
    env: str | None = None  # the environment variable, when the class has an `env_prefix`
    nargs: str | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False  # on the command line; the dataclass keeps its default
    action: str | None = None  # "store_true" for a flag without a value
    show: str | None = None  # the default as help and docs show it, when not the value itself

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def shown(self) -> str | None:
        """The default as help shows it; None when there is nothing to show."""
        if self.show is not None:
            return self.show
        if self.required or self.action or self.default is None:
            return None
        return show(self.default)

    def apply(self, value: Any, source: str) -> Any:
        """Convert and validate `value`; a bad one raises SettingsError naming `source`."""
        try:
            value = self.convert(value)
            if self.choices is not None and value not in self.choices:
                raise ValueError(f"{value!r} is not one of {', '.join(self.choices)}")
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"{source}: {exc}") from exc
        return value


def option(
    default: Any,
    convert: Callable[[Any], Any] = str,
    help: str = "",
    *,
    nargs: str | None = None,
    choices: tuple[str, ...] | None = None,
    required: bool = False,
    action: str | None = None,
    show: str | None = None,
) -> Any:
    """A dataclass field that is a setting. A list default becomes a fresh copy per instance.
    A None default means "unset": it is not converted, and the class derives the value."""
    meta = Option(
        "",
        default,
        convert,
        help,
        nargs=nargs,
        choices=choices,
        required=required,
        action=action,
        show=show,
    )
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={_KEY: meta})
    return field(default=default, metadata={_KEY: meta})


@functools.cache
def options(cls: type) -> tuple[Option, ...]:
    """The options of a settings dataclass, in field order, with names and variables filled in."""
    prefix = getattr(cls, "env_prefix", None)
    out = []
    for f in fields(cls):
        meta = f.metadata.get(_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with option()")
        out.append(replace(meta, name=f.name, env=prefix + f.name.upper() if prefix else None))
    return tuple(out)


def check(settings: Any, names: tuple[str, ...] | None = None) -> None:
    """Convert every option of a settings instance in place (frozen or not), naming the flag."""
    cls: type = type(settings)
    for opt in options(cls):
        value = getattr(settings, opt.name)
        if (names is None or opt.name in names) and not (value is None and opt.default is None):
            object.__setattr__(settings, opt.name, opt.apply(value, opt.flag))


def read_env(cls: type, environ: Mapping[str, Any], prefix: str | None = None) -> dict[str, Any]:
    """The settings the environment sets, converted; a bad value names its variable.

    With `prefix`, the keys are `prefix` + the upper-case name instead (a Flask app's
    `app.config`, whose values may be typed already), and a key with that prefix that names no
    setting is an error: a typo there would otherwise go unnoticed.
    """
    if prefix is None:
        return {
            o.name: o.apply(environ[o.env], o.env)
            for o in options(cls)
            if o.env and o.env in environ
        }
    known = {prefix + o.name.upper(): o for o in options(cls)}
    unknown = sorted(k for k in environ if k.startswith(prefix) and k not in known)
    if unknown:
        raise SettingsError(f"{', '.join(unknown)}: no such setting in {cls.__name__}")
    return {o.name: o.apply(environ[key], key) for key, o in known.items() if key in environ}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a mistake is answered in two lines, not the whole usage: what is
    wrong, the closest flag to a mistyped or ambiguous one (difflib: Python 3.12's
    `suggest_on_error` is not in 3.11), and where every flag is listed."""

    # Python's own wording (3.11 to 3.13), the one message argparse gives no other way to read
    # (an abbreviation that several flags begin with). Any other message is shown as it is.
    CLOSE = 0.7  # difflib's likeness above which a flag is suggested (0.6: --bogus, --host)
    _AMBIGUOUS = re.compile(r"ambiguous option: (?P<given>[^=\s]+)\S* could match (?P<flags>.+)")

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            # The flags, if any: the values after an unknown flag would only be noise.
            shown = [a for a in unknown if a.startswith("-")] or unknown
            what = "argument" if len(shown) == 1 else "arguments"
            self.error(f"unrecognized {what} " + ", ".join(map(self._suggest, shown)))
        return parsed

    def _suggest(self, arg: str) -> str:
        """`arg`, with the flag it was probably meant to be."""
        given = arg.partition("=")[0]
        close = (
            difflib.get_close_matches(given, self._option_string_actions, n=1, cutoff=self.CLOSE)
            if given.startswith("--")
            else []
        )
        return f"{arg} (did you mean {close[0]}?)" if close else arg

    def error(self, message: str):
        ambiguous = self._AMBIGUOUS.fullmatch(message)
        if ambiguous:
            flags = ambiguous["flags"].split(", ")
            close = difflib.get_close_matches(ambiguous["given"], flags, n=1, cutoff=self.CLOSE)
            message = (
                f"ambiguous argument {ambiguous['given']}, the start of "
                f"{', '.join(flags)}" + (f" (did you mean {close[0]}?)" if close else "")
            )
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists every flag\n")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per option. Flags parse to raw values (None when absent): the dataclass converts
    them, so a bad value is reported the same way whether it came from a flag or from code. A
    flag of several values adds to them each time it is given (`--prefill A --prefill B`, one
    engine a flag as routers take them): with the last one winning, engines were silently
    dropped."""
    for o in options(cls):
        shown = o.shown
        if o.env:  # the variable beside the default, as README's settings table has them
            help = f"{o.help} [env {o.env}" + (f", default {shown}]" if shown is not None else "]")
        else:
            help = o.help if shown is None else f"{o.help} (default: {shown})"
        if o.action:
            parser.add_argument(o.flag, dest=o.name, action=o.action, default=None, help=help)
            continue
        metavar = "{" + ",".join(o.choices) + "}" if o.choices else None
        parser.add_argument(
            o.flag,
            dest=o.name,
            default=None,
            nargs=o.nargs,
            metavar=metavar,
            # why the ignore: argparse takes None as its default action (store); typeshed not.
            action="extend" if o.nargs == "+" else None,  # type: ignore[arg-type]
            required=o.required,
            help=help,
        )


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options set on the command line."""
    return {
        o.name: getattr(args, o.name)
        for o in options(cls)
        if getattr(args, o.name, None) is not None
    }


def show(value: Any) -> str:
    """A value as help and docs print it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(value)
    return repr(value) if value == "" else str(value)


# Converters shared by the gateway and the emulator; each returns the value or raises ValueError.


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not on/off")


def port(value: Any) -> int:
    number = int(value)
    if not 0 < number < 65536:
        raise ValueError(f"{value!r} is not a TCP port")
    return number


def auto_or(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """ "auto" (None: the value is found at run time) or `kind(value)`."""

    def convert(value: Any) -> Any:
        if value is None or str(value).strip().lower() == "auto":
            return None
        return kind(value)

    return convert


def positive(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        number = kind(value)
        if number <= 0:
            raise ValueError(f"{value!r} is not positive")
        return number

    return convert


def bounded(
    kind: Callable[[Any], Any], low: float, high: float | None = None
) -> Callable[[Any], Any]:
    """`kind(value)` within low..high (inclusive; no upper bound when high is None)."""

    def convert(value: Any) -> Any:
        number = kind(value)
        if number < low or (high is not None and number > high):
            raise ValueError(
                f"{value!r} is less than {low}"
                if high is None
                else f"{value!r} is not within {low}..{high}"
            )
        return number

    return convert
