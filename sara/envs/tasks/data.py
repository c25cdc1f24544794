"""Loading task records from local files or an offline Hugging Face ``datasets`` cache (never a download)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import Field

from sara.config import ConfigError, SaraModel

__all__ = ["DataConfig", "load_records", "load_hf_offline", "load_splits"]


class DataConfig(SaraModel):
    """Where a dataset-backed task reads its records (default: the small set bundled with sara)."""

    path: str | None = None
    """Training records: a local ``.jsonl`` / ``.json`` / ``.parquet`` file."""
    eval_path: str | None = None
    """Held-out records, same formats."""
    hf_dataset: str | None = None
    """A Hugging Face dataset name read from the local cache in offline mode (never downloaded)."""
    hf_config: str | None = None
    """Its configuration name (e.g. ``"main"`` for GSM8K)."""
    hf_split: str = "train"
    """Its training split."""
    hf_eval_split: str | None = None
    """Its held-out split."""
    eval_size: int = Field(0, ge=0)
    """Without an explicit held-out source, move this many records from the end of the training records to eval."""
    max_prompts: int | None = Field(None, ge=1)
    """Keep only the first ``max_prompts`` training records."""


def load_records(path: str | os.PathLike[str], *, what: str) -> list[dict[str, Any]]:
    """Records of a ``.jsonl``, ``.json`` (a list of objects) or ``.parquet`` file.

    A data file is untrusted: invalid UTF-8, invalid JSON, JSON nested too deeply and integers too long to convert
    are all one-line errors naming the file (and the line of a ``.jsonl``).

    Raises:
        ConfigError: Missing file, unknown extension, or a malformed file or line (the message names the file and line).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: data file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        records = []
        try:
            with p.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    rec = _json(line, f"{what}: {p}:{lineno}")
                    if not isinstance(rec, dict):
                        raise ConfigError(f"{what}: {p}:{lineno}: expected a JSON object per line")
                    records.append(rec)
        except UnicodeDecodeError:
            raise ConfigError(f"{what}: {_bad_byte(p)}: not UTF-8 text; save the file as UTF-8") from None
        return records
    if suffix == ".json":
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{what}: {_bad_byte(p)}: not UTF-8 text; save the file as UTF-8") from None
        data = _json(text, f"{what}: {p}")
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ConfigError(f"{what}: {p}: expected a JSON list of objects")
        return data
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{what}: reading {p.name} needs pyarrow (pip install pyarrow)") from None
        try:
            return pq.read_table(p).to_pylist()
        except Exception as exc:  # pyarrow.ArrowInvalid & co: not a parquet file, truncated, ...
            raise ConfigError(f"{what}: {p}: not a readable parquet file ({exc})") from None
    raise ConfigError(f"{what}: unsupported data file {p.name!r}; use .jsonl, .json or .parquet")


def _bad_byte(path: Path) -> str:
    """``"<path>:<line>: byte 0x.. at column <c>"``: where the first byte that is not UTF-8 is.

    The file is read again line by line in binary (a text reader decodes in chunks, so the line it reached is not
    the line of the byte); ``b"\\n"`` never occurs inside a UTF-8 sequence, so each line decodes on its own.
    """
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"{path}:{lineno}: byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
    return str(path)  # pragma: no cover - the file changed between the two reads


def _json(text: str, where: str) -> Any:
    """``json.loads(text)``; any failure is a ``ConfigError`` starting with ``where``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer literal over Python's int-to-str limit
        raise ConfigError(f"{where}: invalid JSON ({str(exc)[:120]})") from None


def load_hf_offline(name: str, config: str | None, split: str, *, what: str) -> list[dict[str, Any]]:
    """Records of a dataset already in the local Hugging Face cache; offline mode is forced, nothing is downloaded.

    Raises:
        ConfigError: ``datasets`` is missing, was imported without offline mode, or the dataset is not cached.
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{what}: hf_dataset needs the 'datasets' package; or export the data to a .jsonl file "
                          "and pass path=") from None
    offline = getattr(datasets.config, "HF_HUB_OFFLINE", False) or getattr(datasets.config, "HF_DATASETS_OFFLINE",
                                                                           False)
    if not offline:
        raise ConfigError(f"{what}: 'datasets' was imported before offline mode was set; export "
                          "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 (sara never downloads data at run time)")
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # not cached, wrong split, ...
        raise ConfigError(f"{what}: could not load {name!r} ({config}, {split}) from the offline cache: {exc}") from None
    return [dict(r) for r in ds]


def load_splits(cfg: DataConfig, bundled: Path, *, what: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, eval)`` records from the configured source (``bundled`` when none is given)."""
    if cfg.path and cfg.hf_dataset:
        raise ConfigError(f"{what}: give either field 'path' or field 'hf_dataset', not both")
    if cfg.path:
        train = load_records(cfg.path, what=what)
    elif cfg.hf_dataset:
        train = load_hf_offline(cfg.hf_dataset, cfg.hf_config, cfg.hf_split, what=what)
    else:
        train = load_records(bundled, what=what)
    held_out: list[dict[str, Any]] = []
    if cfg.eval_path:
        held_out = load_records(cfg.eval_path, what=what)
    elif cfg.hf_dataset and cfg.hf_eval_split:
        held_out = load_hf_offline(cfg.hf_dataset, cfg.hf_config, cfg.hf_eval_split, what=what)
    elif cfg.eval_size:
        if cfg.eval_size >= len(train):
            raise ConfigError(f"{what}: field 'eval_size': {cfg.eval_size} leaves no training records "
                              f"(there are {len(train)})")
        train, held_out = train[:-cfg.eval_size], train[-cfg.eval_size:]
    if cfg.max_prompts is not None:
        train = train[:cfg.max_prompts]
    if not train:
        raise ConfigError(f"{what}: no training records")
    return train, held_out
