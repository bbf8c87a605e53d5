"""Flags backed by environment variables, and the parser and help formatter of every
`tidewire` command.

Every flag's help shows its default; flags backed by a TIDEWIRE_<NAME> environment
variable are declared with `env_arg`, which reads the variable once (a set value becomes
the flag's default, an empty one counts as unset) and tags the action so the help
formatter names it. Switches read 1/true/yes/on and 0/false/no/off (`env_bool`). A value
that does not parse is a usage error of the subcommand that reads it.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from typing import Any, Callable

ENV_PREFIX = "TIDEWIRE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

def env_bool(value: str) -> bool:
    """A switch's value from the environment: 1/true/yes/on or 0/false/no/off."""
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError("use 1/true/yes/on or 0/false/no/off")


def env_arg(p: Any, flag: str, env: str, *, default: Any = None,
            type: Callable[[str], Any] | None = None,  # noqa: A002 - argparse's name
            default_text: str | None = None, secret: bool = False,
            **kw: Any) -> argparse.Action:
    """Add `flag` to the parser or argument group `p`, its default read from
    TIDEWIRE_<env> when that is set and not empty. For switches (action store_true /
    store_false) the variable gives the destination's value: `--no-async-output` is
    store_false into `async_output`, so TIDEWIRE_ASYNC_OUTPUT=0 turns it off.
    `default_text` replaces the default in the help (for defaults that mean something);
    a `secret` value from the environment is not shown there."""
    name = ENV_PREFIX + env
    raw = os.environ.get(name, "")
    value, error = default, None
    if raw.strip():
        try:
            if kw.get("action") in ("store_true", "store_false"):
                value = env_bool(raw)
            else:
                try:
                    value = (type or str)(raw.strip())
                except (TypeError, ValueError):
                    kind = getattr(type, "__name__", "value")
                    raise ValueError(f"not a valid {kind}") from None
                if "choices" in kw and value not in kw["choices"]:
                    raise ValueError(f"choose from {', '.join(map(str, kw['choices']))}")
        except ValueError as e:
            error = f"{name}={raw!r}: {e}"
    if secret and value:
        default_text = f"set by {name}, not shown"
    if type is not None:
        kw["type"] = type
    if type is int:
        kw.setdefault("metavar", "N")
    action = p.add_argument(flag, default=value, **kw)
    action.env = name  # type: ignore[attr-defined]  # read by HelpFormatter and tests
    action.env_error = error  # type: ignore[attr-defined]  # reported by Parser
    if default_text is not None:
        action.default_text = default_text  # type: ignore[attr-defined]
    return action


def _show(value: Any) -> str:
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return " ".join(map(_show, value))
    return str(value)


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X; env TIDEWIRE_Y)" to each flag's help (just the env where the
    help already says its default), and keeps the paragraphs of descriptions/epilogs."""

    def __init__(self, prog: str, **kw: Any) -> None:
        kw.setdefault("max_help_position", 32)
        super().__init__(prog, **kw)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text  # positionals, -h
        notes = []
        switch = action.nargs == 0 and isinstance(action.const, bool)
        if action.required:
            notes.append("required")
        elif hasattr(action, "default_text"):
            notes.append(f"default: {action.default_text}")
        elif "%(default)" not in text and "default:" not in text and "(default" not in text:
            # a switch is "on" when given; its default is whether it starts that way
            value = action.default == action.const if switch else action.default
            notes.append(f"default: {_show(value)}")
        env = getattr(action, "env", None)
        if env:
            notes.append(f"env {env}" + (("=1" if action.const else "=0") if switch else ""))
        if not notes:
            return text
        note = "; ".join(notes).replace("%", "%%")
        return f"{text} ({note})" if text else f"({note})"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Fill each paragraph on its own; an indented paragraph is kept as written."""
        out = []
        for para in textwrap.dedent(text).strip("\n").split("\n\n"):
            if para[:1].isspace():
                out.append(textwrap.indent(para, indent))
            else:
                out.append(super()._fill_text(para, width, indent))
        return "\n\n".join(out)


class Parser(argparse.ArgumentParser):
    """Help with defaults and env names; a bad TIDEWIRE_* value is a usage error of the
    (sub)command whose flag reads it, raised when that command is parsed. `add_args`, if
    given, adds the flags on first use (parse or help): the benchmarks' modules import
    torch, which the other commands need not wait for."""

    def __init__(self, *args: Any, add_args: Callable[[Any], None] | None = None,
                 **kw: Any) -> None:
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)
        self._add_args = add_args

    def load_args(self) -> None:
        if self._add_args is not None:
            add, self._add_args = self._add_args, None
            add(self)

    def format_usage(self) -> str:
        self.load_args()
        return super().format_usage()

    def format_help(self) -> str:
        self.load_args()
        return super().format_help()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.load_args()
        for action in self._actions:
            if getattr(action, "env_error", None):
                self.error(action.env_error)  # type: ignore[attr-defined]
        return super().parse_known_args(args, namespace)


ENV_EPILOG = """\
Every flag marked "env TIDEWIRE_X" takes its default from that environment variable
when it is set (an empty value counts as unset); switches read 1/true/yes/on or
0/false/no/off. Environment only: TIDEWIRE_CACHE (converted models, int8 weights,
compiled CPU kernels; default ~/.cache/tidewire), TIDEWIRE_CPU_OPS=0 (torch ops instead
of the compiled CPU kernels)."""
