"""An engine container's command line, read the way its shell and vLLM's parser read it.

Where the flags live (a command list, a `sh -c` script, the image's entrypoint), which
program runs (vLLM's server or something else) and what value a flag has. Pure functions;
the injectors in `inject` write the flags back.
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from typing import Any

SHELLS = {"sh", "bash", "ash", "dash", "zsh", "ksh"}
VLLM_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")


@dataclass
class Argv:
    """Where a container's command line lives and how to append to it.

    kind: `list` (vLLM in command/args), `shell` (vLLM inside a `sh -c` string),
    `entrypoint` (no command: the image's entrypoint gets args), `none` (some other program).
    """

    kind: str
    tokens: list[str]
    shell_field: str | None = None  # "command" or "args" holding the script
    shell_index: int | None = None


# Where flags go in a shell script: right after `vllm serve [MODEL]` or the server module, so
# they stay inside that command whatever follows it in the script.
SERVE_RE = re.compile(
    r"(?:\bvllm\s+serve\b(?:[ \t]+(?![-'\"$])[^\s;&|()<>]+)?"
    r"|-m\s+(?:" + "|".join(re.escape(m) for m in VLLM_SERVER_MODULES) + r")\b)"
)


def _runs_vllm(tokens: list[str]) -> bool:
    for i, tok in enumerate(tokens):
        base = tok.rsplit("/", 1)[-1]
        if base == "vllm" and i + 1 < len(tokens) and tokens[i + 1] == "serve":
            return True
        if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1] in VLLM_SERVER_MODULES:
            return True
        if tok in VLLM_SERVER_MODULES:
            return True
    return False


def _shell_script(container: dict[str, Any]) -> tuple[str, int, str] | None:
    """Find `sh -c SCRIPT` in command+args; return (field, index, script)."""
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    argv = command + args
    if not argv or argv[0].rsplit("/", 1)[-1] not in SHELLS:
        return None
    for i, tok in enumerate(argv[1:], start=1):
        if tok.startswith("-") and not tok.startswith("--") and "c" in tok[1:]:
            if i + 1 >= len(argv):
                return None
            j = i + 1
            return (
                ("command", j, argv[j]) if j < len(command) else ("args", j - len(command), argv[j])
            )
        if not tok.startswith("-"):
            return None
    return None


CACHED_SCRIPT_CHARS = 8192  # longer scripts are split every time (bounds the cache's memory)


def _split_script(script: str) -> tuple[str, ...]:
    """Shell words of a script, with `;`, `&&`, `|` ... as words of their own.

    Cached: the pods of one Deployment or LeaderWorkerSet carry the same script, and shlex
    reads character by character (a quarter of a millisecond for a typical script).
    """
    if len(script) <= CACHED_SCRIPT_CHARS:
        return _split_cached(script)
    return _split_uncached(script)


@functools.lru_cache(maxsize=512)
def _split_cached(script: str) -> tuple[str, ...]:
    return _split_uncached(script)


def _split_uncached(script: str) -> tuple[str, ...]:
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return tuple(lexer)
    except ValueError:  # unbalanced quotes: fall back to whitespace
        return tuple(script.split())


def parse_argv(container: dict[str, Any]) -> Argv:
    shell = _shell_script(container)
    if shell is not None:
        fld, idx, script = shell
        tokens = list(_split_script(script))
        if SERVE_RE.search(script):
            return Argv("shell", tokens, fld, idx)
        return Argv("none", tokens, fld, idx)
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    tokens = command + args
    if _runs_vllm(tokens):
        return Argv("list", tokens)
    if not command and (not args or args[0].startswith("-")):
        return Argv("entrypoint", tokens)
    return Argv("none", tokens)


def flag_values(tokens: list[str], *names: str) -> list[str]:
    """Values of a flag given as `--flag value` or `--flag=value` (dashes or underscores)."""
    wanted = {n.replace("_", "-") for n in names}
    found: list[str] = []
    for i, tok in enumerate(tokens):
        if not tok.startswith("-"):
            continue
        key, eq, value = tok.partition("=")
        if key.replace("_", "-") not in wanted:
            continue
        if eq:
            found.append(value)
        elif i + 1 < len(tokens):
            found.append(tokens[i + 1])
    return found


def model_arg(tokens: list[str]) -> str | None:
    """The engine's model: `--model X` or the positional after `vllm serve`."""
    values = flag_values(tokens, "--model")
    if values:
        return values[-1]
    for i, tok in enumerate(tokens):
        if tok.rsplit("/", 1)[-1] == "vllm" and i + 2 < len(tokens) and tokens[i + 1] == "serve":
            candidate = tokens[i + 2]
            if not candidate.startswith("-"):
                return candidate
    return None
