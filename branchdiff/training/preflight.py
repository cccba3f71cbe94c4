"""What `branchdiff train` checks before it claims a run directory, loads a model, a reward or a
checkpoint, or writes anything: beyond the config itself (branchdiff/settings/validate.py), the
family's model path is given where it has no built-in weights, every training and evaluation reward
resolves (its name imported, its keyword arguments accepted, a reward server's client's too; the
evaluation rewards even when the run does not evaluate), the image size (and a video's frame count) fits
the model folder's config files, a tracker that logs online (W&B, SwanLab) has credentials, and each
prompt set the run reads passes the checks `sample` and `eval` share (branchdiff/evaluation/preflight.py:
length, the rewards' own prompt checks, source images, and on a video family every reward scores videos
or names its frames), and a reward that calls a service (vlm-judge) has it answer one question.
The run directory is then claimed (branchdiff/runtime/run_dir.py) and the checkpoint to resume chosen
(`Checkpointer.select`, branchdiff/training/checkpoints.py), still before the model loads.
"""

from __future__ import annotations

from typing import cast

from branchdiff.data.demonstrations import load_image_set
from branchdiff.data.prompts import load_prompt_set
from branchdiff.errors import UserError, quote
from branchdiff.evaluation.preflight import Guidance, check_prompt_set, check_video_rewards, max_prompt_characters, preflight_rewards
from branchdiff.models import adapter_class, check_frames, check_size
from branchdiff.models.attention import check_backend
from branchdiff.models.block_cache import check_cacheable_folder
from branchdiff.models.compile import check_compile_family, check_compiler, on_cuda, resolve_compile
from branchdiff.models.registry import FAMILIES, image_size
from branchdiff.objectives.dataset import model_frames
from branchdiff.objectives.registry import dataset_kind
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import check_remote_kwargs
from branchdiff.rewards.registry import check_reward_kwargs, resolve_reward
from branchdiff.runtime.sharding import ShardingSettings
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.evaluation import eval_keys
from branchdiff.settings.validate import tracker_names
from branchdiff.training.trackers import check_credentials, check_installed


def check_inputs(config: TrainConfig) -> None:
    """Raise a one-line error for a model path the family needs and lacks, a dataset objective's image set that
    does not read or whose images the family cannot encode, a reward that does not resolve, a prompt source that
    does not read or holds a prompt the family or a reward cannot take, or an image size the model cannot make
    (evaluation prompts only when the run evaluates)."""
    evaluates = config.final_eval or config.eval_every
    adapter_class(config.model.family).check_path(config.model.path)
    if config.sampling.block_cache:
        try:
            check_cacheable_folder(config.model.path)
        except ValueError as error:
            raise UserError(str(error)) from None
    size = image_size(config.model.resolution, FAMILIES[config.model.family].resolution)
    kind = dataset_kind(config.train.loss)
    if kind:  # a dataset objective's images: read and checked now; the family must turn them into latents
        if not hasattr(adapter_class(config.model.family), "encode_images"):
            encoding = ", ".join(name for name in FAMILIES if hasattr(adapter_class(name), "encode_images"))
            raise UserError(f"train.loss={config.train.loss} trains on images, which model.family={config.model.family} cannot encode "
                            f"into latents yet; families that can: {encoding}")
        try:
            image_set = load_image_set(getattr(config, config.train.loss.replace("-", "_")).data, kind, size, model_frames(config))
        except ValueError as error:
            raise UserError(str(error)) from None
        limit = max_prompt_characters(config.model.family)
        for number, prompt in enumerate(image_set.prompts, start=1):
            if len(prompt) > limit:
                raise UserError(f"prompt {number} of {kind} set {quote(image_set.name, 80)} is {len(prompt):,} characters ({quote(prompt)}): more "
                                f"than model.family={config.model.family}'s text encoders read (at most {limit:,} characters); shorten it")
    train_specs, eval_specs = parse_reward_specs(config.reward), parse_reward_specs(config.eval_rewards)
    factories = {}
    for spec in (*train_specs, *eval_specs):
        if spec.remote is None:
            name = cast(str, spec.name)  # parse_reward_specs: a non-empty name where there is no remote
            factories[name] = resolve_reward(name)
            check_reward_kwargs(name, factories[name], spec.kwargs)
        else:
            check_remote_kwargs(spec)
    check_size(config.model.family, config.model.path, config.model.resolution)
    check_backend(config.model.attention_backend)
    cuda = on_cuda()
    check_compile_family(config.model.compile, config.model.family, cuda)
    check_compiler(resolve_compile(config.model.compile, config.model.family, cuda, ShardingSettings.from_environment().enabled)[0])
    check_installed(tracker_names(config.logging.report_to))
    check_credentials(tracker_names(config.logging.report_to))
    check_frames(config.model.family, config.model.path, config.model.frames)
    eval_size = size
    if evaluates or config.eval.resolution is not None or config.eval.frames is not None:  # the evaluations' own size, where the run sets one
        # (checked when the run does not evaluate too: `branchdiff eval --weights RUN` evaluates at it)
        try:
            eval_size = check_size(config.model.family, config.model.path, config.eval.resolution or config.model.resolution)
            check_frames(config.model.family, config.model.path, config.eval.frames or config.model.frames)
        except ValueError as error:
            raise ValueError(eval_keys(str(error))) from None
    if FAMILIES[config.model.family].video:
        for key, specs in (("reward", train_specs), *((("eval_rewards", eval_specs),) if evaluates else ())):
            check_video_rewards(key, specs, factories)
    guidance = {"train": Guidance("sampling.guidance", config.sampling.guidance, config.model.path),
                "eval": Guidance("prompts.eval_guidance", config.prompts.eval_guidance, config.model.path)}
    for source, specs, made in (("train", train_specs, size), *((("eval", eval_specs, eval_size),) if evaluates else ())):
        check_prompt_set(load_prompt_set(getattr(config.prompts, source), config.sources.fit), config.model.family, made, specs, factories, guidance[source])
    preflight_rewards([*train_specs, *(eval_specs if evaluates else [])], factories)  # last: it may wait on a service
