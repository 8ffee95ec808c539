"""The daemon's command-line options, the same for ``coordd`` and ``coord daemon``."""

from __future__ import annotations

import argparse

from coordinator.config.option_values import CLUSTER_FILE, FileToWrite


def add_daemon_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", required=True, type=CLUSTER_FILE, help="the cluster file (TOML); see: "
                        "coord init")
    parser.add_argument("--log-file", type=FileToWrite(), help="append JSON log lines here instead of stderr")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
