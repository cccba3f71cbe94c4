"""What `branchdiff train` checks before it claims a run directory, loads a model, a reward or a
checkpoint, or writes anything: beyond the config itself (branchdiff/settings/validate.py), every
training and evaluation reward resolves (its name imported, its keyword arguments accepted, a reward
server's client's too; the evaluation rewards even when the run does not evaluate), every prompt source the run reads decodes
(a problem is named with its file and line), no prompt is longer than the family's text encoders
can read (`max_prompt_characters`), every reward that can check prompts (`check_prompts`, e.g.
tiny-geneval's grammar) accepts them, an editing family's prompts name their source images (and a
text family's none), the image size (and a video's frame count) fits the model
folder's config files, on a video family every reward scores videos or names its frames, and a tracker
that logs online (W&B, SwanLab) has credentials.
The run directory is then claimed (branchdiff/runtime/run_dir.py) and the checkpoint to resume chosen
(`Trainer.select_checkpoint`), still before the model loads.
"""

from __future__ import annotations

from branchdiff.data.prompts import PromptSet, load_prompt_set
from branchdiff.data.sources import SOURCES, check_aspect
from branchdiff.data.sources import image_size as source_size
from branchdiff.errors import quote
from branchdiff.models import adapter_class, check_frames, check_size
from branchdiff.models.attention import check_backend
from branchdiff.models.compile import check_compiler
from branchdiff.models.families import FAMILIES, image_size
from branchdiff.rewards.combine import RewardSpec, parse_reward_specs
from branchdiff.rewards.multi import check_remote_kwargs
from branchdiff.rewards.registry import check_reward_kwargs, resolve_reward
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.validate import tracker_names
from branchdiff.training.trackers import check_credentials, check_installed

CHARACTERS_PER_TOKEN = 16  # no token of the families' tokenizers spans more characters than this in a prompt (a generous bound)


def max_prompt_characters(family: str) -> int:
    """The longest prompt a family takes: its text encoders' token limit × `CHARACTERS_PER_TOKEN`.
    A longer prompt is mostly cut off by the tokenizer, and a file of one huge line is a mistake."""
    return adapter_class(family).max_sequence_length * CHARACTERS_PER_TOKEN


def check_inputs(config: TrainConfig) -> None:
    """Raise a one-line error for a reward that does not resolve, a prompt source that does not read
    or holds a prompt the family or a reward cannot take, or an image size the model cannot make
    (evaluation prompts only when the run evaluates)."""
    evaluates = config.final_eval or config.eval_every
    train_specs, eval_specs = parse_reward_specs(config.reward), parse_reward_specs(config.eval_rewards)
    factories = {}
    for spec in (*train_specs, *eval_specs):
        if spec.remote is None:
            factories[spec.name] = resolve_reward(spec.name)
            check_reward_kwargs(spec.name, factories[spec.name], spec.kwargs)
        else:
            check_remote_kwargs(spec)
    check_size(config.model.family, config.model.path, config.model.resolution)
    check_backend(config.model.attention_backend)
    check_compiler(config.model.compile)
    check_installed(tracker_names(config.logging.report_to))
    check_credentials(tracker_names(config.logging.report_to))
    check_frames(config.model.family, config.model.path, config.model.frames)
    if FAMILIES[config.model.family].video:
        for key, specs in (("reward", train_specs), *((("eval_rewards", eval_specs),) if evaluates else ())):
            check_video_rewards(key, specs, factories)
    size = image_size(config.model.resolution, FAMILIES[config.model.family].resolution)
    for source, specs in (("train", train_specs), *((("eval", eval_specs),) if evaluates else ())):
        prompt_set = load_prompt_set(getattr(config.prompts, source))
        check_sources(prompt_set, config.model.family, size)
        _check_prompts(prompt_set, specs, factories, config.model.family)


def check_video_rewards(key: str, specs: list[RewardSpec], factories: dict) -> None:
    """On a video family, each reward scores videos itself (`video = True`; a reward server says so on
    its /health, read here) or says how to score its frames (`frames`, `reduce`)."""
    for spec in specs:
        if spec.frames is None and not _scores_videos(spec, factories):
            raise ValueError(f"'{key}' entry {spec.label!r} scores images and the model makes videos: give it frames: N (score every N-th "
                             f"frame) and reduce: mean or min, e.g. {{name: {spec.label}, frames: 4, reduce: mean}}")


def _scores_videos(spec: RewardSpec, factories: dict) -> bool:
    if spec.remote is None:
        return bool(getattr(factories.get(spec.name), "video", False))
    from branchdiff.rewards.remote import RemoteReward

    return RemoteReward(spec.remote, **spec.kwargs).video  # an unreachable server is one line here, before anything is written


def _check_prompts(prompt_set: PromptSet, specs: list[RewardSpec], factories: dict, family: str) -> None:
    limit = max_prompt_characters(family)
    for number, prompt in enumerate(prompt_set.prompts, start=1):
        if len(prompt) > limit:
            raise ValueError(f"prompt {number} of {quote(prompt_set.name, 80)} is {len(prompt):,} characters ({quote(prompt)}): more than "
                             f"model.family={family}'s text encoders read ({adapter_class(family).max_sequence_length} tokens, at most "
                             f"{limit:,} characters); shorten it or check the file (one prompt per line)")
    for spec in specs:
        check = getattr(factories.get(spec.name), "check_prompts", None)
        if check is not None:
            try:
                check(prompt_set.prompts)
            except ValueError as error:
                raise ValueError(f"reward {spec.label!r} cannot score {quote(prompt_set.name, 80)}: {error}") from None


def check_sources(prompt_set: PromptSet, family: str, size: tuple[int, int]) -> None:
    """An editing family's prompts each name their source image(s), as many as the first prompt (at most the
    family's `max_sources`), each of the edits' aspect ratio (`size`: height, width); a text-to-image family's
    name none (docs/editing.md)."""
    adapter = adapter_class(family)
    counts = [len(metadata.get(SOURCES, ())) for metadata in prompt_set.metadata]
    for number, metadata in enumerate(prompt_set.metadata, start=1):
        where = f"prompt {number} of {quote(prompt_set.name, 80)}"
        if adapter.edits and metadata.get(SOURCES):
            if counts[number - 1] != counts[0] or (adapter.max_sources and counts[number - 1] > adapter.max_sources):
                raise ValueError(f"{where} has {counts[number - 1]} source images and model.family={family} takes the same number with every "
                                 f"prompt ({counts[0]}, as prompt 1{f', at most {adapter.max_sources}' if adapter.max_sources else ''}); "
                                 "split the set by number of sources (docs/editing.md)")
            for path in metadata[SOURCES]:
                check_aspect(source_size(path), *size, f"{where}: source image {quote(path, 80)}")
        if adapter.edits and not metadata.get(SOURCES):
            raise ValueError(f"{where} has no source image and model.family={family} edits images: "
                             "give every prompt its \"image\" (a JSONL field or a CSV column, paths relative to the file; docs/editing.md)")
        if not adapter.edits and SOURCES in metadata:
            raise ValueError(f"{where} comes with a source image (\"image\") and model.family={family} "
                             "makes images from text alone: train an editing family (flux-kontext), or drop the field (docs/editing.md)")
