"""`tandem ray-token`: print (creating if needed) this machine's Ray token file."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "ray-token", help="Print the path of this machine's Ray token file.",
        description="Print the file holding the token every Ray instance tandem starts or joins "
                    "authenticates with (ray_auth_token in $TANDEM_CACHE or ~/.cache/tandem), "
                    "creating a random one (mode 0600) if there is none. `ray up` copies it to "
                    "every node (deploy/*.yaml).")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tandem.deploy.ray_auth import ensure_token_file, token_file

    print(ensure_token_file(token_file()))
    return 0
