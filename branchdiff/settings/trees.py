"""The tree layer's settings: the tree an iteration grows (`tree_spec`: splits, Mix window), the steps
whose edges can train (`trainable_steps`), and the checks of the `tree.*`, `prune.*`, trainable-step
and cps keys, each a `ConfigError` with one line naming the key and the fix (docs/trees.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

from branchdiff.core.prune import mix_sde_steps
from branchdiff.core.tree import Split, TreeSpec
from branchdiff.errors import ConfigError
from branchdiff.objectives.registry import OBJECTIVES, decoupled
from branchdiff.settings.config import TrainConfig


def tree_spec(config: TrainConfig, iteration: int) -> TreeSpec:
    """The tree an iteration grows: the configured splits, and the Mix window where enabled."""
    tree = config.tree
    sde_steps = None
    if tree.mix_window:
        sde_steps = mix_sde_steps(config.sampling.num_steps, tree.mix_window, iteration, tree.mix_start, tree.mix_slide_every)
    splits = tuple(Split(*split_parts(entry)) for entry in tree.splits)
    return TreeSpec(config.sampling.num_steps, splits, tree.roots, tree.split_noise_level, tree.anchor_noise_multiplier, sde_steps)


def split_parts(entry: list[float | dict]) -> tuple[int, int, float | None]:
    """(step, k, the split's noise level or None) of a `tree.splits` entry [step, k] or [step, k, {noise_level: x}]."""
    step, k, *options = entry
    level = options[0].get("noise_level") if options and isinstance(options[0], dict) else None
    return int(cast(float, step)), int(cast(float, k)), level


def validate_tree(config: TrainConfig) -> None:
    """The splits, the tree they make, the Mix window, the pruned depths and the step fractions."""
    steps = config.sampling.num_steps
    for entry in config.tree.splits:
        _validate_split_entry(entry)
    try:
        tree_spec(config, 0)
    except ValueError as error:
        raise ConfigError(f"'tree.splits' = {config.tree.splits}: {error}") from None
    if config.tree.mix_window and config.tree.mix_start + config.tree.mix_window > steps:
        raise ConfigError(f"'tree.mix_start' + 'tree.mix_window' = {config.tree.mix_start + config.tree.mix_window} exceeds sampling.num_steps = {steps}")
    bad = [d for d in config.prune.depths if not 1 <= d <= steps]
    if bad:
        raise ConfigError(f"'prune.depths' {bad} outside 1..{steps} (child depths of the {steps}-step tree)")
    for name in ("width_ratio", "active_fraction"):
        if getattr(config.prune, name) > 1:
            raise ConfigError(f"'prune.{name}' = {getattr(config.prune, name)} must be in (0, 1]")
    for name in ("step_fraction", "train_steps_fraction"):
        if getattr(config.train, name) > 1:
            raise ConfigError(f"'train.{name}' = {getattr(config.train, name)} must be in (0, 1]")


SPLIT_FORM = "[step, k] or [step, k, {noise_level: x}] with whole step and k"


def _validate_split_entry(entry: list) -> None:
    numbers, options = entry[:2], entry[2:]
    if len(entry) not in (2, 3) or any(isinstance(n, dict) or not float(n).is_integer() for n in numbers):
        raise ConfigError(f"'tree.splits' entry {entry!r} must be {SPLIT_FORM}")
    if options and not isinstance(options[0], dict):
        raise ConfigError(f"'tree.splits' entry {entry!r}: the third element must be a mapping {{noise_level: x}} "
                          "(the SDE's η / a at this split); the release's noise-only kick is tree.anchor_noise_multiplier")
    if options and set(options[0]) != {"noise_level"}:
        raise ConfigError(f"'tree.splits' entry {entry!r}: allowed split options: noise_level")
    level = options[0]["noise_level"] if options else 1.0
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not math.isfinite(level) or level <= 0:
        raise ConfigError(f"'tree.splits' entry {entry!r}: noise_level must be a finite number > 0")


CPS_LEVELS = (0.01, 1.0)  # cps's a: std = σ'·sin(aπ/2) is ≥ 1.6 % of σ' at 0.01; above 1 it shrinks again, ≤ 0 from a = 2
CPS_RANGE = (f"with sampling.sde=cps the level a must be in [{CPS_LEVELS[0]}, {CPS_LEVELS[1]:g}] (std = σ'·sin(aπ/2): a > 1 repeats "
             f"a smaller level's std, a ≥ 2 gives std ≤ 0 and NaN log-probs, a < {CPS_LEVELS[0]} a std of about 0)")


def validate_cps(config: TrainConfig) -> None:
    """cps's noise levels stay in its range; no split at the last step, where cps's std is 0."""
    low, high = CPS_LEVELS
    fix = "use e.g. 0.8 (cps's usual level), or sampling.sde=flow or dance to explore more than a = 1 does"
    for name, level in (("sampling.noise_level", config.sampling.noise_level), ("tree.split_noise_level", config.tree.split_noise_level)):
        if level is not None and not low <= level <= high:
            raise ConfigError(f"'{name}' = {level!r} is outside cps's range: {CPS_RANGE}; {fix}")
    last = config.sampling.num_steps - 1
    for entry in config.tree.splits:
        step, k, level = split_parts(entry)
        if level is not None and not low <= level <= high:
            raise ConfigError(f"'tree.splits' entry {entry!r}: noise_level {level!r} is outside cps's range: {CPS_RANGE}; {fix}")
        if step == last:
            raise ConfigError(f"'tree.splits' entry {entry!r} splits at the last step, {last} (sampling.num_steps = {last + 1}), where cps's "
                              f"std σ'·sin(aπ/2) is 0 (σ' = 0): its {k} children would be identical; split at an earlier "
                              "step or use sampling.sde=flow or dance")


def steps_text(steps: list[int]) -> str:
    """[0, 1, 2, 5] → '0..2, 5'."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs) or "none"


def trainable_steps(config: TrainConfig, iteration: int) -> list[int]:
    """Steps whose edges can get gradients at `iteration` before subsampling and pruning: SDE steps
    s < ⌊f·T⌋ (f = train.train_steps_fraction; `ClippedGRPO.trainable_mask` starts from these), without cps's last step
    (std 0, no density)."""
    steps = config.sampling.num_steps
    limit = math.floor(config.train.train_steps_fraction * steps + 1e-9)
    return [s for s in usable_sde_steps(config, iteration) if s < limit]


def usable_sde_steps(config: TrainConfig, iteration: int) -> list[int]:
    spec = tree_spec(config, iteration)
    last = spec.num_steps - 1
    return [s for s in range(spec.num_steps) if spec.is_sde(s) and not (config.sampling.sde == "cps" and s == last)]


def window_iterations(config: TrainConfig) -> list[int]:
    """The first iteration of every Mix window position reached in range(iterations): the window is
    the only part of `tree_spec` that changes between iterations."""
    tree = config.tree
    if not tree.mix_window or not tree.mix_slide_every:
        return [0]
    last_offset = max(0, config.sampling.num_steps - tree.mix_window - tree.mix_start)
    return [p * tree.mix_slide_every for p in range(last_offset + 1) if p * tree.mix_slide_every < config.iterations]


def validate_trainable(config: TrainConfig) -> None:
    """Refuse settings under which some iteration would train nothing: no trainable SDE step, one
    sample per group, or trainable steps that compare no two nodes."""
    _validate_trainable_steps(config)
    _validate_group_size(config)
    _validate_compared_depths(config)



def _validate_trainable_steps(config: TrainConfig) -> None:
    """Every iteration must have a trainable SDE step (`trainable_steps`)."""
    steps, fraction = config.sampling.num_steps, config.train.train_steps_fraction
    iterations = window_iterations(config)
    window = " (Mix window and split steps)" if config.tree.mix_window else ""
    usable = {i: usable_sde_steps(config, i) for i in iterations}
    for i in iterations:
        if usable[i]:
            continue
        # only cps's last step is SDE: its std σ'·sin(aπ/2) is 0 there (σ' = 0)
        zero = "where cps's std σ'·sin(aπ/2) is 0 (σ' = 0), so nothing would be trained"
        if not config.tree.mix_window:
            raise ConfigError(f"'sampling.sde' = 'cps' with sampling.num_steps = 1: the only step is the last, {zero}; "
                              "use sampling.num_steps ≥ 2 or sampling.sde=flow or dance")
        at = f"at iteration {i} " if len(iterations) > 1 else ""
        raise ConfigError(f"'sampling.sde' = 'cps' with 'tree.mix_window' = {config.tree.mix_window}: {at}the only SDE step (Mix window "
                          f"and split steps) is the last ({steps - 1}), {zero}; widen tree.mix_window, split before the last step, "
                          "or use sampling.sde=flow or dance")
    starved = [i for i in iterations if not trainable_steps(config, i)]
    if starved:
        first = starved[0]
        at = f"at iteration {first} " if len(iterations) > 1 else ""
        needed = max(usable[i][0] for i in iterations) + 1  # every iteration's first usable step must be below ⌊f·T⌋
        at_least = math.ceil(needed / steps * 100 - 1e-9) / 100
        limit = math.floor(fraction * steps + 1e-9)
        shorter = f" or iterations ≤ {first}" if first > 0 else ""
        raise ConfigError(f"'train.train_steps_fraction' = {fraction!r} trains only steps s < ⌊{fraction!r}·{steps}⌋ = {limit}, but {at}the "
                          f"SDE steps{window} are {steps_text(usable[first])}: nothing would be trained; "
                          f"use train.train_steps_fraction ≥ {at_least:g}{shorter}")


def _validate_compared_depths(config: TrainConfig) -> None:
    """A trainable step must lead to a depth holding ≥ 2 nodes of a prompt's tree (nodes compared by
    the depth-wise advantage; a lone node's advantage is 0), and static depth pruning must leave one.
    Explore tree mode is left out: its regenerated sub-tree's widths depend on the selection."""
    if config.explore.mode == "tree":
        return
    prune = config.prune
    pruned = set(prune.depths) if not prune.slide_every else set()
    for iteration in window_iterations(config):
        spec = tree_spec(config, iteration)
        roots = config.explore.keep if config.explore.mode == "seeds" else spec.roots
        sizes = dataclasses.replace(spec, roots=roots).level_sizes()  # nodes per prompt at each depth of the trained tree
        trainable = trainable_steps(config, iteration)
        compared = [s for s in trainable if sizes[s + 1] >= 2]
        at = f"at iteration {iteration} " if iteration else ""
        if not compared:
            raise ConfigError(f"{at}the trainable steps {steps_text(trainable)} (train.train_steps_fraction = "
                              f"{config.train.train_steps_fraction!r}) all lead to depths with one node per prompt (the first split "
                              f"is at step {min(spec.split_steps, default='none')}): every advantage there is 0, so nothing would be trained; "
                              "split earlier or raise train.train_steps_fraction")
        if pruned and {s + 1 for s in compared} <= pruned:
            raise ConfigError(f"'prune.depths' = {sorted(prune.depths)} prunes every trained depth ({steps_text([s + 1 for s in compared])}): "
                              "nothing would be trained while pruning is active; keep at least one of them")


def _validate_group_size(config: TrainConfig) -> None:
    """A prompt's trained tree needs two leaves: with one, every advantage is 0 and nothing is trained."""
    explore, tree = config.explore, config.tree
    zero = "its advantage is always 0, so nothing would be trained"
    if explore.mode == "off" and tree.roots == 1 and not tree.splits:
        raise ConfigError(f"'tree.roots' = 1 with no 'tree.splits' grows one sample per prompt: {zero}; "
                          "use tree.roots ≥ 2 or add a split (e.g. tree.splits=[[0, 2]])")
    if explore.mode == "tree" and explore.keep == 1:
        raise ConfigError(f"'explore.keep' = 1 with explore.mode=tree keeps one leaf per prompt: {zero}; use explore.keep ≥ 2")
    if explore.mode == "seeds" and explore.keep == 1 and not tree.splits:
        raise ConfigError(f"'explore.keep' = 1 with explore.mode=seeds and no 'tree.splits' keeps one chain per prompt: {zero}; "
                          "use explore.keep ≥ 2 or add a split (e.g. tree.splits=[[0, 2]])")


def validate_ode(config: TrainConfig, steps_family: str) -> None:
    """Deterministic rollouts (`sampling.sde: ode`, DiffusionNFT's setting): chains only, of a flow
    family, for an objective that trains on final samples."""
    if steps_family != "flow":
        raise ConfigError(f"'sampling.sde' = 'ode' samples flow-matching chains; model.family={config.model.family} steps with DDIM: "
                          "use sampling.sde=ddim")
    if not decoupled(config.train.loss):
        on_samples = ", ".join(name for name in OBJECTIVES if decoupled(name))
        raise ConfigError(f"'sampling.sde' = 'ode' samples without noise, so no step has a density for train.loss={config.train.loss} "
                          f"to train: use an objective that trains on final samples ({on_samples}), or an SDE (sampling.sde=flow)")
    if config.tree.splits or config.explore.mode == "tree":
        raise ConfigError("'sampling.sde' = 'ode' grows deterministic chains: the children of a split would be identical; drop "
                          "tree.splits (and explore.mode=tree) or use an SDE (sampling.sde=flow)")
