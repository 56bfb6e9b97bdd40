"""Offline text for calibration and evaluation, from packages only.

Four domains, each split into documents for calibration and documents held
out for evaluation (never both):

| domain | source | licence |
|---|---|---|
| prose | Jane Austen's six novels (Debian `r-cran-janeaustenr`) | public domain |
| news  | Reuters-21578 articles (Debian `r-cran-tm`, `texts/`) | free for research |
| docs  | CPython's `pydoc_data` topics | PSF |
| code  | CPython's standard library sources | PSF |

The Debian packages are fetched with `apt-get download` and unpacked with
`dpkg-deb` into the cache (nothing is installed); R's lazy-load database that
holds the novels is read by the small reader below.
"""

from __future__ import annotations

import html
import re
import struct
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from vllm_o3.tools.debian import DEFAULT_CACHE, unpack_debian_packages

DEBIAN_PACKAGES = ("r-cran-janeaustenr", "r-cran-tm")
SITE_LIBRARY = Path("usr/lib/R/site-library")

# Held-out documents per domain (everything else calibrates).
AUSTEN_HELD_OUT = ("prideprejudice", "sensesensibility")
HELD_OUT_EVERY = 3  # news / docs / code: every third document is held out
CODE_MODULES = (
    "argparse", "ast", "asyncio/base_events", "collections/__init__", "configparser",
    "csv", "dataclasses", "datetime", "email/message", "enum", "fractions",
    "functools", "http/client", "inspect", "json/decoder", "logging/__init__",
    "pathlib", "pickle", "random", "shutil", "statistics", "string", "subprocess",
    "tarfile", "textwrap", "threading", "typing", "urllib/parse", "uuid", "zipfile",
)  # fmt: skip


@dataclass
class Corpus:
    domain: str
    calibration: list[str]
    held_out: list[str]


def load_corpora(cache: Path = DEFAULT_CACHE) -> dict[str, Corpus]:
    """All four domains (fetching the Debian packages once)."""
    packages = fetch_debian_packages(cache)
    return {
        "prose": austen(packages / "janeaustenr"),
        "news": reuters(packages / "tm"),
        "docs": pydoc_topics(),
        "code": stdlib_code(),
    }


def fetch_debian_packages(cache: Path) -> Path:
    """Unpack the R packages' files into `cache/debian`; returns the
    site-library folder."""
    library = cache / "debian" / SITE_LIBRARY
    if not all(
        (library / name.removeprefix("r-cran-")).exists() for name in DEBIAN_PACKAGES
    ):
        unpack_debian_packages(list(DEBIAN_PACKAGES), cache / "debian")
    return library


def split(documents: list[str]) -> tuple[list[str], list[str]]:
    held_out = documents[HELD_OUT_EVERY - 1 :: HELD_OUT_EVERY]
    calibration = [
        d for i, d in enumerate(documents) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1
    ]
    return calibration, held_out


def austen(package: Path) -> Corpus:
    novels = read_rdb(package / "data" / "Rdata")
    calibration, held_out = [], []
    for name in sorted(novels):
        text = "\n".join(line for line in novels[name] if line is not None)
        (held_out if name in AUSTEN_HELD_OUT else calibration).append(text)
    return Corpus("prose", calibration, held_out)


def reuters(package: Path) -> Corpus:
    articles = []
    for path in sorted((package / "texts").glob("*/reut-*.xml")):
        match = re.search(r"<BODY>(.*?)</BODY>", path.read_text(errors="replace"), re.S)
        if match:
            articles.append(
                html.unescape(match.group(1)).replace(" Reuter", "").strip()
            )
    return Corpus("news", *split(articles))


def pydoc_topics() -> Corpus:
    from pydoc_data.topics import topics

    return Corpus("docs", *split([topics[k] for k in sorted(topics)]))


def stdlib_code() -> Corpus:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [(stdlib / f"{module}.py").read_text() for module in CODE_MODULES]
    return Corpus("code", *split(sources))


# -- R's serialization format (XDR, version 2/3): just what data needs ---------

NILVALUE, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = (
    254, 1, 2, 9, 10, 13, 14, 16, 19,
)  # fmt: skip


class RReader:
    """Unserializes R's binary XDR format for vectors, lists and attributes."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.data, self.pos = data, 2
        version = self.int()
        self.int(), self.int()  # writer and minimal reader versions
        if version == 3:
            length = self.int()  # of the native encoding's name, skipped
            self.pos += length
        self.symbols: list[str] = []

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def read(self):
        flags = self.int()
        kind, has_attributes, has_tag = (
            flags & 0xFF,
            flags & (1 << 9),
            flags & (1 << 10),
        )
        if kind == NILVALUE:
            return None
        if kind == 0xFF:  # REFSXP to an earlier symbol
            return self.symbols[(flags >> 8) - 1]
        if kind == SYMSXP:
            name = self.read()
            self.symbols.append(name)
            return name
        if kind == CHARSXP:
            length = self.int()
            if length == -1:
                return None  # NA_character_
            text = self.data[self.pos : self.pos + length].decode("utf-8", "replace")
            self.pos += length
            return text
        if kind == LISTSXP:  # a pairlist: attributes
            items = {}
            while kind == LISTSXP:
                if has_attributes:
                    self.read()
                tag = self.read() if has_tag else None
                items[tag] = self.read()
                flags = self.int()
                kind, has_attributes, has_tag = (
                    flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
                )  # fmt: skip
            return items
        if kind in (LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP):
            length = self.int()
            if kind in (STRSXP, VECSXP):
                value = [self.read() for _ in range(length)]
            else:
                size, code = (8, "d") if kind == REALSXP else (4, "i")
                value = list(
                    struct.unpack_from(f">{length}{code}", self.data, self.pos)
                )
                self.pos += size * length
            attributes = self.read() if has_attributes else {}
            names = attributes.get("names")
            return dict(zip(names, value, strict=True)) if names else value
        raise ValueError(f"R object type {kind} is not supported by this reader")


def decompress(blob: bytes) -> bytes:
    """A gzip file (`.rdx`), or one `.rdb` entry: 4-byte length, then zlib
    data, or a method byte (Z zlib, 2 bzip2, X xz, 0 none) and the data."""
    import bz2
    import gzip
    import lzma

    if blob[:2] == b"\x1f\x8b":
        return gzip.decompress(blob)
    try:
        return zlib.decompress(blob[4:])
    except zlib.error:
        method, data = blob[4:5], blob[5:]
    openers = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress}
    return openers.get(method, bytes)(data)


def read_rdb(stem: Path) -> dict:
    """The objects of R's lazy-load database `stem.rdb` / `stem.rdx`."""
    index = RReader(decompress(stem.with_suffix(".rdx").read_bytes())).read()
    database = stem.with_suffix(".rdb").read_bytes()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        objects[name] = RReader(decompress(database[offset : offset + length])).read()
    return objects
