"""The agent as shipped to a node: a zip of ``agent/``, ``shared/``, ``coord_script/`` (the helpers a
training script imports) and a pure-Python msgpack.

A node needs only its own Python (with mlx and mlx-lm) for coord to work there.
The daemon installs the bundle into a private directory under the node user's
home, named by the bundle's content digest, so a node can hold several versions
side by side, an upgrade never touches a running agent, and two users of one Mac
never share an install. The same shell words are used for local and SSH nodes.
"""

from __future__ import annotations

import hashlib
import io
import shlex
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import msgpack

from shared.version import COORD_VERSION

#: Exit status of the start command when the bundle is not installed on the node.
NOT_INSTALLED = 97
INSTALL_ROOT = "$HOME/.coord/agent"

_REPO = Path(__file__).resolve().parents[2]  # the directory that holds agent/ and shared/
_PACKAGES = ("agent", "shared", "coord_script")  # coord_script: the helpers a training script imports


@dataclass(frozen=True)
class AgentBundle:
    digest: str
    data: bytes

    @property
    def bundle_id(self) -> str:
        return f"{COORD_VERSION}-{self.digest[:16]}"

    @property
    def install_dir(self) -> str:
        """The node-side directory, as a shell expression (``$HOME`` is the node user's)."""
        return f"{INSTALL_ROOT}/{self.bundle_id}"

    def start_command(self, python: str) -> str:
        """Shell words that start the agent, or exit NOT_INSTALLED when it is missing."""
        d = f'"{self.install_dir}"'
        return (
            f"test -f {d}/BUNDLE_ID || exit {NOT_INSTALLED}; "
            f"cd {d} && PYTHONPATH={d} exec {shlex.quote(python)} -m agent"
        )

    def install_command(self, python: str) -> str:
        """Shell words that read the zip from stdin and install it atomically."""
        return (
            f'mkdir -p "{INSTALL_ROOT}" && chmod 700 "$HOME/.coord" && '
            f"{shlex.quote(python)} -c {shlex.quote(_INSTALLER)} \"{self.install_dir}\""
        )


# Runs on the node with the node's Python: unpack into a temporary sibling, then
# rename, so a half-written install is never started. A concurrent installer of
# the same digest may win the rename; that is fine, the content is identical.
_INSTALLER = """\
import io, os, shutil, sys, tempfile, zipfile
target = sys.argv[1]
data = sys.stdin.buffer.read()
tmp = tempfile.mkdtemp(prefix=".install-", dir=os.path.dirname(target))
try:
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp)
    os.chmod(tmp, 0o755)
    try:
        os.rename(tmp, target)
    except OSError:
        if not os.path.isfile(os.path.join(target, "BUNDLE_ID")):
            raise
finally:
    shutil.rmtree(tmp, ignore_errors=True)
"""


def _bundle_files() -> list[tuple[str, Path]]:
    files: list[tuple[str, Path]] = []
    for package in _PACKAGES:
        for path in sorted((_REPO / package).rglob("*.py")):
            files.append((path.relative_to(_REPO).as_posix(), path))
    vendored = Path(msgpack.__file__).resolve().parent
    for path in sorted(vendored.glob("*.py")):  # pure Python only: works on any platform
        files.append((f"_vendor/msgpack/{path.name}", path))
    return files


@lru_cache(maxsize=1)
def build_bundle() -> AgentBundle:
    """Zip the agent deterministically; the digest names its content."""
    files = [(name, path.read_bytes()) for name, path in _bundle_files()]
    digest = hashlib.sha256()
    for name, content in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    hexdigest = digest.hexdigest()
    bundle_id = f"{COORD_VERSION}-{hexdigest[:16]}"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in files + [("BUNDLE_ID", bundle_id.encode() + b"\n")]:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, content)
    return AgentBundle(digest=hexdigest, data=buffer.getvalue())


def write_bundle(path: str | Path) -> AgentBundle:
    bundle = build_bundle()
    Path(path).write_bytes(bundle.data)
    return bundle
