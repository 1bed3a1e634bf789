"""``bagserve sign`` and ``bagserve verify-signature``: signed model releases."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["register"]


def _cmd_sign(args: argparse.Namespace) -> int:
    import os

    from ..core.signing import sign_model, signature_key_sha256

    password = None
    if args.password_env:
        # From the environment, never the command line (which `ps` shows to everyone).
        password = os.environ.get(args.password_env)
        if password is None:
            raise ValueError(f"the environment variable {args.password_env} is not set")
    signature = sign_model(args.model, args.key, password=password)
    print(f"{signature}: signed with the key of sha256 {signature_key_sha256(args.model)}")
    return 0


def _key_entries(values: Sequence[str]) -> list[str]:
    """``--trusted-key`` values, each one entry, a comma-separated list or a JSON list,
    as ``BAGSERVE_TRUSTED_KEYS`` is written."""
    entries: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            entries += [str(v) for v in json.loads(value)]
        else:
            entries += [v.strip() for v in value.split(",") if v.strip()]
    return entries


def _cmd_verify_signature(args: argparse.Namespace) -> int:
    from ..core.signing import load_trusted_keys, verify_model

    keys = load_trusted_keys(_key_entries(args.trusted_keys))
    # A SignatureError (an ArtifactError) is reported by main(): "error: ...", exit 1.
    signer = verify_model(args.model, keys)
    print(f"ok: {args.model} signed by {signer.name} (key sha256 {signer.key_sha256})")
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``bagserve`` parser's subcommands."""
    sg = sub.add_parser(
        "sign",
        help="sign a model version for release (OpenSSF model-signing, elliptic-curve key)",
    )
    sg.add_argument("model", help="the model version's directory (MODELS_DIR/<name>/<version>)")
    sg.add_argument("--key", required=True, help="the private key, PEM (kept offline)")
    sg.add_argument(
        "--password-env", metavar="VAR", help="the environment variable holding its password"
    )
    sg.set_defaults(func=_cmd_sign)
    vs = sub.add_parser(
        "verify-signature", help="check a model version's signature against trusted keys"
    )
    vs.add_argument("model", help="the model version's directory")
    vs.add_argument(
        "--trusted-key",
        "--trusted-keys",
        dest="trusted_keys",
        action="append",
        required=True,
        metavar="KEY",
        help="PATH or NAME=PATH of a PEM public key, or a directory of them (repeatable, "
        "or a list written as BAGSERVE_TRUSTED_KEYS); exit 1 with the reason unless the "
        "signature verifies against one of them",
    )
    vs.set_defaults(func=_cmd_verify_signature)
