"""The papers' benchmarks by name (`branchdiff eval --benchmark NAME`, docs/benchmarks.md): each a prompt set, the scores
its tables report, how those are laid out, and the sampling protocol of the public evaluation code behind a paper's
numbers, every value with its source (repository, file and line at a commit, or the paper's table).

A protocol is a family's: the paper's model family (SD3.5 Medium for Flow-GRPO and DiffusionNFT, SD 1.5 for GenEval's
own generator). For another family no paper fixed one, and the benchmark samples with that family's own settings
(`branchdiff eval`'s defaults) and says so. Every value can be overridden on the command line; the output names what
differs from the protocol.

One difference is in every protocol: the seed rule. The papers' scripts draw every image's noise from one global
generator (seeded 42 once, or per prompt); branchdiff draws image s of prompt p from the addressable noise (`--seed`,
prompt p, root s), so an image does not depend on which process or batch made it. The numbers therefore compare in
distribution, not image by image.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FLOW_GRPO = "yifan123/flow_grpo@ac4c86e8"
GENEVAL_REPO = "djghosh13/geneval@af4902f2"
NFT = "NVlabs/DiffusionNFT@24af5554"


@dataclass(frozen=True)
class Setting:
    value: object
    source: str  # where the value is read: "repository@commit file:line", or a paper's table


@dataclass(frozen=True)
class Protocol:
    """How a paper sampled the images of its table."""

    paper: str
    steps: Setting
    guidance: Setting
    resolution: Setting
    images_per_prompt: Setting
    seed: Setting  # the paper's seed rule (branchdiff's is the addressable noise of `--seed`: module doc)
    solver: Setting  # the sampler: branchdiff's `training` ODE is the Euler flow step the papers' SD3 pipelines take


@dataclass(frozen=True)
class Benchmark:
    about: str
    prompts: str  # the prompt source (branchdiff/data/prompts.py)
    rewards: tuple[str, ...]  # the rewards that score it, by registered name (kwargs by --rewards)
    columns: tuple[tuple[str, str], ...]  # (score, the column title of the papers' table), in their order
    images_per_prompt: Setting  # the images of each prompt its tables average over, whatever the family
    protocols: dict[str, Protocol] = field(default_factory=dict)  # by family
    by_tag: bool = False  # GenEval: scores per prompt tag, the overall their mean (geneval_rules.summarise)
    by_style: bool = False  # HPDv2: each style's mean beside the whole set's


def _flow_grpo(images_per_prompt: Setting) -> Protocol:
    """Flow-GRPO's evaluation of SD3.5 Medium (its GenEval, OCR and PickScore columns)."""
    return Protocol(
        "Flow-GRPO (arXiv 2505.05470)",
        Setting(40, f"{FLOW_GRPO} config/grpo.py:77 (eval_num_steps), scripts/train_sd3.py:253"),
        Setting(4.5, f"{FLOW_GRPO} config/grpo.py:78 (guidance_scale), scripts/train_sd3.py:254; negative prompt \"\""),
        Setting(512, f"{FLOW_GRPO} config/grpo.py:80 (resolution), scripts/train_sd3.py:256-257"),
        images_per_prompt,
        Setting("one global generator, set_seed(42) once", f"{FLOW_GRPO} config/base.py:11, scripts/train_sd3.py:373-374"),
        Setting("training", f"{FLOW_GRPO} scripts/train_sd3.py:258 (noise_level=0: the deterministic Euler flow step)"))


def _nft(images_per_prompt: Setting) -> Protocol:
    """DiffusionNFT's evaluation of its CFG-free SD3.5 Medium (scripts/evaluation.py's defaults)."""
    return Protocol(
        "DiffusionNFT (arXiv 2509.16117)",
        Setting(40, f"{NFT} scripts/evaluation.py:353-367 (num_inference_steps)"),
        Setting(1.0, f"{NFT} scripts/evaluation.py:353-367 (guidance_scale 1.0: the CFG-free model; its README uses 4.5 for CFG checkpoints)"),
        Setting(512, f"{NFT} scripts/evaluation.py:353-367 (resolution)"),
        images_per_prompt,
        Setting("none set: torch's default generator", f"{NFT} scripts/evaluation.py:242-249"),
        Setting("release", f"{NFT} scripts/evaluation.py:130, 242-249 (StableDiffusion3Pipeline's own call and scheduler)"))


PER_LINE_ONE = Setting(1, f"{FLOW_GRPO} scripts/train_sd3.py:59-69, 529-535 (one image per line of the test file)")
GENEVAL_FOUR = Setting(4, f"{GENEVAL_REPO} generation/diffusers_generate.py:44 (--n_samples); {FLOW_GRPO} dataset/geneval/test_metadata.jsonl "
                          "holds the 553 prompts 4 times each (2,212 lines)")
DRAWBENCH_FIVE = Setting(5, f"{NFT} dataset/drawbench/test.txt: the 200 prompts, each 5 times (1,000 lines)")
BENCHMARKS: dict[str, Benchmark] = {
    "geneval": Benchmark(
        "GenEval (Ghosh et al., 2023): 553 prompts of six tasks, 4 images each, judged by a detector and CLIP colours",
        "geneval", ("geneval",),
        (("overall", "Overall"), ("single_object", "Single obj."), ("two_object", "Two obj."), ("counting", "Counting"),
         ("colors", "Colors"), ("position", "Position"), ("color_attr", "Attr. binding")), GENEVAL_FOUR,
        {"sd3": _flow_grpo(GENEVAL_FOUR),
         "sd15": Protocol("GenEval (arXiv 2310.11513)",
                          Setting(50, f"{GENEVAL_REPO} generation/diffusers_generate.py:50 (--steps)"),
                          Setting(9.0, f"{GENEVAL_REPO} generation/diffusers_generate.py:76 (--scale)"),
                          Setting(None, f"{GENEVAL_REPO} generation/diffusers_generate.py:64, 70 (--H, --W unset: the pipeline's own size)"),
                          GENEVAL_FOUR,
                          Setting("seed_everything(42) before every prompt", f"{GENEVAL_REPO} generation/diffusers_generate.py:79-84, 116"),
                          Setting("release", f"{GENEVAL_REPO} generation/diffusers_generate.py (the pipeline's own scheduler)"))},
        by_tag=True),
    "ocr": Benchmark(
        "Flow-GRPO's visual text rendering test split: 1,018 prompts, the OCR reward's mean",
        "flow-grpo-ocr:test", ("ocr",), (("ocr", "OCR acc."),), PER_LINE_ONE, {"sd3": _flow_grpo(PER_LINE_ONE)}),
    "pickscore": Benchmark(
        "Flow-GRPO's Pick-a-Pic test split: 2,048 prompts, PickScore's mean",
        "flow-grpo-pickscore:test", ("pickscore",), (("pickscore", "PickScore"),), PER_LINE_ONE, {"sd3": _flow_grpo(PER_LINE_ONE)}),
    "drawbench": Benchmark(
        "DrawBench (Imagen): 200 prompts, 5 images each, the quality and preference scores DiffusionNFT tabulates",
        "drawbench", ("clip-score", "hpsv2.1", "aesthetic", "imagereward", "pickscore"),
        (("clip-score", "ClipScore"), ("hpsv2.1", "HPSv2.1"), ("aesthetic", "Aesthetic"), ("imagereward", "ImgRwd"), ("pickscore", "PickScore")),
        DRAWBENCH_FIVE, {"sd3": _nft(DRAWBENCH_FIVE)}),
    "hpdv2": Benchmark(
        "the HPS v2 benchmark: 3,200 prompts in four styles, HPS v2 and v2.1 per style",
        "hpdv2", ("hpsv2", "hpsv2.1"), (("hpsv2", "HPS v2"), ("hpsv2.1", "HPS v2.1")),
        Setting(1, "tgxs002/HPSv2@866735ec hpsv2/evaluation.py:148-151 (one image per prompt; a style's score the mean of its "
                   "ten 80-prompt parts' means, equal to its mean)"), by_style=True),
}


def benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"--benchmark {name}: no such benchmark; known: {', '.join(BENCHMARKS)} (docs/benchmarks.md)")
    return BENCHMARKS[name]


def protocol_settings(name: str, family: str) -> tuple[dict[str, object], Protocol | None]:
    """The eval settings a benchmark fixes for a family (steps, guidance, resolution, images per prompt, solver, prompts,
    rewards; None values left to the family), and its protocol (None: no paper's protocol for this family)."""
    chosen = benchmark(name)
    settings: dict[str, object] = {"prompts": chosen.prompts, "rewards": ",".join(chosen.rewards),
                                   "images_per_prompt": chosen.images_per_prompt.value}
    found = chosen.protocols.get(family)
    if found is not None:
        settings.update(steps=found.steps.value, guidance=found.guidance.value, resolution=found.resolution.value,
                        images_per_prompt=found.images_per_prompt.value, solver=found.solver.value)
    return {k: v for k, v in settings.items() if v is not None}, found
