"""`branchdiff sample`: ODE samples of each prompt as PNGs (a video family's: a frame strip PNG and
an MP4 each; an editing family's edits of `--image`, an image-to-video family's videos from it); with `--search`, the best images of an
inference-time search (branchdiff/cli/search.py); with `--from-trace`, a search's best images regrown."""

from __future__ import annotations

import argparse
from pathlib import Path

from branchdiff.cli.common import check_model, file_name, load_model, sampling_settings


def cmd_sample(args: argparse.Namespace) -> None:
    """ODE samples of each prompt, one PNG each, named by `file_name`; with `--search`, each prompt's
    best images of a search and OUT/search.json; with `--from-trace`, a trace's best images regrown."""
    from branchdiff.data.prompts import PromptSet
    from branchdiff.evaluation.preflight import check_output_folder, check_prompt_set
    from branchdiff.report.video import save_sample
    from branchdiff.settings.evaluation import EVAL_RUN_SEED

    if args.from_trace is None and not args.prompt:
        raise ValueError("sample needs --prompt (or --from-trace OUT/search.json to regrow a search's best images)")
    if (args.search or args.from_trace is not None) and args.solver == "release":
        raise ValueError("--solver release samples the model's own ODE; a search grows SDE trees with branchdiff's steps: "
                         "leave --solver unset with --search or --from-trace")
    if args.image and (args.search or args.from_trace is not None):
        raise ValueError("--image samples an editing or image-to-video family's ODE samples; searches and their traces take text prompts only: "
                         "drop --search / --from-trace")
    if args.search and args.budget is None:
        raise ValueError(f"--search {args.search} needs --budget: the network rows to spend per prompt (a {args.steps or 10}-step image costs "
                         f"{args.steps or 10}, twice that under CFG)")
    settings, _ = sampling_settings(args)
    seed = EVAL_RUN_SEED if args.seed is None else args.seed
    size = check_model(settings, args.weights)
    check_output_folder(args.out, "--out")
    if args.from_trace is not None or args.search:  # the trace or the reward is read before the model loads
        from branchdiff.cli.search import check_search, regrow_trace, search_and_write
        from branchdiff.search.sample import read_trace

        recorded = read_trace(args.from_trace) if args.from_trace is not None else None
        search = check_search(args, settings, seed, size) if args.search else None
        adapter = load_model(settings, args.weights)
        written = (regrow_trace(adapter, recorded, args.weights, args.out) if recorded is not None else
                   search_and_write(adapter, args, settings, search))
        for path in written:
            print(path)
        return
    from branchdiff.evaluation.evaluate import OdeSampling, sample_ode

    metadata = source_metadata(args.image, len(args.prompt), settings.fit)
    check_prompt_set(PromptSet("--prompt", list(args.prompt), metadata or [{} for _ in args.prompt]), settings.family, size, [], {})
    sampling = OdeSampling(settings.images_per_prompt, settings.steps, settings.shift, settings.guidance, seed, settings.solver)
    images, prompts = sample_ode(load_model(settings, args.weights), args.prompt, sampling, metadata=metadata)
    args.out.mkdir(parents=True, exist_ok=True)  # only once there are images to write
    for index, (image, prompt) in enumerate(zip(images, prompts)):
        for path in save_sample(image, args.out / file_name(index, prompt)):  # a video: its strip PNG and its MP4
            print(path)


def source_metadata(images: list[Path] | None, prompts: int, fit: str = "resize") -> list[dict] | None:
    """Each prompt's metadata naming its source image (`--image`: one for every prompt, or one per prompt), read now, and
    how it is fitted to the model's size (`--fit`)."""
    if not images:
        return None
    if len(images) not in (1, prompts):
        raise ValueError(f"--image was given {len(images)} times for {prompts} prompts: give it once (every prompt edits that image) or once per --prompt")
    from branchdiff.data.sources import FIT, SOURCES, resolve_image

    paths = [[resolve_image(str(image), Path.cwd(), "--image")] for image in images]
    return [{SOURCES: paths[index if len(paths) > 1 else 0], FIT: fit} for index in range(prompts)]
