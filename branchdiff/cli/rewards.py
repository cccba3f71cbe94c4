"""`branchdiff rewards list | check | convert` and `branchdiff serve-reward`: what rewards exist, whether one
spreads within groups (what GRPO learns from), a published checkpoint turned into a reward's folder, and a
reward served over HTTP."""

from __future__ import annotations

import argparse

from branchdiff.cli.common import check_device, check_model, load_model, reward_kwargs, sampling_settings


def cmd_rewards(args: argparse.Namespace) -> None:
    from branchdiff.rewards.registry import available, build_reward

    if args.rewards_command == "list":
        rows = available()
        columns = ("name", "source", "status", "weights")
        widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in columns}
        print("  ".join(c.ljust(widths[c]) for c in columns).rstrip())
        for row in rows:
            print("  ".join(row[c].ljust(widths[c]) for c in columns).rstrip())
        notes = [f"  {row['name']}: {row['note']}" for row in rows if row["note"]]
        if notes:
            print("\nnot downloaded: fetched from the hub when first used online; offline, download it and pass its local path as the\n"
                  "keyword argument shown (kwargs: {checkpoint: PATH}; docs/rewards.md). needs kwargs: settings a run must give it.\n"
                  "missing: install it as shown; broken: installed, but its import fails. not used: an installed entry point whose\n"
                  "name is taken, shown with both sources.")
            print("\n".join(notes))
        return
    if args.rewards_command == "convert":
        from branchdiff.rewards.videoalign_release import convert_videoalign

        destination = convert_videoalign(args.source, args.destination, args.template, args.base, args.step)
        print(f"wrote {destination}: reward {{name: videoalign, kwargs: {{path: {destination}}}}}")
        return
    from branchdiff.data.prompts import load_prompt_set
    from branchdiff.evaluation.preflight import check_prompt_set, preflight_rewards
    from branchdiff.models.registry import FAMILIES
    from branchdiff.rewards.combine import RewardSpec
    from branchdiff.rewards.frames import FrameAggregation
    from branchdiff.rewards.registry import check_reward_kwargs, resolve_reward
    from branchdiff.training.signal_check import check_reward

    check_device(args.device)
    kwargs = reward_kwargs(args.kwargs)
    factory = resolve_reward(args.name)
    check_reward_kwargs(args.name, factory, kwargs)
    settings, _ = sampling_settings(args)
    prompt_set = load_prompt_set(args.prompts, settings.fit)
    size = check_model(settings, None)  # everything that needs no weights, before the reward's and the model's load
    check_prompt_set(prompt_set, settings.family, size, [RewardSpec(args.name, kwargs=kwargs)], {args.name: factory})
    preflight_rewards([RewardSpec(args.name, kwargs=kwargs)], {args.name: factory})
    prompts, metadata = prompt_set.prompts[: args.num_prompts], prompt_set.metadata[: args.num_prompts]
    sde = "ddim" if FAMILIES[settings.family].steps == "ddim" else "flow"
    frames = FrameAggregation(args.every_frame, args.reduce) if args.every_frame else None
    if FAMILIES[settings.family].video and frames is None and not getattr(factory, "video", False):
        raise ValueError(f"rewards check: {args.name!r} scores images and the {settings.family} family makes videos; give --every-frame N "
                         "(score every N-th frame) and --reduce mean or min")
    reward = build_reward(args.name, args.device, kwargs)
    stats = check_reward(load_model(settings, None), reward, prompts, metadata, args.name, args.group_size, settings.steps, sde=sde,
                         frames=frames)
    print(f"reward {args.name!r}, scale: {getattr(reward, 'scale', 'unspecified')}; {stats['images']} images "
          f"({len(prompts)} prompts × {args.group_size}) from {args.prompts}")
    for key in ("min", "mean", "max", "within_group_std", "between_prompt_std", "zero_spread_fraction", "seconds_per_image",
                "nonfinite", "groups_dropped"):
        print(f"  {key:<22}{stats[key]:.4g}")
    if stats["zero_spread_fraction"] > 0.5 or stats["within_group_std"] < 1e-6:
        print("  weak signal: most groups score all their samples alike; GRPO learns nothing from those groups")


def cmd_serve_reward(args: argparse.Namespace) -> None:
    from branchdiff.rewards.registry import build_reward
    from branchdiff.rewards.remote import read_token
    from branchdiff.rewards.server import Limits, check_address, check_host, serve

    token = read_token(args.token_file) if args.token_file else None
    check_host(args.host, token)  # before the reward loads
    check_address(args.host, args.port)
    check_device(args.device)
    limits = Limits(args.max_images, args.max_bytes, args.max_batch)
    serve(build_reward(args.name, args.device, reward_kwargs(args.kwargs)), args.host, args.port, limits=limits, token=token)
