"""``freeride keys``: CURVE keys for ``--tcp``, and the cluster queue's shared secret."""

from __future__ import annotations

import argparse

from freeride import auth
from freeride.cli import common
from freeride.cli.common import Subparsers
from freeride.cluster import signing
from freeride.transport import curve_keypair

__all__ = ["add_parsers", "cmd_keys"]


def cmd_keys(args: argparse.Namespace) -> int:
    keys_dir = common.keys_dir(args)
    if args.cluster:
        try:
            path = signing.create_secret(keys_dir, force=args.force)
        except FileExistsError:
            raise SystemExit(
                f"freeride: {keys_dir / signing.SECRET_FILE} exists; --force replaces it (every node and submitter"
                " then needs the new one)"
            ) from None
        print(f"freeride: cluster secret written to {path} (mode 0600)")
        print("  copy it, private, into the keys directory of every node (`cluster join`) and every submitter")
        print("  (`cluster submit`): nodes holding it run only jobs signed with it")
        return 0
    auth.create_keys(keys_dir, keypair=curve_keypair, force=args.force)
    print(f"freeride: CURVE keys written to {keys_dir} (mode 0700)")
    print("  serve --tcp and clients on this host use them; for another host copy the directory (keep it 0700)")
    print(f"  more clients: put their public *.key files in {keys_dir / 'authorized'}")
    return 0


def add_parsers(subs: Subparsers) -> None:
    s = subs.add_parser(
        "keys",
        help="make CURVE keys for --tcp (server, client, authorized clients)",
        description="Write a server and a client CURVE key pair into a private keys directory (see docs/security.md).",
    )
    s.add_argument("--keys-dir", metavar="DIR", help=f"where (default ${auth.KEYS_ENV} or {auth.default_keys_dir()})")
    s.add_argument("--force", action="store_true", help="replace existing keys (clients then need the new ones)")
    s.add_argument(
        "--cluster",
        action="store_true",
        help=f"make the cluster queue's shared secret instead ({signing.SECRET_FILE}): nodes holding it run only"
        " jobs signed with it",
    )
    s.set_defaults(fn=cmd_keys)
