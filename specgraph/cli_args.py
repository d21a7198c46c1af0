"""argparse types of the ``specgraph`` command: nonsense is refused as a usage error (exit status 2,
the flag named) before any model is loaded. Nothing here imports torch: ``--help`` stays fast."""
from __future__ import annotations

import argparse
import math
import warnings

MAX_NODES = 64  # trees.MAX_NODES, spelled out: the parser is built without importing torch (a test ties the two)
DRAFT_KINDS = {"ngram": False, "eagle": True, "eagle3": True, "medusa": True, "mtp": True}  # kind -> needs =PATH


def whole_number(minimum: int = 1, maximum: int | None = None):
    """A whole number in [minimum, maximum]."""
    span = f">= {minimum}" if maximum is None else f"in {minimum} .. {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a whole number {span}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text}: a whole number {span}")
        return value
    parse.__name__ = f"whole number {span}"
    return parse


def number(minimum: float = 0.0, above: bool = False):
    """A finite number >= ``minimum`` (``above``: > minimum)."""
    span = f"{'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: a finite number {span}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"{text}: a finite number {span}")
        return value
    parse.__name__ = f"number {span}"
    return parse


def draft_spec(text: str) -> tuple[str, str]:
    """``KIND`` or ``KIND=PATH`` -> (kind, path); the kinds with weights need their path."""
    kind, _, path = text.partition("=")
    if kind not in DRAFT_KINDS:
        raise argparse.ArgumentTypeError(f"{text!r}: one of ngram, eagle=DIR, eagle3=DIR, medusa=DIR, mtp=TARGET_DIR")
    if DRAFT_KINDS[kind] and not path:
        raise argparse.ArgumentTypeError(f"{text!r}: {kind} needs its weights: {kind}=DIR (a directory or hub id)")
    if not DRAFT_KINDS[kind] and path:
        raise argparse.ArgumentTypeError(f"{text!r}: ngram takes no path")
    return kind, path


def layer_ids(text: str) -> tuple[int, ...]:
    """``2,15,26`` -> (2, 15, 26): layer ids >= 0."""
    try:
        ids = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: layer ids >= 0 separated by commas, e.g. 2,15,26") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: layer ids >= 0 separated by commas, e.g. 2,15,26")
    return ids


def row_range(text: str) -> tuple[int, int]:
    """``START:STOP`` -> (start, stop) with 0 <= start < stop."""
    start, colon, stop = text.partition(":")
    try:
        rows = (int(start), int(stop))
    except ValueError:
        rows = None
    if not colon or rows is None or not 0 <= rows[0] < rows[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: START:STOP node rows with 0 <= START < STOP, e.g. 0:8")
    return rows


def tree(text: str):
    """A tree spec string (``trees.parse_tree``)."""
    from .trees import parse_tree

    try:
        return parse_tree(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class OldSpelling(argparse.Action):
    """An option with an old spelling (its last option string) kept for one release: it still works, with a
    FutureWarning naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == self.option_strings[-1]:
            warnings.warn(f"{option_string} is the old spelling of {self.option_strings[0]}; it goes in the next "
                          f"release", FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


class DefaultsShown(argparse.HelpFormatter):
    """Each option's default in its help, with or without a help text (ArgumentDefaultsHelpFormatter shows it
    only where there is one), unless the text already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, (), []) or not action.option_strings \
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class RawDescriptionDefaultsShown(argparse.RawDescriptionHelpFormatter, DefaultsShown):
    """DefaultsShown with the description printed as written (the benchmark scripts' docstrings)."""


SCRIPT_PROG: str | None = None  # "specgraph bench NAME" while the command runs benchmarks/NAME.py (runpy sets argv[0])


class Parser(argparse.ArgumentParser):
    """Every --help shows the defaults (subcommands' parsers are of the parent's class); a benchmark script's parser
    is named as the command that runs it (``SCRIPT_PROG``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShown)
        if SCRIPT_PROG is not None:
            kwargs.setdefault("prog", SCRIPT_PROG)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if "help" not in kwargs and args and args[0].startswith("-") and kwargs.get("default") is not None:
            kwargs["help"] = "(default: %(default)s)"  # argparse prints nothing for an option without help
        return super().add_argument(*args, **kwargs)
