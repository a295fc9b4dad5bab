"""``sluice keys``: make API keys. Sluice stores only their SHA-256; the key itself is shown once."""

from __future__ import annotations

import argparse
import secrets
import sys

from sluice.api.auth import hash_key


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    new = sub.add_parser("new", help="make a new key and print the config entry that admits it")
    new.add_argument(
        "--tenant", required=True, help="who the key belongs to (fair sharing and limits are per tenant)"
    )
    new.add_argument("--admin", action="store_true", help="the key may call the /admin endpoints")
    hashed = sub.add_parser("hash", help="print the SHA-256 of an existing key (read from stdin)")
    hashed.set_defaults(keys_command="hash")


def run(args: argparse.Namespace) -> int:
    if args.keys_command == "hash":
        key = sys.stdin.readline().strip()
        if not key:
            print("sluice keys hash: give the key on standard input", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0
    key = "sk-sluice-" + secrets.token_urlsafe(32)
    print(f"# key (shown once; give it to {args.tenant}): {key}")
    print("[[keys]]")
    print(f'key_sha256 = "{hash_key(key)}"')
    print(f'tenant = "{args.tenant}"')
    if args.admin:
        print("admin = true")
    print("# optional: max_priority, weight, rpm, tpm, max_concurrent, max_queued, max_connections,")
    print("# webhook_secret (see docs/security.md)")
    return 0
