"""Inference-time search (branchdiff/search/): the backup rules on a hand-made tree, the forest's
fixed trees equal to a training rollout of the same tree, the network rows it counts, winners that
regrow bit for bit from their noise paths, searches that beat random sampling at the same budget on
a reward whose optimum is known, and `branchdiff sample --search` / `--from-trace` end to end.
(Every family's tiny pipeline: tests/test_model_families.py; a preference reward:
tests/test_preference_rewards.py.)"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from branchdiff.core.engine import NoiseAddress, SamplerSettings
from branchdiff.core.rollout import grow
from branchdiff.core.tree import Split, TreeSpec, build_tree
from branchdiff.search.backup import aggregate, backup_path
from branchdiff.search.fixed_tree import FixedTree
from branchdiff.search.forest import SearchForest, regenerate_path
from branchdiff.search.registry import SEARCHES, make_search
from branchdiff.search.run import prompt_generators, run_search
from branchdiff.search.sample import SEARCH_ITERATION, SearchSettings, encode_each, search_prompts

PROMPTS = ["two red circles on the left", "one blue square at the top", "three green triangles at the bottom"]
STEPS = 4

# node 0: root; 1, 2: its children A and B; 3, 4: A's leaves (rewards 1 and 3); 5: B's leaf (reward 2)
PARENT = [-1, 0, 0, 1, 1, 2]
CHILDREN = [[1, 2], [3, 4], [5], [], [], []]
LEAF_REWARDS = {3: 1.0, 4: 3.0, 5: 2.0}


def _backed_up(rule: str, temperature: float = 1.0, leaves=(3, 4, 5)) -> list[float]:
    value = [math.nan] * 6
    for leaf in leaves:
        value[leaf] = LEAF_REWARDS[leaf]
        assert backup_path(PARENT, CHILDREN, value, leaf, rule, temperature) == [leaf, PARENT[leaf], 0]
    return value


def test_backups_on_a_hand_made_tree():
    """mean: A = 2, B = 2, root = 2; max: A = 3, root = 3; soft (λ = 1): A = ln((e + e³)/2) =
    2.43378083048, root = ln((e^A + e²)/2) = 2.24022901392; soft (λ = 2): A = ln((e² + e⁶)/2)/2 =
    2.66250137368. Before B's leaf arrives, the root's value is A's alone."""
    assert _backed_up("mean")[:3] == pytest.approx([2.0, 2.0, 2.0], abs=1e-12)
    assert _backed_up("max")[:3] == [3.0, 3.0, 2.0]
    assert _backed_up("soft", 1.0)[:3] == pytest.approx([2.24022901392, 2.43378083048, 2.0], abs=1e-10)
    assert _backed_up("soft", 2.0)[1] == pytest.approx(2.66250137368, abs=1e-10)
    partial = _backed_up("soft", 1.0, leaves=(3, 4))
    assert math.isnan(partial[2]) and partial[0] == partial[1] == pytest.approx(2.43378083048, abs=1e-10)


def test_the_soft_backup_runs_from_the_mean_to_the_max_and_refuses_a_bad_rule():
    values = torch.tensor([0.1, 0.5, 0.3])
    assert aggregate(values, "soft", 1e-6) == pytest.approx(0.3, abs=1e-6)
    assert aggregate(values, "soft", 1e4) == pytest.approx(0.5, abs=1e-3)
    assert aggregate(torch.tensor([1e3, 1e3]), "soft", 10.0) == pytest.approx(1e3)  # no overflow at λ·v = 1e4
    with pytest.raises(ValueError, match="unknown backup 'median'"):
        aggregate(values, "median")
    with pytest.raises(ValueError, match="temperature λ > 0"):
        aggregate(values, "soft", 0.0)


FLOW_SETTINGS = SamplerSettings(sde="flow", noise_level=0.7, max_batch=8)


def _forest(adapter, settings=FLOW_SETTINGS, seed=5) -> SearchForest:
    return SearchForest(adapter, TreeSpec(STEPS), adapter.schedule(STEPS), settings, NoiseAddress(seed, SEARCH_ITERATION, (0, 1, 2)),
                        encode_each(adapter, PROMPTS))


def _brightness(images: torch.Tensor, prompt_index: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A reward whose optimum is known (a white image scores 1): the mean of the pixels; and the red channel's."""
    return images.mean(dim=(1, 2, 3)), {"red": images[:, 0].mean(dim=(1, 2))}


def test_a_fixed_tree_in_the_forest_is_the_training_rollout_of_that_tree(tiny_adapter):
    """One round of the fixed-tree search grows, for each prompt, the tree a training rollout grows
    from the same addresses: the same leaves bit for bit, and one network row per inner node."""
    search = FixedTree(splits=(Split(0, 2), Split(2, 2)))
    forest = _forest(tiny_adapter)
    per_tree = forest.cost_of_child(0, search.branching(forest))
    result = run_search(forest, search, per_tree, _brightness)
    spec = TreeSpec(STEPS, splits=search.splits)
    assert per_tree == spec.rollout_nfe and forest.nfe == [per_tree] * 3
    rollout = grow(tiny_adapter, build_tree(spec, 3), encode_each(tiny_adapter, PROMPTS), tiny_adapter.schedule(STEPS),
                   SamplerSettings(sde="flow", noise_level=0.7, max_batch=8, exact=True), forest.address)
    tree = rollout.tree
    where = {(int(tree.prompt[n]), tree.paths[n]): n for n in tree.leaf_index.tolist()}
    for p in range(3):
        assert len(result.leaves[p]) == spec.leaves
        for leaf in result.leaves[p]:
            assert torch.equal(forest.latent[leaf], rollout.latents[where[(p, forest.path[leaf])]])


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_every_search_stays_in_budget_counts_its_rows_and_its_winner_regrows_exactly(tiny_adapter, name):
    """Rows charged = one per node whose output was computed (counted apart from the charge), within
    the budget; the best leaf regrown alone from its path is the same latent, bit for bit."""
    forest = _forest(tiny_adapter)
    budget = 7 * STEPS
    result = run_search(forest, make_search(name), budget, _brightness, seed=1)
    for p in range(3):
        computed = sum(1 for n in range(len(forest.parent)) if forest.prompt[n] == p and forest.output[n] is not None)
        assert forest.nfe[p] == computed <= budget and result.trace[p][-1]["nfe"] == forest.nfe[p]
        per_round = 8 if name == "tree" else 1  # the fixed tree's 8 leaves, else one roll-out
        assert [r["images"] for r in result.trace[p]] == [per_round * k for k in range(1, len(result.trace[p]) + 1)]
        best = result.best(p)[0]
        assert result.trace[p][-1]["best"] == max(result.rewards[p]) == forest.value[best]
        again = regenerate_path(tiny_adapter, forest.spec, forest.schedule, forest.settings, 5, SEARCH_ITERATION, p,
                                encode_each(tiny_adapter, [PROMPTS[p]]), forest.path[best])
        assert torch.equal(again, forest.latent[best]) and len(forest.path[best]) == STEPS + 1


@pytest.mark.parametrize("name", ["dts", "dts-star", "best-of-n"])
def test_one_selection_in_flight_is_the_sequential_search_image_for_image(tiny_adapter, name):
    """The continuously batched loop with one selection in flight per prompt (three prompts sharing forwards of 8 rows)
    against each prompt searched alone by the plain sequential algorithm (select, one child, roll out, score, back up),
    written out here: the same images in the same order, bit for bit, the same rewards and rows."""
    budget = 9 * STEPS
    batched = _forest(tiny_adapter)
    result = run_search(batched, make_search(name, max_children=2) if name != "best-of-n" else make_search(name), budget, _brightness, seed=4)
    for p in range(3):
        alone, search = _forest(tiny_adapter), make_search(name, max_children=2) if name != "best-of-n" else make_search(name)
        generator, latents, rewards = prompt_generators(4, 3)[p], [], []
        while (node := search.select(alone, p, generator)) is not None and alone.nfe[p] + alone.cost_of_child(node) <= budget:
            leaf = alone.add_children([node])[0]
            while alone.depth[leaf] < STEPS:
                leaf = alone.add_children([leaf])[0]
            alone.value[leaf] = float(_brightness(tiny_adapter.decode(alone.latent[leaf][None]), [p])[0][0])
            backup_path(alone.parent, alone.children, alone.value, leaf, search.backup, search.temperature)
            latents.append(alone.latent[leaf])
            rewards.append(alone.value[leaf])
        assert len(latents) == len(result.leaves[p]) > 4 and batched.nfe[p] == alone.nfe[p]
        assert all(torch.equal(a, batched.latent[leaf]) for a, leaf in zip(latents, result.leaves[p]))
        assert rewards == result.rewards[p]


def test_selections_in_flight_fill_the_forwards_and_respect_every_cap(tiny_adapter):
    """Four selections in flight per prompt (12 rollouts for forwards of 8 rows): at least 90% of the rows computed are
    real, every prompt within its budget; the pending children keep every node within its cap (without them the four
    first selections would all add an initial noise under a virtual root capped at 3)."""
    forest = _forest(tiny_adapter)
    result = run_search(forest, make_search("dts-star", max_children=3), 12 * STEPS, _brightness, parallel=4)
    assert sum(forest.nfe) / forest.rows_computed >= 0.9 and forest.forwards * 8 == forest.rows_computed
    assert all(n <= 12 * STEPS for n in forest.nfe) and all(len(result.leaves[p]) >= 12 for p in range(3))
    assert max(len(children) for children in forest.children) <= 3 and all(len(forest.children[p]) == 3 for p in range(3))
    assert forest.pending == [0] * len(forest.parent) and forest.inflight == [0] * len(forest.parent)
    for cap, parallel in ((1, 2), (2, 4)):  # a rollout in flight will add a child where it stands: that child counts too
        crowded = _forest(tiny_adapter)
        run_search(crowded, make_search("dts-star", max_children=cap), 40 * STEPS, _brightness, parallel=parallel)
        assert max(len(children) for children in crowded.children) <= cap and crowded.pending == [0] * len(crowded.parent)
    sequential = _forest(tiny_adapter)
    run_search(sequential, make_search("dts-star", max_children=3), 12 * STEPS, _brightness)
    assert sum(sequential.nfe) / sequential.rows_computed < 0.5  # one rollout per prompt: 3 rows of 8 at best


def test_x0_value_scores_every_predicted_node_and_values_the_children_in_flight(tiny_adapter):
    """With x0_value every node a forward predicts gets the reward of its predicted clean sample (checked against
    decode(x − σ·v) scored here) at no network row; a child whose image is in flight is then worth that estimate:
    DTS* picks the one estimated 0.9 over 0.1, where without it both are worth their parent's value (the first wins)."""
    forest = _forest(tiny_adapter)
    run_search(forest, make_search("dts-star", max_children=3, x0_value=True), 8 * STEPS, _brightness, parallel=3)
    predicted = [n for n in range(len(forest.parent)) if forest.output[n] is not None]
    assert predicted and sum(forest.nfe) == len(predicted) * forest.rows_per_node()
    for node in predicted[:: max(1, len(predicted) // 10)]:
        sigma = forest.schedule.sigmas[forest.depth[node]]
        clean = tiny_adapter.decode((forest.latent[node] - sigma * forest.output[node])[None])
        assert forest.estimate[node] == pytest.approx(float(_brightness(clean, [0])[0][0]), abs=1e-6)
    for x0_value, expected in ((True, 1), (False, 0)):
        forest = _forest(tiny_adapter)
        children = forest.add_children([0, 0])
        forest.estimate[children[0]], forest.estimate[children[1]] = 0.1, 0.9
        forest.reserve(children[0], 1, child=False)
        forest.reserve(children[1], 1, child=False)
        assert make_search("dts-star", max_children=2, x0_value=x0_value).select(forest, 0, torch.Generator()) == children[expected]


def test_dts_star_branches_below_its_best_root_once_the_virtual_root_is_full(tiny_adapter):
    forest = _forest(tiny_adapter)
    search = make_search("dts-star", max_children=2)
    budget = 2 * STEPS + (STEPS - 1)  # two roll-outs from new noise, then a new child of a root's kept output: its roll-out only
    result = run_search(forest, search, budget, _brightness)
    for p in range(3):
        roots = forest.children[p]
        assert len(roots) == 2  # the virtual root's cap
        assert sorted(len(forest.children[r]) for r in roots) == [1, 2] and forest.nfe[p] == budget
        first_two = result.rewards[p][:2]
        branched = next(r for r in roots if len(forest.children[r]) == 2)
        assert forest.path[branched] == ((0,), (1,))[first_two.index(max(first_two))]  # greedy: below the better root


def test_searches_beat_random_samples_at_the_same_budget(tiny_adapter):
    """Brightness on the tiny model, 12 prompts' searches (seeds): every search's best image is
    brighter than the mean random SDE sample of the same prompts, by more than 3 standard errors."""
    prompts = [f"{count} {colour} circles on the left" for count in ("one", "two", "three") for colour in ("red", "green", "blue", "yellow")]
    embeds = encode_each(tiny_adapter, prompts)
    settings = SamplerSettings(sde="flow", noise_level=0.7, max_batch=16)

    def forest() -> SearchForest:
        return SearchForest(tiny_adapter, TreeSpec(STEPS), tiny_adapter.schedule(STEPS), settings,
                            NoiseAddress(9, SEARCH_ITERATION, tuple(range(len(prompts)))), embeds)

    random_samples = run_search(forest(), make_search("best-of-n"), STEPS, _brightness).rewards  # one image each
    random_mean = statistics.mean(r[0] for r in random_samples)
    for name in SEARCHES:
        found = run_search(forest(), make_search(name), 6 * STEPS, _brightness).rewards
        gains = [max(r) - random_mean for r in found]
        assert statistics.mean(gains) > 3 * statistics.stdev(gains) / math.sqrt(len(gains)), (name, gains)


def test_search_prompts_validates_its_settings(tiny_adapter):
    with pytest.raises(ValueError, match="unknown search 'beam'; allowed: best-of-n, tree, dts, dts-star"):
        search_prompts(tiny_adapter, PROMPTS, SearchSettings("beam", 10), None)
    with pytest.raises(ValueError, match="must be ≥ 1"):
        search_prompts(tiny_adapter, PROMPTS, SearchSettings("dts", 0), None)


def test_sample_search_writes_the_best_images_and_a_trace_that_regrows_them(tiny_model_dir, tmp_path, capsys):
    from branchdiff.cli import main

    model = ["--model", str(tiny_model_dir), "--steps", str(STEPS)]
    out = tmp_path / "search"
    assert main(["sample", *model, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--search", "dts-star", "--budget", str(5 * STEPS),
                 "--keep", "2", "--max-children", "2", "--root-children", "3", "--exploration", "0.1", "--parallel", "2", "--out", str(out)]) == 0
    recorded = json.loads((out / "search.json").read_text())
    assert recorded["settings"]["search"] == "dts-star" and [e["prompt"] for e in recorded["prompts"]] == PROMPTS[:2]
    assert {key: recorded["settings"][key] for key in ("root_children", "exploration", "parallel")} == {"root_children": 3, "exploration": 0.1, "parallel": 2}
    for entry in recorded["prompts"]:
        assert entry["nfe"] <= 5 * STEPS and entry["rounds"][-1]["nfe"] == entry["nfe"]
        assert [b["reward"] for b in entry["best"]] == sorted((b["reward"] for b in entry["best"]), reverse=True) and len(entry["best"]) == 2
        assert entry["best"][0]["reward"] == entry["rounds"][-1]["best"] and "tiny-geneval.strict" in entry["best"][0]["scores"]
    written = {b["image"]: (out / b["image"]).read_bytes() for e in recorded["prompts"] for b in e["best"]}
    assert len(written) == 4
    regrown = tmp_path / "regrown"
    assert main(["sample", *model, "--from-trace", str(out / "search.json"), "--out", str(regrown)]) == 0
    assert {name: (regrown / name).read_bytes() for name in written} == written
    assert "best tiny-geneval" in capsys.readouterr().err


def test_sample_search_with_early_stops_records_them_and_regrows_its_images(tiny_model_dir, tmp_path):
    """`--rollout-depth 3`: the trace records it, the kept images are finished ones, and their paths regrow them bit for bit."""
    from branchdiff.cli import main

    model = ["--model", str(tiny_model_dir), "--steps", str(STEPS)]
    out = tmp_path / "stopped"
    assert main(["sample", *model, "--prompt", PROMPTS[0], "--search", "dts-star", "--budget", str(6 * STEPS), "--max-children", "2",
                 "--rollout-depth", "3", "--keep", "2", "--out", str(out)]) == 0
    recorded = json.loads((out / "search.json").read_text())
    assert recorded["settings"]["rollout_depth"] == 3 and all(len(b["path"]) == STEPS + 1 for b in recorded["prompts"][0]["best"])
    written = {b["image"]: (out / b["image"]).read_bytes() for b in recorded["prompts"][0]["best"]}
    assert main(["sample", *model, "--from-trace", str(out / "search.json"), "--out", str(tmp_path / "regrown")]) == 0
    assert {name: (tmp_path / "regrown" / name).read_bytes() for name in written} == written


def test_a_search_whose_early_stops_finish_no_image_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    """Regression: `--rollout-depth 3` on 30 rows (the four first rounds stop early, none reaches an image) ended in an
    IndexError traceback after the search; it is one line naming the prompt and the fix, exit 2, nothing written."""
    from branchdiff.cli import main

    out = tmp_path / "none"
    assert main(["sample", "--model", str(tiny_model_dir), "--steps", str(STEPS), "--prompt", PROMPTS[0], "--search", "dts-star",
                 "--budget", str(3 * STEPS), "--rollout-depth", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--rollout-depth 1: the search finished no image of {PROMPTS[0]!r} within --budget {3 * STEPS}" in err[0]
    assert not out.exists()


def test_keeping_more_images_than_the_search_made_says_how_many_it_wrote(tiny_model_dir, tmp_path, capsys):
    """`--keep 100` wrote the few images a small budget makes without a word: a note names how many there were."""
    from branchdiff.cli import main

    out = tmp_path / "kept"
    assert main(["sample", "--model", str(tiny_model_dir), "--steps", str(STEPS), "--prompt", PROMPTS[0], "--search", "best-of-n",
                 "--budget", str(3 * STEPS), "--keep", "100", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == [f"00{i}-{PROMPTS[0].replace(' ', '_')}.png" for i in range(3)]
    assert f"note: --keep 100: the search made 3 images of {PROMPTS[0]!r}; all are written" in capsys.readouterr().err


def test_a_trace_recording_an_option_its_search_ignored_still_regrows(tiny_model_dir, tmp_path):
    """Before DTS's options were refused on other searches, `--search best-of-n --widening 0.5` ran (ignoring it) and
    recorded it in the trace: such a trace regrows its images, as regrowing runs no search."""
    from branchdiff.cli import main

    model = ["--model", str(tiny_model_dir), "--steps", str(STEPS)]
    out = tmp_path / "old"
    assert main(["sample", *model, "--prompt", PROMPTS[0], "--search", "best-of-n", "--budget", str(2 * STEPS), "--out", str(out)]) == 0
    recorded = json.loads((out / "search.json").read_text())
    recorded["settings"]["widening"] = 0.5
    (out / "search.json").write_text(json.dumps(recorded))
    written = {b["image"]: (out / b["image"]).read_bytes() for b in recorded["prompts"][0]["best"]}
    assert main(["sample", *model, "--from-trace", str(out / "search.json"), "--out", str(tmp_path / "regrown")]) == 0
    assert {name: (tmp_path / "regrown" / name).read_bytes() for name in written} == written


def test_sample_search_without_a_budget_or_with_a_bad_trace_is_one_line(tiny_model_dir, tmp_path, capsys):
    from branchdiff.cli import main

    assert main(["sample", "--model", str(tiny_model_dir), "--prompt", "a red circle", "--search", "dts", "--out", str(tmp_path / "a")]) == 2
    assert "--search dts needs --budget" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["sample", "--model", str(tiny_model_dir), "--from-trace", str(tmp_path / "bad.json"), "--out", str(tmp_path / "b")]) == 2
    assert "not a search trace written by 'branchdiff sample --search'" in capsys.readouterr().err


def test_a_budget_below_one_image_is_refused_in_one_line(tiny_model_dir, tiny_adapter, tmp_path, capsys):
    """`sample --search dts --budget 5` ended in an IndexError traceback: no prompt finished an image. Below the
    steps it is refused before the model loads; below a prompt's first round (a fixed tree's, or CFG's two rows)
    before anything runs (the tree search's binary 4-step tree: 1 + 2 + 4 + 8 = 15 rows)."""
    from branchdiff.cli import main

    assert main(["sample", "--model", str(tiny_model_dir), "--prompt", PROMPTS[0], "--search", "dts", "--budget", "5", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget 5 network rows cannot make one image: a 10-step image costs at least 10" in err
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match=r"--budget 5 network rows cannot make one image: a prompt's first tree round costs 15 .*--budget ≥ 15"):
        search_prompts(tiny_adapter, PROMPTS, SearchSettings("tree", 5, steps=STEPS), _brightness, first_round=True)


@pytest.mark.parametrize("name", ["dts", "dts-star", "best-of-n"])
def test_non_finite_rewards_never_stop_a_search_and_are_reported(tiny_adapter, name):
    """DTS drew its next child from softmax(λ·v) over children whose values were all −inf (every reward NaN)
    and raised; now a non-finite reward is the worst value, children with nothing else are drawn uniformly,
    and the trace counts them. Half the prompts' images score NaN here, one prompt's all of them."""
    calls = []

    def sometimes_nan(images: torch.Tensor, prompt_index: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        calls.append(len(prompt_index))
        rewards = images.mean(dim=(1, 2, 3))
        nan = torch.tensor([p == 0 or (p == 1 and len(calls) % 2 == 0) for p in prompt_index])
        return torch.where(nan, torch.full_like(rewards, math.nan), rewards), {}

    search = make_search(name, **({"temperature": 10.0, "max_children": 2} if name.startswith("dts") else {}))
    result = run_search(_forest(tiny_adapter), search, 8 * STEPS, sometimes_nan)
    assert all(reward == -math.inf for reward in result.rewards[0]) and result.trace[0][-1]["best"] == -math.inf
    assert result.trace[0][-1]["nonfinite"] == result.trace[0][-1]["images"] >= 2
    assert 0 < result.trace[1][-1]["nonfinite"] < result.trace[1][-1]["images"] and math.isfinite(result.trace[1][-1]["mean"])
    assert result.trace[2][-1]["nonfinite"] == 0 and all(math.isfinite(r) for r in result.rewards[2])


def test_explore_search_refuses_a_budget_below_one_image():
    from branchdiff.errors import ConfigError
    from branchdiff.settings.load import load_config

    with pytest.raises(ConfigError, match=r"'explore.search_budget' = 5 network rows cannot make one image: a 10-step image costs at least 10"):
        load_config("tiny-sol", ["explore.mode=search", "explore.search_budget=5", "sampling.sde=flow", "sampling.num_steps=10"])


def test_early_stopped_rollouts_are_valued_by_their_predicted_clean_sample_and_stay_in_budget(tiny_adapter):
    """DTS* with rollouts of at most 2 steps below the node they add (`rollout_depth`): every node where a rollout stopped
    and that has no child yet holds the reward of its predicted clean sample; each prompt spends within its budget one row
    per node predicted; the tree still reaches images, and the result lists only them."""
    forest = _forest(tiny_adapter)
    budget = 12 * STEPS
    result = run_search(forest, make_search("dts-star", rollout_depth=2), budget, _brightness, seed=1)
    stops = [n for n in range(len(forest.parent)) if 0 <= forest.depth[n] < STEPS and not forest.children[n]]
    assert stops and all(forest.output[n] is not None for n in stops)
    expected, _ = _brightness(tiny_adapter.decode(forest.predicted_x0(stops)), [forest.prompt[n] for n in stops])
    assert torch.allclose(torch.tensor([forest.value[n] for n in stops], dtype=torch.float64), expected.double(), atol=1e-6)
    for p in range(3):
        computed = sum(1 for n in range(len(forest.parent)) if forest.prompt[n] == p and forest.output[n] is not None)
        assert forest.nfe[p] == computed <= budget
        assert result.leaves[p] and all(forest.depth[leaf] == STEPS for leaf in result.leaves[p])
        assert result.trace[p][-1]["best"] == max(result.rewards[p])
    with pytest.raises(ValueError, match="rollout_depth ≥ 0"):
        make_search("dts", rollout_depth=-1)


def test_an_early_stop_leaves_no_phantom_child_and_the_search_spends_its_budget(tiny_adapter):
    """Regression: a node where a rollout stopped early kept the child its rollout was to add counted as pending, so it
    looked fuller than it was and, once its real children were spent, made every selection wait: searches ended far
    under their budget (the mixture task's DTS* at k = 3 spent 194 of 640 rows). After the search no node has a pending
    child, and every prompt spends its budget but less than a rollout's rows."""
    forest = _forest(tiny_adapter)
    budget = 40 * STEPS
    run_search(forest, make_search("dts-star", rollout_depth=2), budget, _brightness, seed=1)
    assert not any(forest.pending) and not any(forest.inflight)
    assert all(budget - STEPS < forest.nfe[p] <= budget for p in range(forest.num_prompts))


def _counting(calls: list[int]):
    """_brightness, counting per prompt the samples it scores."""
    def score(images: torch.Tensor, prompt_index: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for p in prompt_index:
            calls[p] += 1
        return _brightness(images, prompt_index)
    return score


@pytest.mark.parametrize("name, options", [("best-of-n", {}), ("tree", {}), ("dts-star", {"rollout_depth": 2}), ("dts", {"x0_value": True})])
def test_decodes_and_reward_calls_are_the_samples_scored(tiny_adapter, name, options):
    """Each prompt's decodes and reward calls equal the samples its score was called on (counted apart): its images plus
    one x̂0 per node valued by its x̂0 (an early stop, or with x0_value every predicted node), each scored once."""
    forest, calls = _forest(tiny_adapter), [0, 0, 0]
    result = run_search(forest, make_search(name, **options), 9 * STEPS, _counting(calls), seed=1)
    for p in range(3):
        nodes = [n for n in range(len(forest.parent)) if forest.prompt[n] == p]
        valued = [n for n in nodes if not math.isnan(forest.estimate[n])]  # the nodes whose x̂0 was scored
        stops = [n for n in nodes if 0 <= forest.depth[n] < STEPS and not forest.children[n]]
        if options.get("x0_value"):
            assert valued == [n for n in nodes if forest.output[n] is not None]
        elif options.get("rollout_depth"):
            assert set(stops) <= set(valued)
        else:
            assert not valued
        assert forest.decodes[p] == forest.reward_calls[p] == calls[p] == len(result.leaves[p]) + len(valued)
        assert result.trace[p][-1]["reward_calls"] == calls[p] and result.trace[p][-1]["decodes"] == calls[p]
    assert calls[0] > len(result.leaves[0]) or not options


@pytest.mark.parametrize("name, options", [("best-of-n", {}), ("dts-star", {"rollout_depth": 2}), ("dts", {"x0_value": True}), ("tree", {})])
def test_a_budget_in_cost_counts_decodes_and_reward_calls_and_is_never_passed(tiny_adapter, name, options):
    """With a decode priced at 3 rows and a reward call at 5, every prompt's rows + 3·decodes + 5·calls stays within the
    budget; best-of-N spends it to within one image's cost (4 rows + 8) and makes budget // 12 images."""
    from branchdiff.search.cost import Prices

    prices, budget = Prices(decode=3.0, reward=5.0), 10 * (STEPS + 8) + 5
    forest = _forest(tiny_adapter)
    result = run_search(forest, make_search(name, **options), budget, _brightness, seed=1, prices=prices)
    for p in range(3):
        spent = forest.nfe[p] + 3 * forest.decodes[p] + 5 * forest.reward_calls[p]
        assert spent == forest.spent(p, prices) <= budget and (result.leaves[p] or options.get("rollout_depth"))  # early stops may take it all
        if name == "best-of-n":
            assert len(result.leaves[p]) == 10 and forest.nfe[p] == 10 * STEPS and budget - (STEPS + 8) < spent
    with pytest.raises(ValueError, match="must be ≥ 0"):
        Prices(decode=-1.0)


def test_sample_search_takes_a_budget_in_cost_and_refuses_prices_without_it(tiny_model_dir, tmp_path, capsys):
    """`--budget-unit cost --reward-cost 2`: each prompt spends rows + 2·calls within the budget (the tiny model decodes in
    pixel space: the plan counts a decode at 0), recorded in the trace; a price without a budget in cost, a reward the
    plan does not count without --reward-cost, and a budget below one priced image are each one line before any search."""
    from branchdiff.cli import main

    model = ["--model", str(tiny_model_dir), "--steps", str(STEPS)]
    out = tmp_path / "cost"
    assert main(["sample", *model, "--prompt", PROMPTS[0], "--search", "dts-star", "--rollout-depth", "2", "--budget", "60", "--budget-unit", "cost",
                 "--reward-cost", "2", "--out", str(out)]) == 0
    entry = json.loads((out / "search.json").read_text())["prompts"][0]
    assert entry["cost"] == entry["nfe"] + 2 * entry["reward_calls"] <= 60 and entry["decodes"] == entry["reward_calls"] > 0
    captured = capsys.readouterr()
    assert "budget in cost: a decode is 0 network rows, a reward call 2 (given" in captured.out and "a cost of" in captured.err
    for extra, line in ((["--reward-cost", "2"], "--reward-cost prices a budget in cost: add --budget-unit cost, or leave --reward-cost out"),
                        (["--budget-unit", "cost", "--reward", "tests.nosuch.Reward"], "needs the price of reward 'tests.nosuch.Reward', which `branchdiff plan` does not count"),
                        (["--budget-unit", "cost", "--reward-cost", "2", "--budget", "5"],
                         "--budget 5 cannot make one image: a 4-step image costs at least 6 (4 network rows, a decode and a reward call: 2)")):
        args = ["sample", *model, "--prompt", PROMPTS[0], "--search", "dts", "--budget", "40", "--out", str(tmp_path / "x"), *extra]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and line in err and not (tmp_path / "x").exists()
