"""vLLM commands inside a container's shell script, found the way the shell reads it.

A regex over the script text cannot tell `vllm serve` in a comment, an `echo "..."` or a
heredoc from the command that runs, and inserting text at a match breaks backslash line
continuations. This module parses the script with bashlex (a port of bash's own parser):
comments vanish, quoted words are single words, continuations join lines, and every
simple command (in `;`/`&&`/`||` lists, pipelines, `if`/`for`/`while`, `{ }`, subshells,
functions, `$( )`) carries its words with their positions in the original text. A vLLM
server command is one whose program, after `exec`/`env`/`nohup` and leading `VAR=value`
assignments, is `vllm serve` or `python -m vllm.entrypoints...`; the loader flags go right
after its last word, inside that command whatever follows it.

Where the parser cannot be sure (bash syntax bashlex does not support, or a nested
`sh -c` string that itself runs vLLM) and the script mentions vLLM, `Unclear` says so: the
webhook denies the pod with the reason rather than guess.
"""

from __future__ import annotations

import functools
import posixpath
import re
from dataclasses import dataclass

import bashlex
import bashlex.ast
import bashlex.errors

from weightcache.errors import ProjectError

SHELLS = frozenset({"sh", "bash", "ash", "dash", "zsh", "ksh"})
VLLM_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")
PREFIX_COMMANDS = frozenset({"exec", "nohup", "env", "command", "time"})
CACHED_SCRIPT_CHARS = 8192  # longer scripts are parsed every time (bounds the cache)
# bashlex 0.18 misreads quoted heredoc delimiters (`<<'EOF'`). Quoting only stops expansion
# in the body, which does not change where commands are, so the parser sees `<< EOF `:
# the same length, so every offset still points into the original script.
_QUOTED_HEREDOC = re.compile(r"(<<-?)(['\"])(\w+)\2")


class Unclear(ProjectError):
    """The script may run vLLM in a way this parser cannot rewrite safely."""


@dataclass(frozen=True)
class EngineCommand:
    """One vLLM server command in a script: its argv (quotes removed) and where to append."""

    words: tuple[str, ...]
    insert_at: int  # offset in the script just after the command's last word


def runs_vllm(tokens: list[str] | tuple[str, ...]) -> bool:
    """Whether an argv (program first) starts vLLM's OpenAI server."""
    if not tokens:
        return False
    prog = posixpath.basename(tokens[0])
    if prog == "vllm":
        return len(tokens) > 1 and tokens[1] == "serve"
    if prog.startswith("python"):
        for i, tok in enumerate(tokens[1:-1], start=1):
            if tok == "-m":
                return tokens[i + 1] in VLLM_SERVER_MODULES
            if not tok.startswith("-"):
                return False
    return False


def _program(words: list[str]) -> list[str]:
    """The argv after `exec`, `env [-i] [VAR=x]...`, `nohup` and the like."""
    i = 0
    while i < len(words):
        w = words[i]
        env_arg = i > 0 and words[0] == "env" and ("=" in w or w.startswith("-"))
        if w in PREFIX_COMMANDS or env_arg:
            i += 1
            continue
        break
    return words[i:]


def _is_nested_shell(argv: list[str]) -> bool:
    return bool(argv) and posixpath.basename(argv[0]) in SHELLS and any(
        a.startswith("-") and not a.startswith("--") and "c" in a[1:] for a in argv[1:]
    )


class _Finder(bashlex.ast.nodevisitor):
    def __init__(self) -> None:
        self.found: list[EngineCommand] = []
        self.nested: list[str] = []

    def visitcommand(self, node: bashlex.ast.node, parts: list[bashlex.ast.node]) -> None:
        words = [p for p in parts if p.kind == "word"]
        argv = _program([w.word for w in words])
        if runs_vllm(argv):
            self.found.append(EngineCommand(tuple(argv), words[-1].pos[1]))
        elif _is_nested_shell(argv) and any("vllm" in a for a in argv):
            self.nested.append(" ".join(argv[:2]))


def engine_commands(script: str) -> tuple[EngineCommand, ...]:
    """Every vLLM server command of `script`, in order. Raises `Unclear` when unsure."""
    if len(script) <= CACHED_SCRIPT_CHARS:
        return _cached(script)
    return _parse(script)


@functools.lru_cache(maxsize=512)
def _cached(script: str) -> tuple[EngineCommand, ...]:
    return _parse(script)


def _parse(script: str) -> tuple[EngineCommand, ...]:
    if not script.strip():
        return ()
    try:
        trees = bashlex.parse(_QUOTED_HEREDOC.sub(r"\1 \3 ", script))
    except (bashlex.errors.ParsingError, NotImplementedError, IndexError, AttributeError) as exc:
        if "vllm" in script:
            raise Unclear(f"the shell script cannot be parsed ({_first_line(exc)})") from None
        return ()
    finder = _Finder()
    for tree in trees:
        finder.visit(tree)
    if finder.nested:
        raise Unclear(
            f"vLLM runs inside a nested shell string ({finder.nested[0]} ...), whose quoting "
            f"the webhook does not rewrite"
        )
    return tuple(finder.found)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:120]
