"""Credentials from an AWS profile, the second link of the AWS chain after the environment: the profile
``AWS_PROFILE`` names (else ``default``) in ``~/.aws/credentials`` and ``~/.aws/config`` (or the files
``AWS_SHARED_CREDENTIALS_FILE`` and ``AWS_CONFIG_FILE`` name), as the AWS CLI writes them. obstore reads
the environment only; this gives it what a profile holds where the environment names no keys. Static
keys and temporary ones with their session token; not SSO or a role to assume (set the variables for
those)."""

from __future__ import annotations

import configparser
import contextlib
from collections.abc import Mapping
from pathlib import Path

#: obstore's S3 option for each key a profile holds.
_KEYS = {"aws_access_key_id": "aws_access_key_id", "aws_secret_access_key": "aws_secret_access_key",
         "aws_session_token": "aws_session_token"}


def _read(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser()
    # A file that cannot be read gives nothing: the store's error then says there are no credentials.
    with contextlib.suppress(configparser.Error, OSError, UnicodeDecodeError):
        parser.read(path, encoding="utf-8")
    return parser


def profile_config(env: Mapping[str, str]) -> dict[str, str]:
    """obstore's S3 options from the profile, for what the environment does not set (it wins, as in
    the AWS chain); empty where the environment names keys or there is no such profile."""
    if env.get("AWS_ACCESS_KEY_ID"):
        return {}
    name = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(env.get("HOME") or Path.home())
    credentials = _read(Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials"))
    config = _read(Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config"))
    section = name if name == "default" else f"profile {name}"
    found: dict[str, str] = {}
    for parser, where in ((config, section), (credentials, name)):  # the credentials file wins
        if parser.has_section(where):
            for key, option in _KEYS.items():
                value = parser.get(where, key, fallback="").strip()
                if value:
                    found[option] = value
    if "aws_access_key_id" not in found:
        return {}
    region = config.get(section, "region", fallback="").strip() if config.has_section(section) else ""
    if region and not env.get("AWS_REGION"):
        found["aws_region"] = region
    endpoint = config.get(section, "endpoint_url", fallback="").strip() if config.has_section(section) else ""
    if endpoint and not env.get("AWS_ENDPOINT_URL"):
        found["aws_endpoint"] = endpoint
    return found
