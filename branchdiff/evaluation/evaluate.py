"""Generate on a prompt set with fixed seeds, score with chosen rewards, and write what a user reads.

Samples are deterministic (ODE) chains: image s of prompt p starts from the addressable initial
noise (seed, iteration -1, prompt p, root s), so base and LoRA see exactly the same noise, and
forwards are padded to the family's fixed batch (`adapter.eval_batch`, `exact`) and prompts encoded one at a time, so an image does
not depend on which other prompts share its batch: with `accelerate launch`, processes take every P-th prompt and the gathered
results equal a one-process run's.

Outputs: `images/seed-<s>/<style>/<index:05d>.jpg`, written by every process for its own prompts as
they are made (the HPDv2 benchmark's layout, which its official evaluator reads; prompts without a
style go to `all/`); then, by one process (`write_outputs`), `scores.csv`
(one row per image), `grid.png` (the first prompts × seeds), and the JSON summary: mean ± std per
score, per style when the prompts have one, with each reward's scale and the prompt set.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torchvision.io import write_jpeg
from tqdm.auto import tqdm

from branchdiff.core.engine import initial_noise, rows_per_latent
from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.data.prompts import PromptSet
from branchdiff.data.sources import source_tensors
from branchdiff.evaluation.records import ScoreRecords
from branchdiff.models.base import ModelAdapter, encode_for, select_embeds
from branchdiff.report.figures import save_grid
from branchdiff.report.video import frame_strip, write_mp4
from branchdiff.rewards.base import to_uint8
from branchdiff.rewards.frames import FrameAggregation
from branchdiff.rewards.multi import extra_keys, score_component
from branchdiff.settings.evaluation import EVAL_RUN_SEED, SOLVERS


@dataclass(frozen=True)
class OdeSampling:
    """How evaluation samples are made: `images_per_prompt` ODE chains (seeds) of every prompt in
    `num_steps` steps on the adapter's schedule (`shift` None: the family's own), with `guidance`
    (None: the family's default), from the noise of run seed `seed`; `solver` "release": from the same
    initial noise, the sampler the model folder ships (`ModelAdapter.release_denoise`)."""

    images_per_prompt: int
    num_steps: int
    shift: float | None = None
    guidance: float | None = None
    seed: int = EVAL_RUN_SEED
    solver: str = "training"

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS:
            raise ValueError(f"solver={self.solver!r} is not one of {', '.join(SOLVERS)}")


@dataclass(frozen=True)
class ProcessShare:
    """Which prompts this process samples: every `num_processes`-th from `process_index`; with
    `lockstep` (a sharded denoiser, whose forwards are collectives) every process samples as many."""

    process_index: int = 0
    num_processes: int = 1
    lockstep: bool = False


ALONE = ProcessShare()  # one process samples every prompt


@torch.no_grad()
def sample_ode(adapter: ModelAdapter, prompts: list[str], sampling: OdeSampling, prompt_keys: list[int] | None = None,
               metadata: list[dict] | None = None) -> tuple[torch.Tensor, list[str]]:
    """ODE samples of every prompt × seed (`sampling`): images (P·S, 3, H, W) in [0, 1],
    prompt-major, and the prompt of each image. `prompt_keys[p]` addresses prompt p's noise
    (default: its position); a release solver runs in batches of a fixed size. `metadata`: the
    prompts' (an editing family finds their source images there)."""
    num_steps = sampling.num_steps
    tree = build_tree(TreeSpec(num_steps, roots=sampling.images_per_prompt, sde_steps=frozenset()), len(prompts))
    address = NoiseAddress(sampling.seed, -1, tuple(prompt_keys if prompt_keys is not None else range(len(prompts))))
    settings = SamplerSettings(max_batch=adapter.eval_batch, exact=True, guidance=sampling.guidance)  # fixed per family
    # one prompt per text-encoder call: an encoder's output, too, depends on its batch size
    encoded = [encode_for(adapter, [prompt], [row]) for prompt, row in zip(prompts, metadata or [{}] * len(prompts))]
    embeds = {key: torch.cat([e[key] for e in encoded]) for key in encoded[0]}
    if sampling.solver == "release":
        latents = _release_latents(adapter, tree, embeds, address, num_steps, settings)
    else:
        latents = grow(adapter, tree, embeds, adapter.schedule(num_steps, sampling.shift), settings, address).leaf_latents
    return adapter.decode(latents), [prompts[p] for p in tree.prompt[tree.leaf_index].tolist()]


def _release_latents(adapter: ModelAdapter, tree, embeds: dict, address: NoiseAddress, num_steps: int,
                     settings: SamplerSettings) -> torch.Tensor:
    """The chains of an ODE `tree` (one per root, roots in leaf order) run by the model's own sampler
    from the roots' addressable noise, `max_batch` rows at a time (the last batch padded)."""
    roots = torch.arange(tree.level_start[0], tree.level_start[1])  # (R,) prompt-major, as the leaves
    keys = [address.prompt_keys[p] for p in tree.prompt[roots].tolist()]
    initial = initial_noise(address, keys, [tree.paths[r] for r in roots.tolist()], adapter.latent_shape, adapter.device)  # (R, ...)
    chunk = max(1, settings.max_batch // rows_per_latent(adapter, settings))
    out = []
    for start in range(0, len(roots), chunk):
        rows = torch.arange(start, min(start + chunk, len(roots)))
        padded = torch.cat([rows, rows[-1:].expand(chunk - len(rows))])
        latents = adapter.release_denoise(initial[padded], select_embeds(embeds, tree.prompt[roots[padded]]), num_steps, settings.guidance)
        out.append(latents[: len(rows)])
    return torch.cat(out)


def score_names(rewards: dict[str, object]) -> list[str]:
    """The score names `score_images` returns: each reward's label, then `label.key` for the extra
    scores it declares (tiny-geneval's strict and per-attribute accuracy)."""
    return [name for label, reward in rewards.items() for name in (label, *(f"{label}.{k}" for k in extra_keys(reward)))]


def score_images(rewards: dict[str, object], images: torch.Tensor, prompts: list[str], metadata: list[dict],
                 frames: dict[str, FrameAggregation | None] | None = None) -> dict[str, torch.Tensor]:
    """Per-image scores (B,) by `score_names`, through the same boundary as training
    (`score_component`: one-line errors, shapes checked; non-finite scores kept and counted later);
    `frames`: by label, how a reward of images scores videos (a spec's `frames`, `reduce`)."""
    scores = {}
    for label, reward in rewards.items():
        value, more, _ = score_component(reward, label, images, prompts, metadata, frames=(frames or {}).get(label))
        scores[label] = value
        scores.update({f"{label}.{k}": v for k, v in more.items()})
    return scores


@dataclass
class EvalResult:
    prompt_set: PromptSet
    images_per_prompt: int
    prompt_index: torch.Tensor  # (N,) prompt of each image, prompt-major then seed
    seed_index: torch.Tensor  # (N,) seed (root) of each image
    scores: dict[str, torch.Tensor]  # (N,) per score name


def benchmark_paths(prompt_set: PromptSet) -> list[Path]:
    """Each prompt's image path below `images/seed-<s>/`: `<style>/<index within the style:05d>.jpg`
    (HPDv2's layout; prompts without a style go to `all/`)."""
    seen: dict[str, int] = {}
    paths = []
    for metadata in prompt_set.metadata:
        style = metadata.get("style") or "all"
        paths.append(Path(style) / f"{seen.get(style, 0):05d}.jpg")
        seen[style] = seen.get(style, 0) + 1
    return paths


def image_path(prompt_set_paths: list[Path], prompt: int, seed: int) -> Path:
    return Path("images") / f"seed-{seed}" / prompt_set_paths[prompt]


def save_jpeg(image: torch.Tensor, path: Path) -> None:
    """An image (3, H, W) in [0, 1] as JPEG quality 95 (the benchmark reads JPEG; PIL's default 75
    would move the pixels its evaluator sees further from those scored here); a video (F, 3, H, W) as
    its frame strip there and its MP4 beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if image.dim() == 4:
        write_mp4(image, path.with_suffix(".mp4"))
        image = frame_strip(image[None])[0]
    write_jpeg(to_uint8(image[None])[0], str(path), quality=95)


def evaluate(
    adapter: ModelAdapter, prompt_set: PromptSet, rewards: dict[str, object], sampling: OdeSampling, share: ProcessShare = ALONE,
    frames: dict[str, FrameAggregation | None] | None = None, out_dir: Path | None = None, progress: bool = False, chunk: int = 16,
    records: ScoreRecords | None = None,
) -> EvalResult:
    """This process's share of the evaluation (`gather_results` joins the shares): its prompts sampled
    (`sampling`) `chunk` at a time and scored with `rewards` (by label); with `out_dir`, each image is
    written there as it is made (`image_path`), so no process holds more than a chunk of images;
    `progress` shows a bar. Under `share.lockstep` a shorter share is padded with its last prompt (or
    the first), whose images are dropped. `frames`: by reward label, how a reward of images scores a
    video family's videos. `records`: each chunk's scores appended there as they are made, and the prompts
    already recorded (by any process, in an earlier launch) taken from it instead of sampled again (a resumed
    evaluation; images are the same whichever launch makes them: the noise is addressable)."""
    images_per_prompt = sampling.images_per_prompt
    names = score_names(rewards)
    mine = list(range(share.process_index, len(prompt_set.prompts), share.num_processes))
    if records is not None and share.lockstep:  # a process's share of what is left would differ: forwards out of step
        raise ValueError("an evaluation in lockstep (a sharded denoiser) cannot resume from score records; evaluate without them")
    done = records.done(images_per_prompt, names) if records is not None else {}
    todo = [p for p in mine if p not in done]
    share_size = -(-len(prompt_set.prompts) // share.num_processes) if share.lockstep else len(mine)
    sampled = todo + [todo[-1] if todo else (mine[-1] if mine else 0)] * (share_size - len(mine))  # lockstep: as many forwards everywhere
    paths = benchmark_paths(prompt_set)
    made: dict[int, dict[str, list[float]]] = {}  # prompt → score → its images' values
    with tqdm(total=len(mine), initial=len(mine) - len(todo), desc="eval", unit="prompt", disable=not progress) as bar:  # closed on errors too
        for start in range(0, len(sampled), chunk):
            keys = sampled[start : start + chunk]
            prompts = [prompt_set.prompts[k] for k in keys]
            images, image_prompts = sample_ode(adapter, prompts, sampling, keys, [prompt_set.metadata[k] for k in keys])
            keys = keys[: max(0, len(todo) - start)]  # the padding's images are dropped
            images, image_prompts = images[: len(keys) * images_per_prompt], image_prompts[: len(keys) * images_per_prompt]
            if not keys:
                continue
            metadata = [prompt_set.metadata[k] for k in keys for _ in range(images_per_prompt)]
            scored = score_images(rewards, images, image_prompts, metadata, frames)
            if out_dir is not None:
                for row, image in enumerate(images):
                    save_jpeg(image, out_dir / image_path(paths, keys[row // images_per_prompt], row % images_per_prompt))
            for position, key in enumerate(keys):
                rows = slice(position * images_per_prompt, (position + 1) * images_per_prompt)
                made[key] = {name: values[rows].tolist() for name, values in scored.items()}
            if records is not None:  # after the images: a recorded prompt always has its images on disk
                records.append({key: made[key] for key in keys})
            bar.update(len(keys))
    index = torch.tensor(mine, dtype=torch.long).repeat_interleave(images_per_prompt)
    seeds = torch.arange(images_per_prompt).repeat(len(mine))
    per_prompt = [done.get(p) or made[p] for p in mine]
    scores = {name: torch.tensor([value for prompt in per_prompt for value in prompt[name]], dtype=torch.float32) for name in names}
    return EvalResult(prompt_set, images_per_prompt, index, seeds, scores)


def gather_results(result: EvalResult, accelerator) -> EvalResult:
    """Every process's scores joined in prompt order (one gather of Python objects; images stay on disk)."""
    if accelerator.num_processes == 1:
        return result
    from accelerate.utils import gather_object

    shares = gather_object([(result.prompt_index, result.seed_index, result.scores)])
    index, seeds = torch.cat([s[0] for s in shares]), torch.cat([s[1] for s in shares])
    order = torch.argsort(index * result.images_per_prompt + seeds, stable=True)
    scores = {name: torch.cat([s[2][name] for s in shares])[order] for name in result.scores}
    return EvalResult(result.prompt_set, result.images_per_prompt, index[order], seeds[order], scores)


def summarize(result: EvalResult) -> dict[str, dict[str, dict[str, float]]]:
    """{group: {score: {mean, std, images, nonfinite}}}: group "all", and each style when prompts
    have one; mean and std over the finite scores, `nonfinite` counting the others."""
    styles = [result.prompt_set.metadata[p].get("style") for p in result.prompt_index.tolist()]
    groups = {"all": torch.ones(len(styles), dtype=torch.bool)}
    for style in sorted({s for s in styles if s}):
        groups[style] = torch.tensor([s == style for s in styles])
    summary = {}
    for group, member in groups.items():
        summary[group] = {}
        for name, values in result.scores.items():
            chosen = values[member]
            finite = chosen[torch.isfinite(chosen)]
            summary[group][name] = {"mean": finite.mean().item() if len(finite) else float("nan"),
                                    "std": finite.std().item() if len(finite) > 1 else 0.0,
                                    "images": len(chosen), "nonfinite": len(chosen) - len(finite)}
    return summary


def format_comparison(rows: dict[str, dict[str, float]]) -> str:
    """Scores (rows) of several models (columns), e.g. base vs trained means."""
    models = list(rows)
    names = list(rows[models[0]])
    width = max(len(n) for n in names) + 2
    lines = [f"{'score':<{width}}" + "".join(f"{m:>12}" for m in models)]
    lines += [f"{name:<{width}}" + "".join(f"{rows[m][name]:>12.4f}" for m in models) for name in names]
    return "\n".join(lines)


def format_summary(summary: dict, label: str = "score") -> str:
    """Mean ± std per score (rows) and group (columns)."""
    groups = list(summary)
    names = list(summary[groups[0]])
    width = max(len(n) for n in names) + 2
    lines = [f"{label:<{width}}" + "".join(f"{g:>20}" for g in groups)]
    for name in names:
        cells = [f"{summary[g][name]['mean']:.4f} ± {summary[g][name]['std']:.4f}"
                 + (f" ({summary[g][name]['nonfinite']} NaN)" if summary[g][name]["nonfinite"] else "") for g in groups]
        lines.append(f"{name:<{width}}" + "".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


def beside_sources(images: torch.Tensor, metadata: list[dict], per_prompt: int) -> torch.Tensor:
    """Images (P·N, 3, H, W), prompt-major, with each editing prompt's (first) source image, resized to
    H × W, before its N results: (P·(N + 1), 3, H, W) for a grid whose rows read source, then edits.
    Videos (P·N, F, 3, H, W) from a first frame: the source as a still video of F frames before them.
    Prompts without sources: the images as they are."""
    sources = source_tensors(metadata, tuple(images.shape[-2:]))  # fitted as the model saw them
    if sources is None:
        return images
    rows = []
    for prompt, chosen in enumerate(images.split(per_prompt)):
        source = torch.nn.functional.interpolate(sources[prompt][0][None], size=chosen.shape[-2:], mode="bilinear", antialias=True)
        if chosen.dim() == 5:  # videos: the source held for every frame
            source = source[:, None].expand(1, chosen.shape[1], *source.shape[1:])
        rows.append(torch.cat([source.clamp(0, 1).to(chosen), chosen]))
    return torch.cat(rows)


def write_outputs(result: EvalResult, out_dir: Path, scales: dict[str, str], extra: dict) -> dict:
    """scores.csv, grid.png (from the images `evaluate` wrote) and summary.json under `out_dir`
    (module doc); returns the summary JSON. `scales`: each reward's scale note; `extra`: run facts."""
    from torchvision.io import read_image

    prompts, metadata = result.prompt_set.prompts, result.prompt_set.metadata
    paths = benchmark_paths(result.prompt_set)
    rows = []
    for row, (p, s) in enumerate(zip(result.prompt_index.tolist(), result.seed_index.tolist())):
        rows.append({"prompt_index": p, "seed": s, "style": metadata[p].get("style") or "all", "prompt": prompts[p],
                     "image": str(image_path(paths, p, s)), **{name: f"{values[row].item():.6g}" for name, values in result.scores.items()}})
    with (out_dir / "scores.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["prompt_index"])
        writer.writeheader()
        writer.writerows(rows)
    shown = rows[: min(8, len(prompts)) * result.images_per_prompt]
    if shown:
        images = torch.stack([read_image(str(out_dir / row["image"])).float() / 255 for row in shown])
        sources = [metadata[row["prompt_index"]] for row in shown[:: result.images_per_prompt]]  # an editing set: each row starts with its source
        beside = beside_sources(images, sources, result.images_per_prompt)
        save_grid(beside, out_dir / "grid.png", nrow=len(beside) // len(sources))
    summary = {"prompts": result.prompt_set.name, "images_per_prompt": result.images_per_prompt, "scales": scales,
               **extra, "summary": summarize(result)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
