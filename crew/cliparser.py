"""crew's argument parser: a bad command line is one line naming the flag and the value, and the way to
the options (`crew run --help`), instead of argparse's usage block; exit code 2 as argparse.

    crew run: error: --master_port: '99999' is not a port number (1-65535). See 'crew run --help'.
    crew run: error: unknown option --hostfil; did you mean --hostfile? See 'crew run --help'.

Subcommands get the same class (argparse's add_subparsers takes the parent's), and each reports its
own unknown options itself, so the message names the subcommand and "did you mean" looks among its
options (argparse 3.11 hands them up to `crew`, which knows none of them).
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn

_ARGUMENT = re.compile(r"^argument ([^/:\s]+)(?:/\S+?)*: ")  # argparse: "argument --a/--b/-c: ..."
_CHOICE = re.compile(r"invalid choice: '(.*?)' \(choose from (.*)\)$")


class CrewParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # crew's commands take no unknown arguments: say so here, where the options are known
            self.error(self._unknown(extras))
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        text = _ARGUMENT.sub(lambda m: f"{m[1]}: ", message.strip())
        choice = _CHOICE.search(text)
        if choice:
            text += _did_you_mean(choice[1], [c.strip().strip("'") for c in choice[2].split(", ")], choices=True)
        end = "" if text.endswith((".", "?")) else "."
        self.exit(2, f"{self.prog}: error: {text}{end} See '{self.prog} --help'.\n")

    def _unknown(self, extras: list[str]) -> str:
        options = [a for a in extras if a.startswith("-") and a != "-"]
        if not options:
            return f"unexpected argument(s): {' '.join(extras)}"
        name = options[0].split("=", 1)[0]
        hint = _did_you_mean(name, list(self._option_string_actions))
        if not hint and any(action.dest == "script" for action in self._actions):
            hint = " (the script's own options go after the script's name)"
        return f"unknown option {options[0]}{hint}"


def _did_you_mean(word: str, candidates: list[str], choices: bool = False) -> str:
    """The closest candidate, compared without leading dashes (which every option shares). Options are
    long, so a looser match would offer --as_deepspeed for --deepspeed_config; choices are short words."""
    bare = {c.lstrip("-"): c for c in candidates}
    close = difflib.get_close_matches(word.lstrip("-"), list(bare), n=1, cutoff=0.6 if choices else 0.75)
    if not close:
        return ""
    return f"; did you mean '{bare[close[0]]}'?" if choices else f"; did you mean {bare[close[0]]}?"
