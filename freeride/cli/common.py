"""What every command shares: where the manager is, how to reach it, and the parsing of shared options."""

from __future__ import annotations

import argparse
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import TypeAlias

from freeride import auth
from freeride.transport import ControlClient, Endpoints, default_runtime_dir
from freeride.transport.endpoints import RUNTIME_DIR_ENV

__all__ = [
    "Subparsers",
    "add_runtime",
    "control",
    "endpoints",
    "export_keys_dir",
    "find_command",
    "keys_dir",
    "parse_cores",
    "parse_opts",
    "runtime_dir",
]


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""The parser's sub-commands, to which each command module adds its own."""


def runtime_dir(args: argparse.Namespace) -> Path:
    """``--runtime-dir``, else the default (see :func:`~freeride.transport.default_runtime_dir`)."""
    return Path(args.runtime_dir) if args.runtime_dir else default_runtime_dir()


def endpoints(args: argparse.Namespace) -> Endpoints:
    where = runtime_dir(args)
    if getattr(args, "tcp", None):
        host, _, port = args.tcp.rpartition(":")
        return Endpoints.tcp(host or "127.0.0.1", int(port), where)
    return Endpoints.ipc(where)


def add_runtime(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--runtime-dir",
        metavar="DIR",
        help=f"where the manager's sockets live (default ${RUNTIME_DIR_ENV} if set, else $XDG_RUNTIME_DIR/freeride or"
        f" TMP/freeride-UID: here {default_runtime_dir()}); must match `freeride serve`",
    )
    sub.add_argument(
        "--tcp",
        metavar="HOST:PORT",
        help="use tcp:// (events on PORT, control on PORT+1) instead of ipc; needs CURVE keys (`freeride keys`)",
    )
    sub.add_argument(
        "--keys-dir",
        metavar="DIR",
        help=f"CURVE keys for --tcp (default ${auth.KEYS_ENV} or {auth.default_keys_dir()}); see `freeride keys`",
    )


def keys_dir(args: argparse.Namespace) -> Path:
    return Path(args.keys_dir) if getattr(args, "keys_dir", None) else auth.default_keys_dir()


def export_keys_dir(args: argparse.Namespace, env: MutableMapping[str, str]) -> None:
    """Let child processes' event emitters find the keys of --keys-dir (they read the default place)."""
    if getattr(args, "keys_dir", None):
        env[auth.KEYS_ENV] = str(Path(args.keys_dir).resolve())


def control(args: argparse.Namespace) -> ControlClient:
    endpoint = endpoints(args).control
    curve = auth.load_client_keys(keys_dir(args)) if endpoint.startswith("tcp://") else None
    return ControlClient(endpoint, timeout_s=args.timeout, curve=curve)


def parse_opts(pairs: Sequence[str]) -> dict[str, str | int | float | bool]:
    opts: dict[str, str | int | float | bool] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"freeride: --opt expects key=value, got {pair!r}")
        value: str | int | float | bool = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    continue
        opts[key.replace("-", "_")] = value
    return opts


def parse_cores(text: str) -> tuple[int, ...]:
    """``0-3,8`` as (0, 1, 2, 3, 8)."""
    cores: list[int] = []
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise SystemExit(f"freeride: --cores expects a list like 0-3,8, got {text!r}") from None
    return tuple(cores)


def find_command(command: Sequence[str], env: dict[str, str]) -> str:
    from freeride.backends.launch import CommandNotFound, find_command

    try:
        return find_command(command[0], env)
    except CommandNotFound as exc:
        print(f"freeride: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
