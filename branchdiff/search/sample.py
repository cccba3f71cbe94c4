"""`branchdiff sample --search`: search each prompt's denoising tree for high-reward images within a
budget of network rows, and write the best images and a JSON trace; `--from-trace` regrows them.

The trace (`search.json`) holds the settings that decide every latent (steps, shift, guidance, SDE
and noise level, rows per forward, noise seed), and per prompt: the rows spent, the best and mean
reward after every round, and its best images with their reward and noise path. `regenerate` regrows
each of them from its path alone (branchdiff/search/forest.py): the same latent, bit for bit, with
the same model and weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from branchdiff.core.engine import NoiseAddress, SamplerSettings
from branchdiff.core.tree import TreeSpec
from branchdiff.models.base import ModelAdapter, PromptEmbeds
from branchdiff.schedulers.schedule import FlowSchedule
from branchdiff.search.cost import Prices
from branchdiff.search.forest import SearchForest, regenerate_path
from branchdiff.search.registry import SEARCHES, make_search
from branchdiff.search.run import SearchResult, run_search

SEARCH_ITERATION = -2  # the noise addresses' iteration field for search (training uses 0.., evaluation -1)


@dataclass(frozen=True)
class SearchSettings:
    search: str  # a name of SEARCHES
    budget: float  # per prompt: network rows (a CFG prediction costs 2), or row-equivalents where a decode or reward call has a cost
    steps: int = 10
    shift: float | None = None  # None: the family's own schedule
    guidance: float | None = None  # None: the family's default
    sde: str | None = None  # None: flow for flow-matching families, ddim for ε-prediction ones
    noise_level: float | None = None  # None: 0.7 (flow) or 1.0 (ddim)
    max_batch: int = 16  # network rows per forward; every forward is padded to it, so paths regrow exactly
    seed: int = 0  # the noise seed
    temperature: float = 10.0  # DTS / DTS*: λ of selection and soft backup
    max_children: int = 4  # DTS / DTS*: children per node
    keep: int = 1  # best images written per prompt
    root_children: int | None = None  # DTS / DTS*: initial noises per prompt (None: max_children)
    widening: float = 0.0  # DTS / DTS*: progressive widening, ⌈widening·√visits⌉ children per node when above the cap (0: off)
    exploration: float = 0.0  # DTS*: c of the visit-count (UCT) bonus on children's values (0: off)
    x0_value: bool = False  # DTS / DTS*: in-flight children valued by the reward of their predicted clean sample
    parallel: int = 1  # selections in flight per prompt (branchdiff/search/run.py); 1: the sequential algorithm
    rollout_depth: int = 0  # DTS / DTS*: early stops, a rollout goes k steps below the node it adds and is valued by r(x̂0) there (0: off)
    decode_cost: float = 0.0  # a budget in cost: one decode in network rows (0 with reward_cost 0: a budget in rows; branchdiff/search/cost.py)
    reward_cost: float = 0.0  # a budget in cost: one reward call in network rows

    @property
    def prices(self) -> Prices:
        return Prices(self.decode_cost, self.reward_cost)

    def validate(self, rows_per_prediction: int = 1, search: bool = True) -> None:
        """Refuse settings no search can run with; `rows_per_prediction`: the network rows of one prediction (2 under CFG);
        `search`: also the search's own refusals (regrowing a trace runs no search)."""
        if self.search not in SEARCHES:
            raise ValueError(f"unknown search {self.search!r}; allowed: {', '.join(SEARCHES)}")
        if (self.root_children is not None and self.root_children < 1 or self.widening < 0 or self.parallel < 1 or self.exploration < 0
                or self.rollout_depth < 0):
            raise ValueError(f"--root-children and --parallel must be ≥ 1, --widening, --exploration and --rollout-depth ≥ 0; got "
                             f"{self.root_children}, {self.parallel}, {self.widening}, {self.exploration} and {self.rollout_depth}")
        if self.budget < 1 or self.steps < 1 or self.max_batch < 1 or self.keep < 1:
            raise ValueError(f"--budget, --steps, --max-batch and --keep must be ≥ 1; got {self.budget}, {self.steps}, {self.max_batch}, {self.keep}")
        if search:  # the search's own checks (dts-is takes no early stops, one selection in flight), before any model loads
            if getattr(search_of(self), "one_selection_in_flight", False) and self.parallel > 1:
                raise ValueError(f"--search {self.search} keeps one selection in flight per prompt (its weights follow each selection to its "
                                 f"leaf): leave --parallel at 1 (got {self.parallel})")
        image = self.prices.cost(self.steps * rows_per_prediction, 1, 1)
        if self.budget < image:
            per = f" ({rows_per_prediction} rows a prediction under CFG)" if rows_per_prediction > 1 else ""
            if not self.prices.evaluation:
                raise ValueError(f"--budget {self.budget:g} network rows cannot make one image: a {self.steps}-step image costs at least "
                                 f"{image:g}{per}; give --budget ≥ {image:g}, or fewer --steps")
            raise ValueError(f"--budget {self.budget:g} cannot make one image: a {self.steps}-step image costs at least {image:g} "
                             f"({self.steps * rows_per_prediction} network rows{per}, a decode and a reward call: {self.prices.evaluation:.3g}); "
                             f"give --budget ≥ {math.ceil(image)}, or fewer --steps")


def sampler(adapter: ModelAdapter, settings: SearchSettings) -> SamplerSettings:
    """The SDE the search steps with: the given one, else the family's kind (flow a = 0.7, DDIM η = 1)."""
    flow = isinstance(adapter.schedule(settings.steps, settings.shift), FlowSchedule)
    sde = settings.sde or ("flow" if flow else "ddim")
    level = settings.noise_level if settings.noise_level is not None else (0.7 if flow else 1.0)
    return SamplerSettings(sde=sde, noise_level=level, max_batch=settings.max_batch, exact=True, guidance=settings.guidance)


def encode_each(adapter: ModelAdapter, prompts: list[str]) -> PromptEmbeds:
    """One encoder call per prompt (an encoder's output depends on its batch size), rows stacked."""
    encoded = [adapter.encode_prompts([prompt]) for prompt in prompts]
    return {key: torch.cat([e[key] for e in encoded]) for key in encoded[0]}


TREE_SEARCHES = ("dts", "dts-star", "dts-is")  # the searches that grow a tree by values, and take DTS_OPTIONS
DTS_OPTIONS = ("temperature", "max_children", "root_children", "widening", "exploration", "x0_value", "rollout_depth")


def search_of(settings: SearchSettings) -> object:
    """The search the settings name, with DTS's options where it takes them. Another search given any of
    them away from its default is refused: it would run as if they were not there."""
    options = {name: getattr(settings, name) for name in DTS_OPTIONS}
    if settings.search in TREE_SEARCHES:
        return make_search(settings.search, **options)
    given = [name for name, value in options.items() if value != SearchSettings.__dataclass_fields__[name].default]
    if given:
        flags = ", ".join(f"--{name.replace('_', '-')}" + ("" if options[name] is True else f" {options[name]}") for name in given)
        raise ValueError(f"--search {settings.search} does not use {flags}: these set how {', '.join(TREE_SEARCHES)} grow their trees; "
                         f"leave them out, or choose one of those searches")
    return make_search(settings.search)


def new_forest(adapter: ModelAdapter, prompts: list[str], settings: SearchSettings) -> SearchForest:
    """An empty forest for the prompts (each keyed by its position) under the settings' steps, schedule, SDE and noise seed."""
    return SearchForest(adapter, TreeSpec(settings.steps), adapter.schedule(settings.steps, settings.shift), sampler(adapter, settings),
                        NoiseAddress(settings.seed, SEARCH_ITERATION, tuple(range(len(prompts)))), encode_each(adapter, prompts))


@torch.no_grad()
def search_prompts(adapter: ModelAdapter, prompts: list[str], settings: SearchSettings, score,
                   first_round: bool = False) -> tuple[SearchForest, SearchResult]:
    """Search every prompt (its key: its position) within the budget; `score(images, prompt indices) → (L,)`.
    `first_round`: refuse a budget that cannot pay for a prompt's first round (`sample --search`; a benchmark's
    grid of budgets may hold some that leave a search without images)."""
    settings.validate()
    forest = new_forest(adapter, prompts, settings)
    search = search_of(settings)
    branching = search.branching(forest)
    images = math.prod(branching) if branching else 1  # a prompt's first round: its whole path (or fixed tree) from the virtual root
    first = settings.prices.cost(forest.cost_of_child(0, branching), images, images)
    if first_round and settings.budget < first:
        unit, priced = (" network rows", "") if not settings.prices.evaluation else ("", ", with its decodes and reward calls")
        raise ValueError(f"--budget {settings.budget:g}{unit} cannot make one image: a prompt's first {settings.search} round costs {first:g} "
                         f"({forest.rows_per_node()} row(s) per prediction{priced}); give --budget ≥ {math.ceil(first)}")
    return forest, run_search(forest, search, settings.budget, score, settings.seed, settings.parallel, settings.prices)


def trace(forest: SearchForest, result: SearchResult, prompts: list[str], settings: SearchSettings, extras: dict) -> dict:
    """The JSON trace (module doc); `extras` (model, weights, reward) is recorded as given."""
    def entry(p: int, leaf: int) -> dict:
        index = result.leaves[p].index(leaf)
        return {"path": list(forest.path[leaf]), "reward": result.rewards[p][index], "scores": result.extras[p][index]}

    best = [[entry(p, n) for n in result.best(p, settings.keep)] for p in range(len(prompts))]
    return {**extras, "settings": asdict(settings), "iteration": SEARCH_ITERATION,
            "prompts": [{"prompt": prompt, "prompt_key": p, "nfe": forest.nfe[p], "decodes": forest.decodes[p], "reward_calls": forest.reward_calls[p],
                         "cost": forest.spent(p, settings.prices), "rounds": result.trace[p], "best": best[p]}
                        for p, prompt in enumerate(prompts)]}


@torch.no_grad()
def regenerate(adapter: ModelAdapter, recorded: dict) -> list[tuple[str, torch.Tensor, dict]]:
    """Every best image of a trace regrown from its path: (prompt, latent, its entry), in order."""
    settings = SearchSettings(**recorded["settings"])
    spec, schedule = TreeSpec(settings.steps), adapter.schedule(settings.steps, settings.shift)
    out = []
    for entry in recorded["prompts"]:
        embeds = encode_each(adapter, [entry["prompt"]])
        for best in entry["best"]:
            latent = regenerate_path(adapter, spec, schedule, sampler(adapter, settings), settings.seed, recorded["iteration"],
                                     entry["prompt_key"], embeds, tuple(best["path"]))
            out.append((entry["prompt"], latent, best))
    return out


def read_trace(path: Path) -> dict:
    """A trace written by `sample --search`, with a one-line error when it is not one."""
    try:
        recorded = json.loads(Path(path).read_text())
        # the settings that decide the latents; not the search's own checks: a trace written before one existed (a DTS
        # option recorded beside best-of-n, which ignored it) still regrows
        SearchSettings(**recorded["settings"]).validate(search=False)
        if not all({"prompt", "prompt_key", "best"} <= set(entry) and all({"path", "image"} <= set(b) for b in entry["best"])
                   for entry in recorded["prompts"]):
            raise KeyError("prompts")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--from-trace {path}: not a search trace written by 'branchdiff sample --search' ({type(error).__name__}: {error})") from None
    return recorded
