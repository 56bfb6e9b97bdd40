"""Programs and data from Debian packages, without installing them or needing
root: `apt-get download` the .deb files and unpack them into the cache."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

# Downloads (packages, text, parent models) go here, never into the repository.
DEFAULT_CACHE = Path.home() / ".cache" / "vllm_o3"


def unpack_debian_packages(packages: list[str], target: Path) -> None:
    """Download `packages` and unpack their files under `target`, all or
    nothing (an interrupted fetch leaves `target` as it was)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise RuntimeError(f"apt-get and dpkg-deb are needed to fetch {packages}")
    with tempfile.TemporaryDirectory() as scratch:
        download = ["apt-get", "download", *packages]
        if subprocess.run(download, cwd=scratch, capture_output=True).returncode:
            subprocess.run(["apt-get", "update"], capture_output=True)
            subprocess.run(download, cwd=scratch, check=True, capture_output=True)
        unpacked = Path(scratch) / "root"
        for deb in Path(scratch).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copytree(unpacked, target, symlinks=True, dirs_exist_ok=True)


def debian_program(
    package: str, path: str, name: str, cache: Path = DEFAULT_CACHE
) -> Path:
    """`name` from PATH when installed, else `path` of `package` unpacked
    into the cache on first use."""
    if installed := shutil.which(name):
        return Path(installed)
    root = cache / package
    if not (root / path).exists():
        unpack_debian_packages([package], root)
    return root / path
