"""The command line's shape: `build_parser()` (every command, its options and their types), the
presets listed in `train --help`, and `UsageError`, argparse's errors as one line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from branchdiff.cli.arguments import at_least, finite, fraction, image_size, new_file_or_stdout, non_negative, port, positive
from branchdiff.runtime.hub import HUB_ATTEMPTS, HUB_TIMEOUT
from branchdiff.search.registry import SEARCHES
from branchdiff.settings.config import DEFAULT_PRESET, MAX_STEPS
from branchdiff.settings.evaluation import SOLVERS

EXAMPLES = """examples:
  branchdiff train                                  # the built-in tiny task, best preset: runs/tiny-mix-full/
  branchdiff train tiny-chain iterations=20 output_dir=runs/chain
  branchdiff train my.yaml train.learning_rate=1e-4
  branchdiff train my.yaml iterations=500 --resume latest   # continue, longer
  branchdiff config tiny-chain > my.yaml            # every key of a preset, to edit
  branchdiff sample --prompt "two red circles on the left" --weights runs/tiny-mix-full --out samples/
  branchdiff eval --weights runs/tiny-mix-full --json eval.json     # the run's own evaluation settings
  branchdiff report runs/tiny-mix-full                   # rebuild the run's report.html
  branchdiff rewards list                           # what rewards exist, what each needs
  branchdiff rewards check my_pkg.rewards:Sharpness --prompts tiny:held_out
  branchdiff serve-reward hpsv2.1 --port 8765 --device cuda:1   # then reward={remote: http://127.0.0.1:8765}
  accelerate launch --config_file $(branchdiff accelerate-config multi-gpu) -m branchdiff.cli train flux-hps-branch
"""
RUN_DEFAULTS = """defaults: with --weights of a run (RUN, RUN/lora, RUN/transformer, or a checkpoint RUN/checkpoints/iter-N), every
option left unset takes the run's own value from RUN/config.yaml (model, resolution, dtype, steps, shift, eval prompts, images per prompt,
guidance, eval rewards), so `branchdiff eval --weights RUN` reproduces the trained column of the run's final
evaluation (a line names any setting that differs); otherwise the built-in tiny model, 10 steps, tiny:held_out,
8 images per prompt, tiny-geneval."""


class UsageError(Exception):
    """A command-line problem argparse found, described in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the subcommand and its --help (no usage block);
    subcommand parsers are of this class too (add_subparsers uses the parent's class)."""

    subcommands: dict[str, _Parser]  # name → parser, once add_subparsers has been called

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        raise UsageError(f"{command + ': ' if command else ''}{message}; see {self.prog} --help")

    def add_subparsers(self, **kwargs) -> argparse._SubParsersAction:
        """argparse's, remembering the subcommands' parsers (`subcommands`)."""
        action = super().add_subparsers(**kwargs)
        self.subcommands = action.choices  # filled as each add_parser is called
        return action

    def takes(self, item: str) -> bool:
        """Whether an item of a command line is this parser's: one of its options (`--name`, `--name=value`),
        or a key=value override where it takes overrides."""
        if item.startswith("-"):
            return item.partition("=")[0] in self._option_string_actions
        return "=" in item and any(action.dest == "overrides" for action in self._actions)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="branchdiff", description="GRPO fine-tuning of text-to-image models on branching SDE trees.",
                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=installed_version(), help="print the installed version and exit")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="fine-tune with GRPO", formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=_presets_help())
    train.add_argument("config", nargs="?", default=None, help=f"preset name or YAML file (default: {DEFAULT_PRESET})")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. tree.roots=4")
    train.add_argument("--resume", default=None, help="'latest' or a checkpoint directory of this run")
    train.add_argument("--force", action="store_true", help="launch on CUDA even where branchdiff plan's estimate exceeds the GPU's memory")

    show = commands.add_parser("config", help="print the effective config of a preset or YAML file with overrides (a start for your own YAML)")
    show.add_argument("config", nargs="?", default=None, help=f"preset name or YAML file (default: {DEFAULT_PRESET})")
    show.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    for name, help_text in (("sample", "write PNGs for a prompt"), ("eval", "generate on a prompt set and score with rewards")):
        sub = commands.add_parser(name, help=help_text, epilog=RUN_DEFAULTS if name == "eval" else None,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("--weights", "--lora", dest="weights", default=None,
                         help="what a run trained: the run folder, its lora/ (or .safetensors) or fine-tuned transformer/ (unet/) "
                              "folder, or a checkpoint iter-N (default: the base model)")
        _model_arguments(sub)
        sub.add_argument("--steps", type=at_least(1, MAX_STEPS), default=None, help="ODE sampling steps (default: the run's, else 10)")
        sub.add_argument("--shift", type=finite, default=None, help="σ schedule shift s (default: the family's own schedule)")
        sub.add_argument("--guidance", type=finite, default=None, help="CFG scale, or FLUX's guidance embedding (default: the family's)")
        sub.add_argument("--guidance-2", dest="guidance_2", type=positive, default=None,
                         help="Wan 2.2 A14B: the low-noise expert's CFG scale, the pipeline's guidance_scale_2 (default: the run's "
                              "model.guidance_2, else --guidance)")
        sub.add_argument("--images-per-prompt", "--seeds", dest="images_per_prompt", type=at_least(1), default=None,
                         help="images per prompt (fixed seeds; default: the run's prompts.eval_seeds, else 8)")
        sub.add_argument("--solver", choices=SOLVERS, default=None,
                         help="training (default): the ODE of the steps branchdiff trains with; release: the sampler the model "
                              "folder ships (e.g. SANA's DPM-Solver++, SD 1.5's PNDM)")
        if name == "sample":
            sub.add_argument("--prompt", action="append", help="prompt (repeatable; required unless --from-trace)")
            sub.add_argument("--image", action="append", type=Path, default=None,
                             help="an editing family's source image, or an image-to-video family's first frame: once for every prompt, "
                                  "or once per --prompt (docs/editing.md, docs/video.md)")
            sub.add_argument("--out", type=Path, required=True, help="output directory")
            sub.add_argument("--seed", type=at_least(0), default=None, help="noise seed (default: 1234)")
            search = sub.add_argument_group("search (docs/search.md): the best images of a search over each prompt's denoising tree")
            search.add_argument("--search", choices=list(SEARCHES), default=None,
                                help="search within --budget instead of ODE samples; writes the best images and OUT/search.json")
            search.add_argument("--budget", type=at_least(1), default=None, help="per prompt: network rows (a CFG prediction costs 2), or with "
                                                                               "--budget-unit cost row-equivalents")
            search.add_argument("--budget-unit", choices=["rows", "cost"], default="rows",
                                help="rows: network rows only; cost: rows + each decode and reward call at its price in rows, from `branchdiff "
                                     "plan`'s FLOP counts for the family, size and reward (docs/search.md)")
            search.add_argument("--decode-cost", type=non_negative, default=None, help="with --budget-unit cost: one decode's price in rows "
                                                                                      "(default: the plan's count)")
            search.add_argument("--reward-cost", type=non_negative, default=None, help="with --budget-unit cost: one reward call's price in rows "
                                                                                      "(default: the plan's count; needed for a reward it does not count)")
            search.add_argument("--reward", default="tiny-geneval", help="what the search maximises: a name, dotted path or server URL")
            search.add_argument("--keep", type=at_least(1), default=1, help="best images written per prompt")
            search.add_argument("--sde", choices=["dance", "flow", "cps", "ddim"], default=None,
                                help="the stochastic step (default: flow for flow-matching families, ddim for SD 1.5)")
            search.add_argument("--noise-level", type=positive, default=None, help="its noise level (default: 0.7 flow, 1.0 ddim)")
            search.add_argument("--max-batch", type=at_least(1), default=16, help="network rows per forward (every forward is padded to it)")
            search.add_argument("--parallel", type=at_least(1), default=1, help="selections in flight per prompt: more fill each forward "
                                                                                "(--max-batch rows) when the prompts are few; 1 is the sequential search")
            search.add_argument("--temperature", type=positive, default=10.0, help="dts, dts-star: λ of selection and soft backup")
            search.add_argument("--max-children", type=at_least(1), default=4, help="dts, dts-star: children per node")
            search.add_argument("--root-children", type=at_least(1), default=None, help="dts, dts-star: initial noises per prompt (default: --max-children)")
            search.add_argument("--widening", type=non_negative, default=0.0,
                                help="dts, dts-star: progressive widening, ⌈w·√visits⌉ children per node when above the cap (default 0: off)")
            search.add_argument("--exploration", type=non_negative, default=0.0,
                                help="dts-star: c of a visit-count bonus c·√(ln N(node)/N(child)) on children's values (default 0: off)")
            search.add_argument("--x0-value", action="store_true", help="dts, dts-star with --parallel: a child whose image is still in flight "
                                                                        "is worth the reward of its predicted clean sample (else its parent's value)")
            search.add_argument("--rollout-depth", type=at_least(0), default=0,
                                help="dts, dts-star: early stops, a rollout goes at most k steps below the node it adds and is valued by "
                                     "the reward of its x̂0 there (default 0: off)")
            search.add_argument("--from-trace", type=Path, default=None, help="regrow the best images of a search.json from their noise paths")
        else:
            sub.add_argument("--prompts", default=None, help="tiny:held_out, hpdv2[:style], geneval, drawbench, hpdv2-test, flow-grpo-ocr:test "
                                                             "(docs/prompts.md), or a .txt / .jsonl / .csv / .json file (default: the run's prompts.eval)")
            sub.add_argument("--rewards", default=None,
                             help="comma-separated names, dotted paths or server URLs, or the config's form '[{name: hpsv2.1, kwargs: {checkpoint: PATH}}]' "
                                  "(default: the run's eval_rewards, else tiny-geneval)")
            sub.add_argument("--seed", type=at_least(0), default=None, help="noise seed, the same for base and LoRA (default: 1234, as a run's evaluations)")
            sub.add_argument("--device", default="cpu", help="device of the rewards (cpu, cuda, cuda:1)")
            sub.add_argument("--out", type=Path, default=None, help="output directory (default: eval-<run or lora name, or base>); a "
                                                                    "killed evaluation run again into it continues where it stopped")
            sub.add_argument("--json", type=Path, default=None, help="also write the summary to this JSON file")
            sub.add_argument("--benchmark", default=None, help="a paper's benchmark (geneval, ocr, pickscore, drawbench, hpdv2): its prompts, "
                                                               "scores, table and, for the family it was published on, its sampling protocol "
                                                               "(docs/benchmarks.md); --rewards then gives its scorers in its order")
            sub.add_argument("--compare", default=None, help="with --benchmark: a paper whose rows to print beside ours (e.g. flow-grpo)")

    rewards = commands.add_parser("rewards", help="list rewards, or check that one carries signal")
    which = rewards.add_subparsers(dest="rewards_command", required=True)
    which.add_parser("list", help="built-in and installed rewards, what each needs and where its weights come from")
    check = which.add_parser("check", help="sample groups from the model and print the reward's scale and spread")
    check.add_argument("name", help="registered name, entry point or dotted path 'package.module:Name'")
    check.add_argument("--prompts", default="tiny:held_out", help="prompt source (tiny:held_out, a .txt file, ...)")
    check.add_argument("--num-prompts", type=at_least(1), default=8, help="prompts sampled from the source")
    check.add_argument("--group-size", type=at_least(2), default=8, help="samples per prompt (a GRPO group)")
    _model_arguments(check)
    check.add_argument("--steps", type=at_least(1, MAX_STEPS), default=10, help="SDE sampling steps")
    check.add_argument("--device", default="cpu", help="device of the reward")
    check.add_argument("--kwargs", default=None, help="keyword arguments of the reward, a YAML mapping: '{checkpoint: PATH}'")
    check.add_argument("--every-frame", type=at_least(1), default=None, help="a video family: score every N-th frame with a reward of images")
    check.add_argument("--reduce", choices=["mean", "min"], default="mean", help="a video family: a video's score from its frames' scores")

    convert = which.add_parser("convert", help="turn a reward's published checkpoint into the folder its reward loads (docs/rewards.md)")
    convert.add_argument("format", choices=["videoalign"], help="the release's layout: videoalign (VideoReward's checkpoint)")
    convert.add_argument("source", type=Path, help="the release folder (model_config.json and checkpoint-N/)")
    convert.add_argument("destination", type=Path, help="the folder to write (the reward's path: kwargs: {path: DESTINATION})")
    convert.add_argument("--template", type=Path, required=True, help="VideoAlign's prompt_template.py (read, not run), or a text file "
                                                                     "holding the question the checkpoint was trained with")
    convert.add_argument("--base", type=Path, default=None, help="local folder of the base model (default: model_config's model_name_or_path)")
    convert.add_argument("--step", type=at_least(0), default=None, help="the checkpoint-N to convert (default: the highest N)")

    data = commands.add_parser("data", help="the public prompt sets benchmarks and recipes read: fetch them ahead of time, list what is cached")
    data_which = data.add_subparsers(dest="data_command", required=True)
    fetch = data_which.add_parser("fetch", help="download and check data sets into $BRANCHDIFF_DATA (default ~/.cache/branchdiff)")
    fetch.add_argument("names", nargs="+", help="data sets (branchdiff data list), or 'all'")
    data_which.add_parser("list", help="every data set: its files, source, licence and whether each is cached and checked")

    serve = commands.add_parser("serve-reward", help="serve a reward over HTTP (docs/reward-server.md)")
    serve.add_argument("name", help="registered name, entry point or dotted path 'package.module:Name'")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=port, default=8765, help="port to listen on, 1 to 65535 (default 8765)")
    serve.add_argument("--device", default="cpu", help="device of the reward's model")
    serve.add_argument("--kwargs", default=None, help="keyword arguments of the reward, a YAML mapping: '{checkpoint: PATH}'")
    serve.add_argument("--token-file", default=None, help="a file holding the shared token clients must send (required to listen beyond 127.0.0.1)")
    serve.add_argument("--max-images", type=at_least(1), default=256, help="most images (videos) in one request (default 256)")
    serve.add_argument("--max-bytes", type=at_least(1), default=256 * 2**20, help="most bytes in one request body (default 256 MiB)")
    serve.add_argument("--max-batch", type=at_least(1), default=64, help="most images scored in one call; concurrent requests batched up to it (default 64)")

    plan = commands.add_parser("plan", help="the memory a run needs per phase, whether it fits the GPU and what makes it fit; FLOPs and time (docs/plan.md)",
                               epilog="exit status: 0 when the run fits, 1 when it does not (the plan and its JSON written all the same), 2 on bad input")
    plan.add_argument("config", nargs="?", default=None, help=f"preset name or YAML file (default: {DEFAULT_PRESET})")
    plan.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. sampling.max_batch=8")
    plan.add_argument("--gpus", type=at_least(1), default=1, help="processes, one per GPU (default 1)")
    plan.add_argument("--nodes", type=at_least(1), default=1, help="machines the --gpus are spread over (default 1): the gradients' "
                                                                   "all-reduce traffic between them per iteration")
    plan.add_argument("--gpu", default=None, help="the GPU: h100-80gb, h200, a100-80gb, l40s, rtx4090 (default: the one the family's presets target)")
    plan.add_argument("--gpu-memory", type=positive, default=None, metavar="GB", help="the GPU's memory in GiB (overrides --gpu's)")
    plan.add_argument("--sharding", default="none", help="none | fsdp | fsdp-offload (FSDP2 over --gpus processes; docs/sharding.md)")
    plan.add_argument("--gpu-tflops", type=positive, default=None,
                      help="the GPU's peak TFLOP/s for the modelled time (default: its datasheet bf16 / TF32 figure)")
    plan.add_argument("--utilisation", type=fraction, default=0.4, help="the fraction of that peak the forwards reach, in (0, 1] (default 0.4)")
    plan.add_argument("--json", nargs="?", const="-", default=None, type=new_file_or_stdout, metavar="PATH",
                      help="write the plan as JSON to PATH, in a folder that exists (no PATH: print JSON only)")

    push = commands.add_parser("push", help="upload a run's weights and model card to the Hugging Face Hub")
    push.add_argument("run_dir", help="the run folder (output_dir of branchdiff train)")
    push.add_argument("--repo-id", required=True, help="the hub repository, OWNER/NAME (created when missing)")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--timeout", type=positive, default=HUB_TIMEOUT,
                      help=f"seconds each hub request may wait for the hub (connect, send, each read); a hub out of reach is tried "
                           f"{HUB_ATTEMPTS} times in all (default {HUB_TIMEOUT:g})")

    commands.add_parser("families", help="list the model families: built-in and installed, each one's pipeline, guidance and sizes")

    accel = commands.add_parser("accelerate-config", help="print the path of a packaged accelerate config (for --config_file)")
    accel.add_argument("name", nargs="?", default=None, help="single-gpu | multi-gpu | multi-node (none: list them)")

    _bench_arguments(commands.add_parser("bench", help="side-by-side benchmarks (branchdiff bench NAME --help: its options)"))

    report = commands.add_parser("report", help="(re)build RUN_DIR/report.html from a run's metrics, evaluations and samples")
    report.add_argument("run_dir", type=Path, help="a run directory (output_dir of branchdiff train)")
    for sub in (parser, *commands.choices.values()):
        sub.add_argument("--debug", action="store_true", help="on an error, show the traceback instead of one line")
    return parser


BENCHMARKS = {"tree": "one training iteration of each algorithm, side by side (docs/trees.md)",
              "explore": "each low-precision explorer's ranking of a pool against the policy's, and its cost (docs/explore.md)",
              "curves": "held-out accuracy against training time, per variant and seed (docs/curves.md)",
              "search": "the best reward each search finds against its budget of network rows (docs/search.md)",
              "reward-server": "a load test of a reward server on the loopback (docs/reward-server.md)",
              "overlap": "a run scored by a reward server as slow as its rollout, sequential and overlapped (docs/rewards.md)",
              "cache": "rollouts with the first-block cache (sampling.block_cache) against uncached ones: speed and reward (docs/gpu.md)",
              "proxies": "learned proxies of a built-in verifier, fit on base samples, and their accuracy (docs/hacking.md)",
              "hacking": "training on a proxy of the verifier: gold, proxy and KL over iterations, per mitigation (docs/hacking.md)"}


def _bench_arguments(bench: argparse.ArgumentParser) -> None:
    """`bench NAME`: a parser per benchmark holding only the options it reads, so that an option of
    another is refused (`unrecognized`) rather than ignored."""
    which = bench.add_subparsers(dest="which", required=True)
    tree, explore, curves, search, server, overlap, cache, proxies, hacking = (which.add_parser(name, help=text, description=text)
                                                                              for name, text in BENCHMARKS.items())
    for sub in (tree, explore, curves, search, server, overlap, cache, proxies, hacking):
        sub.add_argument("--json", type=Path, default=None, help="write the table and ratios to this JSON file")
    tree.add_argument("--repeats", type=at_least(1), default=3, help="timed repeats of each variant (median reported)")
    tree.add_argument("--variants", default=None, help="comma-separated variants (default: all: chain, tree, tree_depth_pruned, "
                                                       "tree_width_pruned, mix, best)")
    budget = curves.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=positive, default=None, help="the budget of each variant and seed in training minutes on --clock "
                                                                       "(default 2)")
    budget.add_argument("--iterations", type=at_least(1), default=None, help="the budget of each variant and seed in training iterations "
                                                                             "instead of time (the comparison of objectives on a shared "
                                                                             "machine: docs/curves.md)")
    for sub in (curves, search, proxies, hacking):
        sub.add_argument("--seeds", type=at_least(1), default=3, help="seeds of each variant")
        sub.add_argument("--out", type=Path, default=None, help="folder of the plot and the table (default: runs/bench-<name>/)")
    curves.add_argument("--variants", default=None, help="comma-separated variants (default: chain, branch, branch_pruned, mix, explore_seeds, "
                                                         "explore_tree; the objectives guard, layertuning, nft_tree, nft_tree_depthwise, "
                                                         "nft_chain, sol, awm, dgpo, dppo, dpo, mc_grpo, sft, dpo_offline, the default run's "
                                                         "recipe default, and the warm starts sft_then_default, dpo_offline_then_default when "
                                                         "named), each optionally with :key=value overrides (awm:train.learning_rate=1e-4)")
    curves.add_argument("--merge", default=None, help="comma-separated JSON results of runs over other seeds (--first-seed) to merge into one "
                                                      "table, plot and --json, with the intervals and tests on all their seeds; nothing is trained")
    curves.add_argument("--reference", default=None, help="the variant whose final accuracy the others' times are measured "
                                                           "against (time_to_<reference>_final; e.g. mix to compare objectives with GRPO; "
                                                           "default: chain, or with --merge the files' own)")
    curves.add_argument("--task", choices=["tiny", "tiny-video"], default="tiny", help="the built-in task, images (tiny) or clips (tiny-video)")
    curves.add_argument("--points", type=at_least(2), default=7, help="evaluations over the budget")
    for sub in (curves, search, hacking):
        sub.add_argument("--first-seed", type=at_least(0), default=0, help="the first seed (continue a benchmark's seeds in another process)")
    curves.add_argument("--eval-images", type=at_least(1), default=4, help="held-out images per prompt at each evaluation")
    curves.add_argument("--clock", choices=["wall", "modelled"], default=None,
                        help="the clock of a --minutes budget: measured wall time (default), or modelled GPU time (low-precision "
                             "explorer rows charged at their format's cost; branchdiff/bench/clock.py)")
    search.add_argument("--images", type=at_least(1), default=32, help="the largest budget, in images' worth of network rows per prompt")
    search.add_argument("--sampler", action="store_true", help="measure the searches as samplers of the reward-tilted target "
                                                               "(distance to p* on Gaussian-mixture flows) instead of the best reward on the tiny task")
    search.add_argument("--temperature", type=positive, default=None, help="with --sampler: λ of the target p·exp(λ·r) (default 4)")
    search.add_argument("--variants", default=None, help="comma-separated searches (default: all: best-of-n, tree, dts, dts-star, dts-is); "
                                                         "with --sampler, samplers (dts, dts-unguided, dts-is, best-of-n-is, smc)")
    search.add_argument("--task", choices=["tiny", "mixture"], default=None, help="the task searched: the tiny task's held-out prompts "
                                                                                 "(default), or mixture: a target point in a 16-D Gaussian mixture, "
                                                                                 "a reward that does not saturate within the budgets")
    search.add_argument("--testbeds", default=None, help="with --sampler: comma-separated testbeds as DIMS-D-REWARD (default: all: "
                                                         "2-D-mode, 2-D-sharp, 2-D-smooth, 16-D-mode)")
    search.add_argument("--target-seed", type=at_least(0), default=None, help="with --task mixture: the seed of its target points (default: "
                                                                               "2027, which no lever was tuned on; 123: the tuning's)")
    search.add_argument("--prices", default=None, help="comma-separated price sets the searches' cost is read under (default: all: call-as-row, "
                                                       "tiny, sd35-pickscore-512, flux-hps-1024, wan-1.3b-videoalign; docs/search.md)")
    overlap.add_argument("--iterations", type=at_least(1), default=9, help="timed iterations of each mode (median reported)")
    overlap.add_argument("--replicas", type=at_least(2), default=None, help="instead: a reward twice as slow as the rollout served by one "
                                                                            "replica and by this many, both overlapped (docs/reward-server.md)")
    cache.add_argument("--thresholds", default="0.1,0.2,0.4", help="comma-separated cache thresholds (each > 0; the uncached rollout is always measured)")
    cache.add_argument("--draws", type=at_least(1), default=5, help="iterations' trees measured (prompts and noise of iterations --first-draw on)")
    cache.add_argument("--first-draw", type=at_least(0), default=0, help="the first iteration drawn (tune on some draws, report others)")
    cache.add_argument("--repeats", type=at_least(1), default=3, help="timed rollouts of each draw and threshold (median), after a warm-up")
    cache.add_argument("--task", choices=["tiny-video", "tiny"], default="tiny-video", help="the built-in task: clips (its preset, DiffusionNFT) "
                                                                                        "or images (tiny-mix with train.loss=nft)")
    proxies.add_argument("--task", choices=["tiny", "tiny-video"], default="tiny", help="the built-in task whose verifier the proxies learn")
    proxies.add_argument("--sizes", default="64,256,1024,4096", help="comma-separated numbers of base samples a proxy is fit on")
    proxies.add_argument("--steps", type=at_least(1), default=1000, help="Adam steps of 64 samples per proxy")
    hacking.add_argument("--reward", default=None, help="the proxy trained on: a reward's name or a YAML mapping, e.g. '{name: learned-proxy, "
                                                        "kwargs: {path: runs/bench-proxies/tiny-geneval-n64-s0}}' (required but with --merge)")
    hacking.add_argument("--ensemble", default=None, help="comma-separated proxy folders of the ensemble-* and *-sum variants")
    hacking.add_argument("--variants", default=None, help="comma-separated mitigations (default: none): none, kl, guard, nft, awm, "
                                                          "ensemble-mean, ensemble-min, ensemble-mean-std, normalize-then-sum, sum-then-normalize, "
                                                          "lora, watch-stop, gold-reward, each optionally with :key=value overrides")
    hacking.add_argument("--iterations", type=at_least(1), default=200, help="training iterations of each variant and seed")
    hacking.add_argument("--points", type=at_least(2), default=9, help="evaluations over the budget")
    hacking.add_argument("--task", choices=["tiny", "tiny-video"], default="tiny", help="the built-in task, images or clips")
    hacking.add_argument("--eval-images", type=at_least(1), default=4, help="held-out images per prompt at each evaluation")
    hacking.add_argument("--kl-chains", type=at_least(1), default=2, help="SDE chains per held-out prompt of the KL's estimate")
    hacking.add_argument("--best-of-n", type=at_least(1), default=32, help="the largest n of best-of-n on the proxy (base samples per prompt)")
    hacking.add_argument("--merge", default=None, help="comma-separated JSON results of runs over other seeds to merge; nothing is trained")
    for sub in (tree, explore, curves, overlap, cache, hacking):
        sub.add_argument("overrides", nargs="*", help="dotted key=value overrides of every variant, e.g. prompts.per_iteration=2")


def unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> str:
    """The line for what no option of the command took. An option (or key=value overrides) of another
    benchmark than the one named (`bench tree --sampler`) names the benchmarks that take it; one of
    the benchmark named, given before its name (`bench --sampler search`), says where it goes."""
    command = f"{args.command} {args.which}" if args.command == "bench" else args.command
    if args.command == "bench":
        benchmarks = parser.subcommands["bench"].subcommands
        for item in extra:
            if benchmarks[args.which].takes(item):
                return f"{command}: {item} goes after the benchmark's name: branchdiff {command} {item}; see branchdiff {command} --help"
            owners = [f"bench {name}" for name, sub in benchmarks.items() if sub.takes(item)]
            named = " and ".join([", ".join(owners[:-1]), owners[-1]] if len(owners) > 2 else owners)
            see = f"see branchdiff {owners[0] if owners else command} --help"
            if owners and item.startswith("-"):
                return f"{command}: {item.partition('=')[0]} is an option of {named}, not of {command}; {see}"
            if owners:
                return f"{command}: key=value overrides ({item}) are taken by {named}, not by {command}; {see}"
    return f"{command}: unrecognized arguments: {' '.join(extra)}; see branchdiff {command} --help"


DISTRIBUTION = "branchdiff-rl"  # the name pip installs the package under (`branchdiff` on PyPI is another tool)


def installed_version() -> str:
    """`--version`'s line: `branchdiff <version>` from the installed distribution's metadata."""
    from importlib import metadata

    try:
        return f"branchdiff {metadata.version(DISTRIBUTION)}"
    except metadata.PackageNotFoundError:
        return f"branchdiff (version unknown: the distribution {DISTRIBUTION} is not installed here; pip install -e .)"


def _presets_help() -> str:
    """`train --help`'s epilog: the packaged presets, each with the summary on the first line of its comment (whole)."""
    lines = ["presets (branchdiff/configs/; print one with `branchdiff config NAME`):"]
    paths = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    width = max(len(path.stem) for path in paths) + 1  # the names' column, one space past the longest
    for path in paths:
        lines.append(f"  {path.stem:<{width}}{path.read_text().splitlines()[0].lstrip('# ').strip()}")
    lines += ["", "the tiny presets fine-tune every weight of the built-in model (exported to RUN/transformer/); the real-model presets",
              "train LoRA adapters (RUN/lora/, for pipe.load_lora_weights); model.finetune=lora|full chooses.", "",
              "every key, its type, default and meaning: branchdiff/settings/config.py; bad input ends with one line and exit 2",
              "(docs/errors.md), --debug shows the traceback; runs end by printing where their folder, weights and report are"]
    return "\n".join(lines)


def _model_arguments(sub: argparse.ArgumentParser) -> None:
    from branchdiff.models.registry import FAMILIES

    sub.add_argument("--family", default=None, choices=list(FAMILIES), help="model family (default: tiny)")
    sub.add_argument("--model", default=None, help="diffusers pipeline directory or hub id (default: the built-in tiny model)")
    sub.add_argument("--resolution", type=image_size, default=None, help="image size in pixels: H (a square) or HxW, e.g. 768x1344 "
                                                                      "(default: the run's, else the family's)")
    sub.add_argument("--frames", type=at_least(1), default=None, help="a video family's frames per video, r·k + 1 (default: the run's, else "
                                                                       "the family's: wan 81)")
    sub.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weights' dtype (default: float32)")
    sub.add_argument("--fit", default=None, choices=["resize", "crop", "pad", "refuse"],
                     help="a source image (editing, image-to-video) of another aspect ratio than --resolution: resize (stretched, as the "
                          "pipelines resize), crop, pad or refuse (default: the run's sources.fit, else resize)")
    sub.add_argument("--no-prompt-instruction", dest="prompt_instruction", action="store_const", const=False, default=None,
                     help="sana: the bare prompt, without the pipeline's instruction before it (default: the run's model.prompt_instruction)")
