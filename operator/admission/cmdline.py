"""An engine container's command line, read the way its shell and vLLM's parser read it.

Where the flags live (a command list, a `sh -c` script, the image's entrypoint), which
program runs (vLLM's server or something else) and what value a flag has. Pure functions;
the injectors in `inject` write the flags back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightcache.operator.admission import shellscript
from weightcache.operator.admission.shellscript import SHELLS, VLLM_SERVER_MODULES


@dataclass
class Argv:
    """Where a container's command line lives and how to append to it.

    kind: `list` (vLLM in command/args), `shell` (vLLM inside a `sh -c` string; `tokens`
    are its first vLLM command's words, `commands` all of them),
    `entrypoint` (no command: the image's entrypoint gets args), `none` (some other program).
    """

    kind: str
    tokens: list[str]
    shell_field: str | None = None  # "command" or "args" holding the script
    shell_index: int | None = None
    commands: tuple[shellscript.EngineCommand, ...] = ()  # kind `shell`: each vLLM command


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


def parse_argv(container: dict[str, Any]) -> Argv:
    shell = _shell_script(container)
    if shell is not None:
        fld, idx, script = shell
        commands = shellscript.engine_commands(script)  # raises shellscript.Unclear
        if commands:
            return Argv("shell", list(commands[0].words), fld, idx, commands)
        return Argv("none", [], fld, idx)
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
