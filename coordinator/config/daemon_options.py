"""The daemon's command-line options, the same for ``coordd`` and ``coord daemon``."""

from __future__ import annotations

import argparse


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", required=True, help="the cluster file (TOML); see: coord init")
    parser.add_argument("--log-file", help="append JSON log lines here instead of stderr")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
