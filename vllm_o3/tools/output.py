"""Output folders that an interrupted job never leaves half-written."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a scratch folder beside `out`; it becomes `out` only on success.

    On any exception (Ctrl-C included) the scratch folder is removed and `out`
    is left as it was.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --force to replace it")
    scratch = out.with_name(f".{out.name}.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    scratch.rename(out)
