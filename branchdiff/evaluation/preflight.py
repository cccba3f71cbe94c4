"""The checks `train`, `sample`, `eval` and `bench` share, run before any model weight is read: they need only
the settings, the prompt files and the headers of the images these name.

- `check_prompt_set`: no prompt is longer than the family's text encoders read, every reward that can check
  prompts (`check_prompts`, e.g. tiny-geneval's grammar; given the reward's settings where it takes `**settings`)
  accepts them (what it returns is printed once as a warning: `ocr`'s prompts without quoted text), and the source images follow the
  family's rule (`ModelAdapter.check_source_sizes`: an editing family's prompts name theirs, a text family's none);
- `check_video_rewards`: on a video family, every reward scores videos or names the frames it scores;
- `preflight_rewards`: a reward that calls a service (vlm-judge) asks it once;
- `check_output_folder`: the folder a command will write into can be made and written, so that minutes of
  sampling are not lost at the first file.
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from branchdiff.data.prompts import NEGATIVE_PROMPT, PromptSet
from branchdiff.data.sources import FIT, SOURCES
from branchdiff.data.sources import image_size as source_size
from branchdiff.errors import UserError, quote
from branchdiff.models import adapter_class
from branchdiff.rewards.combine import RewardSpec
from branchdiff.rewards.group import is_group_reward

CHARACTERS_PER_TOKEN = 16  # no token of the families' tokenizers spans more characters than this in a prompt (a generous bound)


def max_prompt_characters(family: str) -> int:
    """The longest prompt a family takes: its text encoders' token limit × `CHARACTERS_PER_TOKEN`.
    A longer prompt is mostly cut off by the tokenizer, and a file of one huge line is a mistake."""
    return adapter_class(family).max_sequence_length * CHARACTERS_PER_TOKEN


@dataclass(frozen=True)
class Guidance:
    """The guidance a command samples a prompt set with, and the key that sets it (for messages)."""
    key: str  # e.g. sampling.guidance, --guidance
    value: float | None  # None: the family's default
    path: str | None = None  # the release (FLUX.2 klein's step-distilled ones sample unguided)


def check_prompt_set(prompt_set: PromptSet, family: str, size: tuple[int, int], specs: list[RewardSpec], factories: dict,
                     guidance: Guidance | None = None) -> None:
    """The source images' rule, the prompts' length and the rewards' own prompt checks (`factories`: name → the reward's
    class or factory), each refused with the prompt's number and file; with the `guidance` a command samples at, negative
    prompts where that guidance runs no classifier-free guidance (they would be ignored)."""
    names = [metadata.get(SOURCES, []) for metadata in prompt_set.metadata]
    sizes = [[source_size(path) for path in row] for row in names] if any(SOURCES in m for m in prompt_set.metadata) else None
    adapter_class(family).check_source_sizes(sizes, len(prompt_set.prompts), size, lambda number: f"prompt {number} of {quote(prompt_set.name, 80)}",
                                             names, [metadata.get(FIT, "resize") for metadata in prompt_set.metadata])
    family_class = adapter_class(family)
    negatives = [number for number, row in enumerate(prompt_set.metadata, start=1) if str(row.get(NEGATIVE_PROMPT) or "").strip()]
    if negatives and not family_class.uses_cfg:
        raise ValueError(f"prompt {negatives[0]} of {quote(prompt_set.name, 80)} has a negative prompt and {family_class.no_negatives()}")
    if negatives and guidance is not None:
        check_negatives_guided(f"prompt {negatives[0]} of {quote(prompt_set.name, 80)}", family, guidance)
    limit = max_prompt_characters(family)
    for number, (prompt, row) in enumerate(zip(prompt_set.prompts, prompt_set.metadata), start=1):
        for what, text in (("prompt", prompt), ("negative prompt", str(row.get(NEGATIVE_PROMPT) or ""))):
            if len(text) > limit:
                raise ValueError(f"{what} {number} of {quote(prompt_set.name, 80)} is {len(text):,} characters ({quote(text)}): more than "
                                 f"model.family={family}'s text encoders read ({adapter_class(family).max_sequence_length} tokens, at most "
                                 f"{limit:,} characters); shorten it or check the file (one prompt per line)")
    for spec in specs:
        check = getattr(factories.get(spec.name), "check_prompts", None)
        if check is not None:
            takes_settings = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(check).parameters.values())
            try:
                warning = check(prompt_set.prompts, **spec.kwargs) if takes_settings else check(prompt_set.prompts)
            except ValueError as error:
                raise ValueError(f"reward {spec.label!r} cannot score {quote(prompt_set.name, 80)}: {error}") from None
            if warning and is_main_process():
                print(f"branchdiff: warning: reward {spec.label!r} on {quote(prompt_set.name, 80)}: {warning}", file=sys.stderr)


def is_main_process() -> bool:
    """Whether this is the launch's first process (the environment `accelerate launch` and torchrun set), which prints the
    warnings every process would find alike."""
    return os.environ.get("RANK", "0") == "0"


def preflight_rewards(specs: list[RewardSpec], factories: dict) -> None:
    """Each reward that calls a service before it can score (its class's `preflight`, e.g. vlm-judge's one question to
    the judge) is asked once, with its settings, before a model loads: a judge that is down, stalls or names an unknown
    model stops the command with one line, with nothing written."""
    asked = set()
    for spec in specs:
        preflight = getattr(factories.get(spec.name), "preflight", None)
        key = (spec.name, repr(sorted(spec.kwargs.items())))
        if preflight is not None and key not in asked:
            asked.add(key)
            preflight(**spec.kwargs)


def check_negatives_guided(where: str, family: str, guidance: Guidance) -> None:
    """A negative prompt is the unconditional row of classifier-free guidance: at a guidance the family samples
    unguided (`cfg_rows` 1: a CFG scale ≤ 1, z-image's 0, a step-distilled FLUX.2 klein), refused."""
    family_class = adapter_class(family)
    scale = family_class.default_guidance if guidance.value is None else guidance.value  # Wan 2.2's second scale applies only under CFG
    if family_class.cfg_rows(scale, guidance.path) > 1:
        return
    if family_class.cfg_rows(family_class.default_guidance, guidance.path) == 1:  # no scale guides this release
        raise ValueError(f"{where} has a negative prompt, and {guidance.path} samples without classifier-free guidance (a step-distilled "
                         "release), so it would be ignored: drop the \"negative_prompt\" field or column (docs/prompts.md)")
    raise ValueError(f"{where} has a negative prompt, and {guidance.key}={scale:g} samples model.family={family} without classifier-free "
                     f"guidance, so it would be ignored: raise {guidance.key} (the family's default is {family_class.default_guidance:g}) or "
                     "drop the \"negative_prompt\" field or column (docs/prompts.md)")


def check_video_rewards(key: str, specs: list[RewardSpec], factories: dict) -> None:
    """On a video family, each reward scores videos itself (`video = True`; a reward server says so on
    its /health, read here) or says how to score its frames (`frames`, `reduce`)."""
    for spec in specs:
        if spec.frames is None and not _scores_videos(spec, factories):
            raise ValueError(f"'{key}' entry {spec.label!r} scores images and the model makes videos: give it frames: N (score every N-th "
                             f"frame) and reduce: mean or min, e.g. {{name: {spec.label}, frames: 4, reduce: mean}}")
        if spec.frames is not None and spec.remote is None and is_group_reward(factories.get(spec.name)) and not _scores_videos(spec, factories):
            raise ValueError(f"'{key}' entry {spec.label!r} ranks whole groups and scores images, and the model makes videos: a group reward "
                             "of videos must score them whole (video = True); rank a reward of videos instead")


def _scores_videos(spec: RewardSpec, factories: dict) -> bool:
    if spec.remote is None:
        factory = factories.get(spec.name)
        describe = getattr(factory, "scores_videos", None)  # a reward whose videos depend on its settings (group-rank's inner reward)
        return bool(describe(**spec.kwargs)) if describe is not None else bool(getattr(factory, "video", False))
    from branchdiff.rewards.multi import remote_client

    return bool(getattr(remote_client(spec), "video", False))  # an unreachable server is one line here, before anything is written


def check_output_file(path: Path, option: str) -> None:
    """`path` (its folders made later, when it is written) can be written: it is not a folder, and its folder could be made
    and written (`check_output_folder`)."""
    if path.is_dir():
        raise UserError(f"{option} {path} is a folder; pass {option} the path of a file (e.g. {path / 'result.json'})")
    problem = _unwritable(path.parent)
    if problem:
        raise UserError(f"{option} {path}: {problem}; pass {option} a file in a folder you can write to")


def check_output_folder(folder: Path, option: str) -> None:
    """`folder` (made later, with its parents, once there is something to write) can be made and written: it is not a
    file, and its nearest existing folder takes a new file. Probed with a temporary file that is removed at once, so a
    read-only mount or a folder without write permission is named now, not after the sampling."""
    problem = _unwritable(folder)
    if problem:
        raise UserError(f"{option} {folder}: {problem}; pass {option} a folder" + ("" if "is a file" in problem else " you can write to"))


def _unwritable(folder: Path) -> str:
    """Why `folder` could not be made and written ("" when it could): its nearest existing ancestor is a file, or takes no new
    file (probed with a temporary file removed at once)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".branchdiff-probe-"):
            pass
    except OSError as error:
        return f"cannot write in {existing} ({error.strerror or type(error).__name__})"
    return ""
