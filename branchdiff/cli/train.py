"""`branchdiff train` and `branchdiff config`: a preset or YAML file with dotted overrides, validated
before anything is written; `train` claims the run folder, trains, evaluates and says where the
results are."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def split_train_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """argparse puts a first `key=value` into `config`; move it back to the overrides."""
    if args.config and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def cmd_train(args: argparse.Namespace) -> None:
    """Validate everything, claim the run directory (the first process), load, train, evaluate,
    and say where the results are. A failure before the first file is written leaves no folder behind."""
    from branchdiff.runtime.run_dir import claim
    from branchdiff.settings.load import load_config, preset_or_default, to_dict
    from branchdiff.settings.validate import tracker_names
    from branchdiff.training import trackers
    from branchdiff.training.preflight import check_inputs

    source, overrides = split_train_args(args)
    source = preset_or_default(source, overrides)
    config = load_config(source, overrides)
    check_inputs(config)  # rewards and prompt sources, before anything is created
    from branchdiff.training.fit import check_fits, write_plan

    plan = check_fits(source, overrides, args.force)  # on CUDA: does it fit? (before anything loads)
    run_dir = Path(config.output_dir)
    first_process = int(os.environ.get("RANK", "0")) == 0
    claimed = claim(run_dir, resume=bool(args.resume)) if first_process else None
    if claimed and plan is not None:
        write_plan(run_dir, plan)
    from branchdiff.evaluation.evaluate import format_comparison
    from branchdiff.runtime import checkpoint
    from branchdiff.runtime.distributed import disconnect
    from branchdiff.runtime.watchdog import explain_failure
    from branchdiff.training.recipe import Trainer, train

    try:
        trainer = Trainer(config, resume=args.resume)
    except BaseException as error:
        if claimed:
            claimed.abandon()
        explained = explain_failure(error, checkpoint.newest(run_dir / "checkpoints"))  # a rank lost before the watch began
        if explained is None:
            raise
        raise explained from None
    try:
        train(trainer)
        comparison = trainer.final_evaluation() if config.final_eval else None  # every process samples its share
        names = tracker_names(config.logging.report_to)
        if comparison is not None and names:  # the trackers' run again (its id), for the final evaluation's means
            trackers.start(trainer.accelerator, names, run_dir, config.iterations, to_dict(config))
            trainer.accelerator.log(trackers.final_evaluation(comparison), step=config.iterations)
            trackers.finish(trainer.accelerator)
        disconnect(trainer.accelerator)
        if not trainer.accelerator.is_main_process:
            return
        if comparison is not None:
            from branchdiff.report.model_card import write_model_card

            write_model_card(run_dir, trainer.finetune.export_name)  # with the evaluation table
            print(f"held-out evaluation ({config.prompts.eval}, {config.prompts.eval_seeds} seeds each, ODE {config.sampling.num_steps} steps):")
            print(format_comparison(comparison))
        from branchdiff.report.run_report import write_report
        from branchdiff.runtime.sharding import plain_class

        how = ("pipe.load_lora_weights loads it" if trainer.finetune.export_name == "lora" else
               f"{plain_class(trainer.adapter.denoiser).__name__}.from_pretrained loads it")
        print(f"run folder: {run_dir}/\n  weights: {run_dir / trainer.finetune.export_name}/  ({how}; "
              f"branchdiff sample/eval --weights {run_dir})\n"
              f"  report: {write_report(run_dir)}\n  checkpoints: {trainer.checkpoint_dir}/ (continue with --resume latest)")
    finally:  # the lock is dropped when the run ends, however it ends (not when its objects are collected)
        if claimed:
            claimed.release()


def cmd_config(args: argparse.Namespace) -> None:
    """Print the effective config of a preset or YAML file with overrides, as YAML."""
    import yaml

    from branchdiff.settings.load import load_config, preset_or_default, to_dict

    source, overrides = split_train_args(args)
    print(yaml.safe_dump(to_dict(load_config(preset_or_default(source, overrides), overrides)), sort_keys=False), end="")
