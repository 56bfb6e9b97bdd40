"""The API contract: the OpenAPI schema a server with the O3 plugin serves,
against the snapshot committed in `tests/contract/openapi.json`, diffed for
breaking changes (removed path, operation, response or field, new required
field, narrowed type) by Optic (`@useoptic/optic` from the npm registry,
installed into the cache on first use at the version the lock file pins).

    python -m vllm_o3.tools.api_contract MODEL           # exit 1 if it breaks clients
    python -m vllm_o3.tools.api_contract MODEL --update  # accept an intended change
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from vllm_o3.tools.debian import DEFAULT_CACHE

CONTRACT = Path(__file__).resolve().parents[2] / "tests" / "contract"
SNAPSHOT = CONTRACT / "openapi.json"
STANDARD = CONTRACT / "optic-standard.yml"
OPTIC_MANIFEST = CONTRACT / "optic"
# npm's error codes for a registry it cannot reach.
NETWORK_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT")


class OpticUnavailable(RuntimeError):
    """No npm, or no npm registry, to install Optic from."""


def optic_program(cache: Path = DEFAULT_CACHE) -> Path:
    """Optic installed with `npm ci` from the committed manifest and lock file
    into the cache, all or nothing."""
    lock = (OPTIC_MANIFEST / "package-lock.json").read_bytes()
    root = cache / f"optic-{hashlib.sha256(lock).hexdigest()[:12]}"
    program = root / "node_modules" / ".bin" / "optic"
    if program.exists():
        return program
    npm = shutil.which("npm")
    if npm is None:
        raise OpticUnavailable("npm (Node.js) is needed to install Optic")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="optic-partial-") as scratch:
        for name in ("package.json", "package-lock.json"):
            shutil.copy(OPTIC_MANIFEST / name, scratch)
        result = subprocess.run(
            [npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
            cwd=scratch,
            capture_output=True,
            text=True,
        )
        if result.returncode:
            error = (
                OpticUnavailable
                if any(code in result.stderr for code in NETWORK_ERRORS)
                else RuntimeError
            )
            raise error(f"npm ci of Optic failed:\n{result.stderr[-2000:]}")
        Path(scratch).rename(root)
    return program


def served_schema(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=60) as reply:
        return json.load(reply)


def write_schema(schema: dict, path: Path) -> None:
    """Sorted and indented, so that a snapshot update reads as a diff."""
    path.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


def breaking_changes(
    before: Path, after: Path, cache: Path = DEFAULT_CACHE
) -> tuple[list[str], str]:
    """Optic's breaking-change findings going from `before` to `after`, and
    its whole report."""
    result = subprocess.run(
        [
            str(optic_program(cache)),
            "diff",
            str(before),
            str(after),
            "--check",
            "--standard",
            str(STANDARD),
            "--severity",
            "error",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OPTIC_TELEMETRY_LEVEL": "off", "NO_COLOR": "1"},
        timeout=600,
    )
    report = result.stdout + result.stderr
    findings = [
        line.strip()
        for line in report.splitlines()
        if "This is a breaking change" in line
    ]
    if result.returncode and not findings:
        raise RuntimeError(f"optic failed ({result.returncode}):\n{report}")
    return findings, report


def main(argv: list[str] | None = None) -> None:
    from vllm_o3.tools.server import O3_SERVE_ARGS, start_server, stop_server

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint folder to serve")
    parser.add_argument(
        "--update", action="store_true", help="write the served schema as the snapshot"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "server.log"
        server = start_server(args.model, log, "--max-model-len", "256", *O3_SERVE_ARGS)
        try:
            schema = served_schema(server.url)
        finally:
            stop_server(server)
        served = Path(scratch) / "openapi.json"
        write_schema(schema, served)
        if args.update and not SNAPSHOT.exists():
            shutil.copy(served, SNAPSHOT)
            print(f"wrote {SNAPSHOT}")
            return
        findings, report = breaking_changes(SNAPSHOT, served)
        print(report)
        if args.update:
            shutil.copy(served, SNAPSHOT)
            print(f"wrote {SNAPSHOT} ({len(findings)} breaking changes accepted)")
        elif findings:
            sys.exit(1)


if __name__ == "__main__":
    main()
