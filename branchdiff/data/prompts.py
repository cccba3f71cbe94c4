"""Prompt sources, and the per-iteration prompt draw.

A source is a named set or a file:
- `tiny:train`, `tiny:held_out`, `tiny:all`: the built-in task's grammar splits; `tiny-video:train`,
  `tiny-video:held_out`, `tiny-video:all`: the built-in video task's;
- `hpdv2` (all four styles) or `hpdv2:<style>` (anime, concept-art, paintings, photo): the HPDv2
  benchmark prompts (800 per style), read from `$BRANCHDIFF_DATA/hpdv2/<style>.json` (default
  `~/.cache/branchdiff/hpdv2`), or fetched once from the hub dataset `zhwang/HPDv2`
  (`benchmark/<style>.json`, a JSON list of prompts) when online and cached there;
- the public sets branchdiff fetches and checks (branchdiff/data/datasets.py, docs/benchmarks.md): `geneval` (GenEval's 553
  prompts, each with its tag and objects), `drawbench` (200), `hpdv2-test` (the 400 HPDv2 test prompts of MixGRPO and
  BranchGRPO), `hpd-train` (the HPD training prompts of DanceGRPO and BranchGRPO), `flow-grpo-geneval:train|test`,
  `flow-grpo-ocr:train|test`, `flow-grpo-pickscore:train|test` (Flow-GRPO's splits);
- a `.txt` file (one prompt a line), a `.jsonl` file (one object a line with a "prompt" field; the
  other fields are the prompt's metadata), or a `.csv` file (a "prompt" column; the other columns
  are metadata). An "image" field or column names the prompt's source images for instruction
  editing and image-to-video (`branchdiff.data.sources`: checked when the file is read, kept as `sources`
  paths); a "negative_prompt" field or column, a string, the prompt's own negative prompt for a CFG
  family's unconditional rows (blank: the family's; docs/prompts.md).
Every prompt carries a metadata dict (`style` for hpdv2), which rewards receive and evaluation
groups its tables by.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from branchdiff.data import tiny_task, tiny_video_task
from branchdiff.data.sources import FIT, FITS, MASK, SOURCES, check_mask, resolve_image, resolve_sources
from branchdiff.errors import quote, read_utf8


def _grammar_split(task, split: str) -> list:
    """A built-in task's prompts (`split`: train, held_out or all)."""
    return task.all_prompts() if split == "all" else task.split_prompts()[split == "held_out"]


TINY_SOURCES = {f"{name}:{split}": partial(_grammar_split, task, split)
                for name, task in (("tiny", tiny_task), ("tiny-video", tiny_video_task)) for split in ("train", "held_out", "all")}
FETCHED_SOURCES = {  # prompt source: (data set, file) of branchdiff/data/datasets.py
    "geneval": ("geneval", "evaluation_metadata.jsonl"), "drawbench": ("drawbench", "drawbench.json"),
    "hpdv2-test": ("mixgrpo-hpdv2-test", "prompts_test.txt"), "hpd-train": ("dancegrpo-hpd", "prompts.txt"),
    **{f"flow-grpo-{task}:{split}": (f"flow-grpo-{task}", f"{split}{'_metadata.jsonl' if task == 'geneval' else '.txt'}")
       for task in ("geneval", "ocr", "pickscore") for split in ("train", "test")},
}
HPDV2_STYLES = ("anime", "concept-art", "paintings", "photo")
HPDV2_REPO = "zhwang/HPDv2"


@dataclass
class PromptSet:
    name: str  # the source it was read from
    prompts: list[str]
    metadata: list[dict]  # one dict per prompt


def hpdv2_dir() -> Path:
    return Path(os.environ.get("BRANCHDIFF_DATA", Path.home() / ".cache" / "branchdiff")) / "hpdv2"


def _hpdv2_style(style: str) -> list[str]:
    path = hpdv2_dir() / f"{style}.json"
    if not path.is_file():
        try:
            from huggingface_hub import hf_hub_download

            fetched = hf_hub_download(HPDV2_REPO, f"{style}.json", subfolder="benchmark", repo_type="dataset")
        except Exception as error:  # offline, or the hub refused: say where the file belongs
            raise FileNotFoundError(
                f"HPDv2 prompts {path} not found and not fetched from the hub ({type(error).__name__}); download "
                f"benchmark/{style}.json of the dataset {HPDV2_REPO} into {path.parent} (or set $BRANCHDIFF_DATA)") from None
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.partial.{os.getpid()}")  # whole or not at all: a killed copy is never read
        shutil.copyfile(fetched, partial)
        os.replace(partial, path)
    prompts = json.loads(path.read_text())
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{path} is not a JSON list of prompts")
    return prompts


def load_prompt_set(source: str, fit: str = "resize") -> PromptSet:
    """The prompts and metadata of a source (module doc); rows with source images carry `fit`, how the sources of another
    aspect ratio than the model's are fitted to its size (`sources.fit`, branchdiff/data/sources.py)."""
    if fit not in FITS:
        raise ValueError(f"sources.fit={fit!r} must be one of {', '.join(FITS)}")
    if source in TINY_SOURCES:
        prompts = [p.text for p in TINY_SOURCES[source]()]
        return PromptSet(source, prompts, [{} for _ in prompts])
    if source == "hpdv2" or source.startswith("hpdv2:"):
        styles = HPDV2_STYLES if source == "hpdv2" else (source.partition(":")[2],)
        unknown = [s for s in styles if s not in HPDV2_STYLES]
        if unknown:
            raise ValueError(f"unknown HPDv2 style {unknown[0]!r}; allowed: {', '.join(HPDV2_STYLES)}")
        rows = [(prompt, {"style": style}) for style in styles for prompt in _hpdv2_style(style)]
        return PromptSet(source, [p for p, _ in rows], [m for _, m in rows])
    if source in FETCHED_SOURCES:
        from branchdiff.data.datasets import cached_path

        path = cached_path(*FETCHED_SOURCES[source])
        prompt_set = load_prompt_set(str(path), fit)
        return PromptSet(source, prompt_set.prompts, prompt_set.metadata)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"prompt source {quote(source, 80)} is neither {', '.join(TINY_SOURCES)}, hpdv2[:style], "
                                f"{', '.join(FETCHED_SOURCES)} nor an existing file")
    text = read_utf8(path)
    lines = text.splitlines()
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" field, got {quote(line)}") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" field")
            rows.append((_prompt_text(record.pop("prompt"), path, number), _metadata(record, path, f"{path}:{number}")))
    elif path.suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        if "prompt" not in (reader.fieldnames or []):
            raise ValueError(f"{path}:1: no \"prompt\" column (columns: {', '.join(reader.fieldnames or [])})")
        rows = [(_prompt_text(row.pop("prompt"), path, reader.line_num), _metadata(row, path, f"{path}:{reader.line_num}")) for row in reader]
    elif path.suffix == ".json":  # a JSON list of prompts (DrawBench's copy)
        try:
            listed = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{error.lineno}: not JSON ({error.msg}); a .json prompt file holds a list of prompts") from None
        if not isinstance(listed, list) or not all(isinstance(item, str) and item.strip() for item in listed):
            raise ValueError(f"{path}: a .json prompt file holds a list of non-empty prompts (strings)")
        rows = [(item, {}) for item in listed]
    else:
        rows = [(line.strip(), {}) for line in lines if line.strip()]
    if not rows:
        raise ValueError(f"prompt source {quote(source, 80)} holds no prompts")
    return PromptSet(source, [p for p, _ in rows], [{**m, FIT: fit} if SOURCES in m else m for _, m in rows])


NEGATIVE_PROMPT = "negative_prompt"  # metadata key: a prompt's own negative prompt (CFG families; blank: the family's)


def _metadata(record: dict, path: Path, where: str) -> dict:
    """A row's metadata: its fields, the sources checked (`_with_sources`) and its negative prompt text (`NEGATIVE_PROMPT`)."""
    if not isinstance(record.get(NEGATIVE_PROMPT, ""), str):
        raise ValueError(f"{where}: \"{NEGATIVE_PROMPT}\" must be a string (blank: the family's own), got {quote(json.dumps(record[NEGATIVE_PROMPT]))}")
    return _with_sources(record, path, where)


def _with_sources(record: dict, path: Path, where: str) -> dict:
    """A row's metadata with its "image" field, if any, checked and kept as absolute `sources` paths,
    and its "mask" as an absolute `mask` path."""
    metadata = {k: v for k, v in record.items() if k not in ("image", MASK)}
    if "image" in record:
        metadata[SOURCES] = resolve_sources(record["image"], path.parent, where)
    if MASK in record:
        if not isinstance(record[MASK], str):
            raise ValueError(f"{where}: \"{MASK}\" must be the path of one image, got {quote(json.dumps(record[MASK]))}")
        metadata[MASK] = resolve_image(record[MASK].strip(), path.parent, where, "mask")
        if SOURCES in metadata:
            check_mask(metadata[MASK], metadata[SOURCES], where)
    return metadata


def _prompt_text(value: object, path: Path, line: int) -> str:
    """A record's prompt: a string with text in it."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{path}:{line}: \"prompt\" must be a non-empty string, got {quote(json.dumps(value))}")
    return value


def draw_prompts(prompts: list[str], count: int, seed: int, iteration: int) -> list[int]:
    """Indices of `count` prompts for an iteration, a pure function of (seed, iteration): without
    replacement while the source is large enough, so a resumed run draws the same prompts."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    if count <= len(prompts):
        return torch.randperm(len(prompts), generator=generator)[:count].tolist()
    return torch.randint(len(prompts), (count,), generator=generator).tolist()
