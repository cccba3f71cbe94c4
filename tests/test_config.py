"""Run configuration: defaults, presets, dotted overrides, one-line errors with file:line, round trip."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from branchdiff.core.prune import mix_sde_steps
from branchdiff.errors import ConfigError
from branchdiff.settings.config import OptimConfig, TrainConfig, TreeConfig
from branchdiff.settings.load import load_config, presets, save_config
from branchdiff.settings.trees import trainable_steps, tree_spec
from branchdiff.settings.typed_yaml import parse_override
from branchdiff.settings.validate import validate


def config_error(source=None, overrides=()) -> str:
    """The message of the ConfigError raised by load_config; it must be a single line."""
    with pytest.raises(ConfigError) as caught:
        load_config(source, list(overrides))
    message = str(caught.value)
    assert "\n" not in message and message.strip() == message and message
    return message


# ---------------------------------------------------------------- defaults and presets
def test_defaults_are_the_dataclass_defaults():
    config = load_config()
    assert isinstance(config, TrainConfig)
    assert config == TrainConfig()
    assert (config.output_dir, config.iterations, config.seed) == ("runs/tiny", 60, 0)
    assert config.tree == TreeConfig() and config.tree.splits == [] and config.model.path is None
    assert config.sampling.sde == "flow" and config.train.learning_rate == 1e-3


def test_presets_are_listed():
    assert "tiny-chain" in presets()
    assert presets() == sorted(presets())


@pytest.mark.parametrize("name", presets())
def test_every_packaged_preset_loads(name):
    config = load_config(name)
    assert isinstance(config, TrainConfig)
    validate(config)  # idempotent on a loaded config


def test_tiny_chain_preset_values():
    config = load_config("tiny-chain")
    assert config.output_dir == "runs/tiny-chain"
    assert config.train.learning_rate == 3e-5 and isinstance(config.train.learning_rate, float)
    assert config.model.finetune == "full" and config.train.optimizer_every == 160
    assert config.tree.roots == 16 and config.prompts.per_iteration == 4 and config.sampling.sde == "flow"


# ---------------------------------------------------------------- overrides
@pytest.mark.parametrize(
    "override, get, expected, kind",
    [
        ("tree.roots=4", lambda c: c.tree.roots, 4, int),
        ("train.learning_rate=1e-4", lambda c: c.train.learning_rate, 1e-4, float),
        ("train.learning_rate=1.0e-4", lambda c: c.train.learning_rate, 1e-4, float),
        ("train.learning_rate=2E-3", lambda c: c.train.learning_rate, 2e-3, float),
        ("tree.splits=[[0,2],[3,2]]", lambda c: c.tree.splits, [[0, 2], [3, 2]], list),
        ("tree.splits=[[0, 2, {noise_level: 0.5}]]", lambda c: c.tree.splits, [[0, 2, {"noise_level": 0.5}]], list),
        ("model.path=null", lambda c: c.model.path, None, type(None)),
        ("model.path=/some/dir", lambda c: c.model.path, "/some/dir", str),
        ("logging.report_to=none", lambda c: c.logging.report_to, "none", str),
        ("logging.report_to=[tensorboard,wandb]", lambda c: c.logging.report_to, ["tensorboard", "wandb"], list),
        ("prune.depths=[1,2]", lambda c: c.prune.depths, [1, 2], list),
        ("sampling.sde=dance", lambda c: c.sampling.sde, "dance", str),
        ("output_dir=runs/x", lambda c: c.output_dir, "runs/x", str),
        ("seed=3", lambda c: c.seed, 3, int),
    ],
)
def test_override_sets_nested_value_with_yaml_typing(override, get, expected, kind):
    value = get(load_config(None, [override]))
    assert value == expected and type(value) is kind


def test_override_leaves_the_other_keys_at_their_defaults():
    config = load_config(None, ["tree.roots=4"])
    assert config.tree == dataclasses.replace(TreeConfig(), roots=4)
    assert dataclasses.replace(config, tree=TreeConfig()) == TrainConfig()


def test_overrides_apply_on_top_of_a_preset_and_later_ones_win():
    config = load_config("tiny-chain", ["tree.roots=4", "iterations=5", "tree.roots=2"])
    assert config.tree.roots == 2 and config.iterations == 5
    assert config.output_dir == "runs/tiny-chain"  # from the preset, untouched


def test_an_int_is_accepted_for_a_float_field():
    config = load_config(None, ["train.lora_alpha=16", "advantage.alpha=2"])
    assert config.train.lora_alpha == 16.0 and config.advantage.alpha == 2.0


def test_parse_override():
    assert parse_override("tree.roots=4") == (["tree", "roots"], 4)
    assert parse_override(" iterations = 3") == (["iterations"], 3)
    assert parse_override("output_dir=a=b") == (["output_dir"], "a=b")  # only the first '=' splits
    assert parse_override("output_dir=") == (["output_dir"], "")
    assert parse_override("output_dir=[unclosed") == (["output_dir"], "[unclosed")  # invalid YAML: kept as text


# ---------------------------------------------------------------- YAML booleans (YAML 1.2: only true/false)
@pytest.mark.parametrize(
    "override, get, expected",
    [
        # documented choice words that YAML 1.1 reads as booleans: rejected before the fix
        ("train.mixed_precision=no", lambda c: c.train.mixed_precision, "no"),
        ("explore.mode=off", lambda c: c.explore.mode, "off"),
        ("model.path=on", lambda c: c.model.path, "on"),
        ("output_dir=yes", lambda c: c.output_dir, "yes"),
        ("output_dir=NO", lambda c: c.output_dir, "NO"),
    ],
)
def test_yaml_1_1_boolean_words_stay_strings(override, get, expected):
    value = get(load_config(None, [override]))
    assert value == expected and type(value) is str


def test_choice_words_from_a_yaml_file(tmp_path):
    path = write(tmp_path, "train:\n  mixed_precision: no\nexplore:\n  mode: off\nmodel:\n  path: Off\n")
    config = load_config(path)
    assert (config.train.mixed_precision, config.explore.mode, config.model.path) == ("no", "off", "Off")


@pytest.mark.parametrize(
    "word, expected",
    [("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False), ("FALSE", False),
     ("yes", True), ("Yes", True), ("YES", True), ("on", True), ("ON", True),
     ("no", False), ("No", False), ("off", False), ("Off", False), ("OFF", False)],
)
def test_bool_keys_take_true_false_and_yes_no_on_off(tmp_path, word, expected):
    for key, get in (("model.offload", lambda c: c.model.offload), ("sampling.exact", lambda c: c.sampling.exact),
                     ("final_eval", lambda c: c.final_eval)):
        value = get(load_config(None, [f"{key}={word}"]))
        assert value is expected, key
    path = write(tmp_path, f"final_eval: {word}\nmodel:\n  offload: {word}\nsampling:\n  exact: {word}\n")
    config = load_config(path)
    assert config.final_eval is config.model.offload is config.sampling.exact is expected


def test_a_mixed_case_true_is_a_string_not_a_bool():
    # YAML 1.2 has only true/True/TRUE; 'tRuE' must stay a string, or safe_dump (which does not quote it) would not round-trip
    assert load_config(None, ["output_dir=tRuE"]).output_dir == "tRuE"
    assert config_error(None, ["final_eval=tRuE"]) == ("override 'final_eval=tRuE': 'final_eval' = 'tRuE' has the wrong type; "
                                                     "expected bool (true, false, yes, no, on, off)")


# ---------------------------------------------------------------- one-line errors
def test_unknown_top_level_key_suggests_close_match():
    message = config_error(None, ["iteratons=3"])
    assert message == "override 'iteratons=3': unknown key 'iteratons'; did you mean iterations?"


def test_unknown_nested_key_suggests_close_match():
    message = config_error(None, ["tree.rots=2"])
    assert message == "override 'tree.rots=2': unknown key 'tree.rots'; did you mean tree.roots?"


def test_a_key_given_without_its_section_suggests_the_section(capsys):
    """`learning_rate=1e-4` suggested nothing useful; docs/errors.md promises "did you mean"."""
    assert config_error(None, ["learning_rate=1e-4"]) == "override 'learning_rate=1e-4': unknown key 'learning_rate'; did you mean train.learning_rate?"
    assert config_error(None, ["lerning_rate=1e-4"]).endswith("did you mean train.learning_rate?")
    assert config_error(None, ["roots=4"]).endswith("did you mean tree.roots?")
    assert config_error(None, ["clip_range=1e-4"]).endswith("did you mean train.clip_range, guard.clip_range, awm.clip_range?")


def test_unknown_key_without_close_match_lists_allowed_keys():
    message = config_error(None, ["xyzzy=1"])
    assert "unknown key 'xyzzy'" in message
    own = ", ".join(f.name for f in dataclasses.fields(TrainConfig) if f.name != "objectives")
    assert message.endswith(f"allowed: {own}, and the objectives' guard, layertuning, nft, awm, dgpo, dppo, dpo, dpo_offline, sft")
    assert config_error(None, ["nfft.beta=1"]).endswith("unknown key 'nfft'; did you mean nft?")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("iterations=abc", "override 'iterations=abc': 'iterations' = 'abc' has the wrong type; expected int"),
        ("tree.roots=2.5", "override 'tree.roots=2.5': 'tree.roots' = 2.5 has the wrong type; expected int"),
        ("sampling.exact=3", "override 'sampling.exact=3': 'sampling.exact' = 3 has the wrong type; "
                             "expected bool (true, false, yes, no, on, off)"),
        ("final_eval=maybe", "override 'final_eval=maybe': 'final_eval' = 'maybe' has the wrong type; expected bool (true, false, yes, no, on, off)"),
        ("explore.mode=false", "override 'explore.mode=false': 'explore.mode' = False has the wrong type; expected str; allowed: off, seeds, tree, search"),
        ("train.learning_rate=fast", "override 'train.learning_rate=fast': 'train.learning_rate' = 'fast' has the wrong type; expected float"),
        ("tree.roots=true", "override 'tree.roots=true': 'tree.roots' = True has the wrong type; expected int"),
    ],
)
def test_wrong_type(override, expected):
    assert config_error(None, [override]) == expected


def test_an_unknown_tracker_is_one_line():
    assert config_error(None, ["logging.report_to=neptune"]) == ("logging.report_to=neptune: choose tensorboard, wandb, swanlab or none, or a "
                                                                  "list of them without repeats, e.g. logging.report_to=[tensorboard,wandb]")


def test_wrong_type_inside_a_list():
    message = config_error(None, ["prune.depths=[1, a]"])
    assert "'prune.depths' = [1, 'a'] has the wrong type; expected list[int]" in message


def test_section_given_a_scalar():
    message = config_error(None, ["tree=3"])
    assert message.startswith("override 'tree=3': 'tree' must be a mapping of its keys (roots, splits,")
    assert message.endswith("got 3")


def test_choice_outside_the_allowed_set_lists_choices_and_suggests():
    message = config_error(None, ["sampling.sde=flw"])
    assert message == "override 'sampling.sde=flw': 'sampling.sde' = 'flw' is not allowed; allowed: dance, flow, cps, ddim, ode (did you mean 'flow'?)"


def test_choice_without_close_match_has_no_suggestion():
    message = config_error(None, ["prune.width=zzz"])
    assert message == "override 'prune.width=zzz': 'prune.width' = 'zzz' is not allowed; allowed: none, per_branch, global"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("iterations=0", "override 'iterations=0': 'iterations' = 0 is out of range; it must be > 0"),
        ("train.learning_rate=-1", "override 'train.learning_rate=-1': 'train.learning_rate' = -1 is out of range; it must be > 0"),
        ("train.kl_beta=-0.5", "override 'train.kl_beta=-0.5': 'train.kl_beta' = -0.5 is out of range; it must be ≥ 0"),
    ],
)
def test_out_of_range(override, expected):
    assert config_error(None, [override]) == expected


def test_boundary_values_are_accepted():
    config = load_config(None, ["train.kl_beta=0", "tree.mix_window=0", "prune.width_ratio=1", "train.step_fraction=1.0"])
    assert config.train.kl_beta == 0 and config.prune.width_ratio == 1


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["tree.splits=[[1]]"], "'tree.splits' entry [1] must be [step, k] or [step, k, {noise_level: x}] with whole step and k"),
        (["tree.splits=[[0, 2, 1, 4]]"], "'tree.splits' entry [0, 2, 1, 4] must be [step, k] or [step, k, {noise_level: x}] with whole step and k"),
        (["tree.splits=[[0.5, 2]]"], "'tree.splits' entry [0.5, 2] must be [step, k] or [step, k, {noise_level: x}] with whole step and k"),
        (["tree.splits=[[10, 2]]"], "'tree.splits' = [[10, 2]]: split step 10 is outside 0..9 (num_steps = 10)"),
        (["tree.splits=[[-1, 2]]"], "'tree.splits' = [[-1, 2]]: split step -1 is outside 0..9 (num_steps = 10)"),
        (["tree.splits=[[1, 2], [1, 3]]"], "'tree.splits' = [[1, 2], [1, 3]]: split step 1 is given twice"),
        (["tree.splits=[[1, 1]]"], "'tree.splits' = [[1, 1]]: split at step 1 has 1 branches; a split needs k ≥ 2"),
        (["tree.splits=[[1, 2, {noise_level: 0}]]"], "'tree.splits' entry [1, 2, {'noise_level': 0}]: noise_level must be a finite number > 0"),
        (["tree.splits=[[1, 2, 4.0]]"], "'tree.splits' entry [1, 2, 4.0]: the third element must be a mapping {noise_level: x} (the SDE's η / a at "
                                        "this split); the release's noise-only kick is tree.anchor_noise_multiplier"),
        (["tree.splits=[[1, 2, {noise_scale: 2}]]"], "'tree.splits' entry [1, 2, {'noise_scale': 2}]: allowed split options: noise_level"),
        (["tree.splits=[[1, 2, {noise_level: high}]]"], "'tree.splits' entry [1, 2, {'noise_level': 'high'}]: noise_level must be a finite number > 0"),
        (["tree.split_noise_scale=4"], "override 'tree.split_noise_scale=4': 'tree.split_noise_scale' was replaced: use tree.split_noise_level (an SDE "
                                       "noise level that enters drift and noise, e.g. 1.2 for η = 0.3 × 4) or tree.anchor_noise_multiplier (the "
                                       "BranchGRPO release's noise-only kick); see docs/trees.md"),
        (["prune.depths=[0]"], "'prune.depths' [0] outside 1..10 (child depths of the 10-step tree)"),
        (["sampling.num_steps=4", "prune.depths=[2, 5, 6]"], "'prune.depths' [5, 6] outside 1..4 (child depths of the 4-step tree)"),
        (["tree.mix_window=5", "tree.mix_start=6"], "'tree.mix_start' + 'tree.mix_window' = 11 exceeds sampling.num_steps = 10"),
        (["prune.width_ratio=1.5"], "'prune.width_ratio' = 1.5 must be in (0, 1]"),
        (["model.family=wan", "model.guidance_2=3", "sampling.guidance=1", "prompts.eval_guidance=0.5"],
         "'model.guidance_2' = 3 is the CFG scale of Wan 2.2's low-noise expert, and sampling.guidance=1 and prompts.eval_guidance=0.5 run no "
         "classifier-free guidance (above 1 guides), so it would be ignored: raise one of them, or leave model.guidance_2 unset"),
        (["prune.active_fraction=2"], "'prune.active_fraction' = 2 must be in (0, 1]"),
        (["train.step_fraction=1.01"], "'train.step_fraction' = 1.01 must be in (0, 1]"),
        (["train.train_steps_fraction=3"], "'train.train_steps_fraction' = 3 must be in (0, 1]"),
    ],
)
def test_cross_field_checks(overrides, expected):
    assert config_error(None, overrides) == expected


def test_cross_field_checks_accept_valid_trees():
    config = load_config(None, ["tree.splits=[[0, 2], [8, 3, {noise_level: 0.5}]]", "prune.depths=[1, 10]", "tree.mix_window=4", "tree.mix_start=6"])
    assert config.tree.splits == [[0, 2], [8, 3, {"noise_level": 0.5}]] and config.prune.depths == [1, 10]
    spec = tree_spec(config, 0)
    assert spec.noise_level(8, 0.7) == 0.5 and spec.noise_level(0, 0.7) == 0.7 and spec.noise_level(1, 0.7) == 0.7


CPS_RANGE = ("with sampling.sde=cps the level a must be in [0.01, 1] (std = σ'·sin(aπ/2): a > 1 repeats a smaller level's std, a ≥ 2 "
             "gives std ≤ 0 and NaN log-probs, a < 0.01 a std of about 0); use e.g. 0.8 (cps's usual level), or sampling.sde=flow or dance "
             "to explore more than a = 1 does")
ZERO = "its advantage is always 0, so nothing would be trained"
CPS_ZERO = "where cps's std σ'·sin(aπ/2) is 0 (σ' = 0), so nothing would be trained"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # train.train_steps_fraction leaving no trainable SDE step
        (["train.train_steps_fraction=0.05"], "'train.train_steps_fraction' = 0.05 trains only steps s < ⌊0.05·10⌋ = 0, but the SDE steps are "
                                              "0..9: nothing would be trained; use train.train_steps_fraction ≥ 0.1"),
        (["sampling.num_steps=30", "train.train_steps_fraction=0.03"],
         "'train.train_steps_fraction' = 0.03 trains only steps s < ⌊0.03·30⌋ = 0, but the SDE steps are 0..29: nothing would be trained; "
         "use train.train_steps_fraction ≥ 0.04"),
        (["tree.mix_window=2", "tree.mix_start=4", "tree.splits=[[6, 2]]", "train.train_steps_fraction=0.4"],
         "'train.train_steps_fraction' = 0.4 trains only steps s < ⌊0.4·10⌋ = 4, but the SDE steps (Mix window and split steps) are 4..6: "
         "nothing would be trained; use train.train_steps_fraction ≥ 0.5"),
        (["tree.mix_window=2", "tree.mix_slide_every=10", "train.train_steps_fraction=0.3", "iterations=31"],
         "'train.train_steps_fraction' = 0.3 trains only steps s < ⌊0.3·10⌋ = 3, but at iteration 30 the SDE steps (Mix window and split "
         "steps) are 3..4: nothing would be trained; use train.train_steps_fraction ≥ 0.4 or iterations ≤ 30"),
        (["tree.mix_window=2", "tree.mix_slide_every=10", "train.train_steps_fraction=0.3", "iterations=1000000"],
         "'train.train_steps_fraction' = 0.3 trains only steps s < ⌊0.3·10⌋ = 3, but at iteration 30 the SDE steps (Mix window and split "
         "steps) are 3..4: nothing would be trained; use train.train_steps_fraction ≥ 0.9 or iterations ≤ 30"),
        # a group of one: every advantage is 0
        (["tree.roots=1"], f"'tree.roots' = 1 with no 'tree.splits' grows one sample per prompt: {ZERO}; use tree.roots ≥ 2 or add a split "
                           "(e.g. tree.splits=[[0, 2]])"),
        (["explore.mode=tree", "tree.roots=1", "tree.splits=[[0, 2]]", "explore.keep=1"],
         f"'explore.keep' = 1 with explore.mode=tree keeps one leaf per prompt: {ZERO}; use explore.keep ≥ 2"),
        (["explore.mode=tree", "tree.roots=4", "explore.keep=1"],
         f"'explore.keep' = 1 with explore.mode=tree keeps one leaf per prompt: {ZERO}; use explore.keep ≥ 2"),
        (["explore.mode=seeds", "explore.keep=1"], f"'explore.keep' = 1 with explore.mode=seeds and no 'tree.splits' keeps one chain per prompt: "
                                                   f"{ZERO}; use explore.keep ≥ 2 or add a split (e.g. tree.splits=[[0, 2]])"),
        # cps: a split at the last step, levels outside (0, 1] or with std ≈ 0
        (["sampling.sde=cps", "tree.roots=1", "tree.splits=[[0, 2], [9, 3]]"],
         "'tree.splits' entry [9, 3] splits at the last step, 9 (sampling.num_steps = 10), where cps's std σ'·sin(aπ/2) is 0 (σ' = 0): its 3 "
         "children would be identical; split at an earlier step or use sampling.sde=flow or dance"),
        (["sampling.sde=cps", "sampling.noise_level=2"], f"'sampling.noise_level' = 2 is outside cps's range: {CPS_RANGE}"),
        (["sampling.sde=cps", "sampling.noise_level=3.2"], f"'sampling.noise_level' = 3.2 is outside cps's range: {CPS_RANGE}"),
        (["sampling.sde=cps", "sampling.noise_level=1.01"], f"'sampling.noise_level' = 1.01 is outside cps's range: {CPS_RANGE}"),
        (["sampling.sde=cps", "sampling.noise_level=0.001"], f"'sampling.noise_level' = 0.001 is outside cps's range: {CPS_RANGE}"),
        (["sampling.sde=cps", "tree.split_noise_level=1.6"], f"'tree.split_noise_level' = 1.6 is outside cps's range: {CPS_RANGE}"),
        (["sampling.sde=cps", "tree.splits=[[0, 2, {noise_level: 3.2}]]"],
         f"'tree.splits' entry [0, 2, {{'noise_level': 3.2}}]: noise_level 3.2 is outside cps's range: {CPS_RANGE}"),
        (["sampling.sde=cps", "tree.splits=[[0, 2], [3, 2, {noise_level: 0.005}]]"],
         f"'tree.splits' entry [3, 2, {{'noise_level': 0.005}}]: noise_level 0.005 is outside cps's range: {CPS_RANGE}"),
        # ode: no densities for GRPO, identical children of a split, DDIM families
        (["sampling.sde=ode"], "'sampling.sde' = 'ode' samples without noise, so no step has a density for train.loss=grpo to train: use "
                               "an objective that trains on final samples (nft, awm, dgpo, dpo, dpo-offline, sft), or an SDE (sampling.sde=flow)"),
        (["sampling.sde=ode", "train.loss=nft", "tree.roots=1", "tree.splits=[[0, 2]]"],
         "'sampling.sde' = 'ode' grows deterministic chains: the children of a split would be identical; drop tree.splits (and "
         "explore.mode=tree) or use an SDE (sampling.sde=flow)"),
        (["sampling.sde=ode", "train.loss=nft", "model.family=sd15", "model.path=x"],
         "'sampling.sde' = 'ode' samples flow-matching chains; model.family=sd15 steps with DDIM: use sampling.sde=ddim"),
        # a first-block cache: not under trained rollout log-probs, exact regeneration or a whole-model compile
        (["sampling.block_cache=0.1"], "'sampling.block_cache' = 0.1 with train.loss=grpo: a cached step is not the policy's, so the log-probs "
                                       "it trains would not be the rollout's (the ratio would not be 1 before the first update); use an objective "
                                       "that trains final samples (nft, awm, dgpo, dpo) or sampling.block_cache=0"),
        (["sampling.block_cache=0.1", "train.loss=nft", "sampling.exact=true"],
         "'sampling.block_cache' = 0.1 with sampling.exact: a cached forward's skips depend on the rows it holds, so a node regrown alone "
         "would not be bit for bit the same; set one of them off"),
        (["sampling.block_cache=0.1", "train.loss=awm", "model.compile=full"],
         "'sampling.block_cache' = 0.1 with model.compile=full: the cache wraps the denoiser's blocks, which a whole-model compilation traces "
         "through; use model.compile=blocks (compiled blocks stay compiled) or none"),
        (["sampling.block_cache=0.1", "train.loss=sft"], "'sampling.block_cache' = 0.1 with train.loss=sft, which trains on a dataset and "
                                                          "grows no rollouts: there is nothing to cache; set sampling.block_cache=0"),
        # above 1 every forward after a node's first was skipped, in silence; families the cache cannot follow, before the model loads
        (["sampling.block_cache=1.5", "train.loss=nft"], "'sampling.block_cache' = 1.5: the threshold is a relative change of the first "
                                                         "block's residual, which is almost never 1 or more, so every forward after a node's "
                                                         "first would be skipped; use a value below 1 (0.3 was measured on the video task: docs/gpu.md)"),
        (["sampling.block_cache=1e6", "train.loss=awm"], "'sampling.block_cache' = 1e+06: the threshold is a relative change of the first "
                                                         "block's residual, which is almost never 1 or more, so every forward after a node's "
                                                         "first would be skipped; use a value below 1 (0.3 was measured on the video task: docs/gpu.md)"),
        (["sampling.block_cache=0.3", "train.loss=nft", "model.family=sana", "model.path=x"],
         "'sampling.block_cache' = 0.3 with model.family=sana: its blocks (SanaTransformerBlock) are not in diffusers' block registry, so the "
         "cache cannot follow them; set sampling.block_cache=0"),
        (["sampling.block_cache=0.3", "train.loss=nft", "model.family=z-image", "model.path=x"],
         "'sampling.block_cache' = 0.3 with model.family=z-image: its blocks take one sequence of text and image tokens, padded per forward "
         "to its longest prompt, so the cache cannot follow them; set sampling.block_cache=0"),
        (["sampling.block_cache=0.1", "train.loss=nft", "explore.mode=search"],
         "'sampling.block_cache' = 0.1 with explore.mode=search, which grows its trees a node at a time: the cache follows a rollout's "
         "levels only; set sampling.block_cache=0 or explore.mode=seeds or tree"),
        # cps: only the last step is SDE (its std is 0 there)
        (["sampling.sde=cps", "sampling.num_steps=1"], f"'sampling.sde' = 'cps' with sampling.num_steps = 1: the only step is the last, {CPS_ZERO}; "
                                                       "use sampling.num_steps ≥ 2 or sampling.sde=flow or dance"),
        (["sampling.sde=cps", "tree.mix_window=1", "tree.mix_start=9"],
         f"'sampling.sde' = 'cps' with 'tree.mix_window' = 1: the only SDE step (Mix window and split steps) is the last (9), {CPS_ZERO}; "
         "widen tree.mix_window, split before the last step, or use sampling.sde=flow or dance"),
        (["sampling.sde=cps", "tree.mix_window=1", "tree.mix_slide_every=5"],
         f"'sampling.sde' = 'cps' with 'tree.mix_window' = 1: at iteration 45 the only SDE step (Mix window and split steps) is the last (9), "
         f"{CPS_ZERO}; widen tree.mix_window, split before the last step, or use sampling.sde=flow or dance"),
    ],
)
def test_configs_that_would_train_nothing_are_refused(overrides, expected):
    assert config_error(None, overrides) == expected


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.train_steps_fraction=0.1"],  # ⌊0.1·10⌋ = 1: step 0 is trained
        ["sampling.num_steps=30", "train.train_steps_fraction=0.04"],
        ["tree.mix_window=2", "tree.mix_start=4", "tree.splits=[[6, 2]]", "train.train_steps_fraction=0.5"],
        ["tree.mix_window=2", "tree.mix_start=4", "tree.splits=[[1, 2]]", "train.train_steps_fraction=0.2"],  # the split step 1 is SDE
        ["tree.mix_window=2", "tree.mix_slide_every=10", "train.train_steps_fraction=0.3", "iterations=30"],  # the window stops in time
        ["tree.roots=1", "tree.splits=[[5, 2]]"],
        ["tree.roots=2"],
        ["explore.mode=tree", "tree.roots=1", "tree.splits=[[0, 2]]", "explore.keep=2"],
        ["explore.mode=seeds", "explore.keep=1", "tree.splits=[[0, 2]]"],  # with splits the kept seed still branches
        ["explore.mode=seeds", "explore.keep=2", "tree.roots=1"],  # seeds mode replaces tree.roots by explore.keep
        ["sampling.sde=cps", "sampling.noise_level=1"],
        ["sampling.sde=cps", "sampling.noise_level=0.01", "tree.split_noise_level=1.0", "tree.splits=[[8, 2, {noise_level: 0.5}]]"],
        ["sampling.sde=cps", "tree.mix_window=2", "tree.mix_slide_every=5"],  # the window ends at 8..9: step 8 is trained
        ["sampling.sde=dance", "tree.splits=[[9, 2]]", "sampling.noise_level=2"],  # the cps limits are cps's only
        ["sampling.sde=flow", "tree.splits=[[9, 2]]", "tree.split_noise_level=3.2"],
    ],
)
def test_configs_that_train_are_accepted(overrides):
    load_config(None, overrides)


def _brute_force_trains_every_iteration(config: TrainConfig) -> bool:
    """Independent of config.py: every iteration of range(iterations), its SDE steps, the first ⌊f·T⌋ trained."""
    steps = config.sampling.num_steps
    limit = math.floor(config.train.train_steps_fraction * steps + 1e-9)
    split_steps = {int(s[0]) for s in config.tree.splits}
    for iteration in range(config.iterations):
        sde = set(range(steps))
        if config.tree.mix_window:
            sde = set(mix_sde_steps(steps, config.tree.mix_window, iteration, config.tree.mix_start, config.tree.mix_slide_every)) | split_steps
        if config.sampling.sde == "cps":
            sde.discard(steps - 1)  # std σ'·sin(aπ/2) = 0 at σ' = 0
        if not any(s < limit for s in sde):
            return False
    return True


def test_trainable_step_check_agrees_with_every_iteration():
    """The check visits one iteration per window position; it must agree with visiting all of them."""
    refused = accepted = 0
    grid = itertools.product([1, 3, 6], [0.05, 0.2, 0.5, 1.0], [0, 1, 2], [0, 2], [0, 3], ["flow", "cps"], [[], [[1, 2]]], [4, 9, 40])
    for steps, fraction, window, start, slide, sde, splits, iterations in grid:
        if start + window > steps or any(s[0] >= steps for s in splits):
            continue
        config = TrainConfig(iterations=iterations)
        config.sampling.num_steps, config.sampling.sde = steps, sde
        config.train.train_steps_fraction = fraction
        config.tree.mix_window, config.tree.mix_start, config.tree.mix_slide_every, config.tree.splits = window, start, slide, splits
        expected = _brute_force_trains_every_iteration(config)
        try:
            validate(config)
        except ConfigError as error:
            assert not expected, (config, error)
            refused += 1
            continue
        assert expected, config
        assert all(trainable_steps(config, i) for i in range(iterations))
        accepted += 1
    assert refused > 50 and accepted > 50


@pytest.mark.parametrize(
    "extra, steps, edges",
    [
        (["train.train_steps_fraction=0.34"], [0], 2),  # the smallest fraction accepted for T = 3 (0.33 is refused)
        (["sampling.sde=cps", "tree.mix_window=2", "tree.mix_start=1"], [1], 2),  # cps's last step (std 0) is not trained
    ],
)
def test_the_trainer_trains_the_steps_the_check_counts(tiny_model_dir, tmp_path, extra, steps, edges):
    from branchdiff.training.recipe import Trainer

    config = load_config(None, [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", "iterations=1", "sampling.num_steps=3",
                                "tree.roots=2", "prompts.per_iteration=1", "reward=rewards_for_tests:Redness", "sampling.max_batch=8",
                                "train.minibatch=4", "final_eval=false", "logging.report_to=none", *extra])
    assert trainable_steps(config, 0) == steps
    assert Trainer(config).run_iteration(0).metrics["edges_trained"] == edges  # 1 prompt × 2 roots × 1 step
    assert "nothing would be trained" in config_error(None, ["sampling.num_steps=3", "train.train_steps_fraction=0.33"])


def test_validate_on_a_hand_built_config():
    config = TrainConfig(tree=TreeConfig(splits=[[0, 2, 1.0, 7]]))
    with pytest.raises(ConfigError, match=r"^'tree.splits' entry \[0, 2, 1.0, 7\] must be"):
        validate(config)
    config = TrainConfig(train=OptimConfig(step_fraction=1.5))
    with pytest.raises(ConfigError, match=r"^'train.step_fraction' = 1.5 must be in \(0, 1\]$"):
        validate(config)


@pytest.mark.parametrize("override", ["iterations", "tree.roots", "=3", " =3"])
def test_override_without_key_value_form(override):
    assert config_error(None, [override]) == f"override {override!r} is not of the form key=value (e.g. tree.roots=4)"


def test_missing_preset_suggests_close_name():
    message = config_error("tiny-chian")
    assert message.startswith("no preset or file 'tiny-chian'; did you mean tiny-chain") and "branchdiff train --help lists every preset" in message


def test_missing_file_lists_presets(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert config_error(missing) == f"no preset or file {missing!r}; presets: {', '.join(presets())}"


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------- YAML files
def write(tmp_path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_file_values_are_loaded(tmp_path):
    path = write(tmp_path, "iterations: 7\ntree:\n  roots: 3\n  splits: [[0, 2]]\ntrain:\n  learning_rate: 1e-4\n")
    config = load_config(path)
    assert config.iterations == 7 and config.tree.roots == 3 and config.tree.splits == [[0, 2]]
    assert config.train.learning_rate == 1e-4 and isinstance(config.train.learning_rate, float)


def test_overrides_win_over_the_yaml_file(tmp_path):
    path = write(tmp_path, "iterations: 7\ntree:\n  roots: 3\n")
    config = load_config(path, ["tree.roots=5"])
    assert config.iterations == 7 and config.tree.roots == 5


def test_override_fixes_a_bad_file_value(tmp_path):
    path = write(tmp_path, "tree:\n  roots: 2.5\n")
    assert load_config(path, ["tree.roots=2"]).tree.roots == 2


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing here\n")) == TrainConfig()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("# a comment\niterations: 3\n\nseed: 1\niteratons: 5\n", ":5: unknown key 'iteratons'; did you mean iterations?"),
        ("iterations: 3\ntree:\n  roots: 2\n  splits: []\n  rots: 4\nsampling:\n  sde: flow\n",
         ":5: unknown key 'tree.rots'; did you mean tree.roots?"),
        ("seed: 1\nsampling:\n  num_steps: 10\n  sde: flw\n",
         ":4: 'sampling.sde' = 'flw' is not allowed; allowed: dance, flow, cps, ddim, ode (did you mean 'flow'?)"),
        ("seed: 1\n\ntrain: {learning_rate: -1}\n", ":3: 'train.learning_rate' = -1 is out of range; it must be > 0"),
        ("iterations: 3\nseed: 1: 2\n", ":2: not valid YAML (mapping values are not allowed here)"),
        ("- iterations: 3\n- seed: 1\n", ": expected a mapping of keys to values, got list"),
        ("just a string\n", ": expected a mapping of keys to values, got str"),
    ],
)
def test_bad_file_reports_file_line_and_problem(tmp_path, text, expected):
    path = write(tmp_path, text)
    assert config_error(path) == f"{path}{expected}"


def test_invalid_yaml_reports_file_and_line(tmp_path):
    path = write(tmp_path, "iterations: 3\ntree:\n  roots: [1, 2\nseed: 0\n")
    assert config_error(path).startswith(f"{path}:4: not valid YAML (")


# ---------------------------------------------------------------- round trip
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["tree.splits=[[0,2],[3,2,{noise_level: 0.5}]]", "tree.split_noise_level=1.2", "tree.anchor_noise_multiplier=2", "model.path=null", "train.learning_rate=1e-5", "prune.depths=[1,2]", "logging.report_to=none"],
        ["model.path=/x/y", "output_dir=runs/rt", "sampling.sde=cps", "tree.mix_window=3", "seed=4294967295", "train.kl_beta=1e-12"],
        ["train.mixed_precision=no", "explore.mode=off", "output_dir=yes", "model.path=tRuE", "sampling.exact=off", "final_eval=No"],
        ["prompts.train=off", "prompts.eval=yes", "reward=Off", "model.path=null"],
    ],
)
def test_save_then_load_round_trips(tmp_path, overrides):
    config = load_config("tiny-chain", overrides)
    path = tmp_path / "config.yaml"
    save_config(config, path)
    again = load_config(str(path))
    assert again == config
    assert again.train.learning_rate == config.train.learning_rate and type(again.train.learning_rate) is float


def test_saved_choice_words_are_quoted(tmp_path):
    """safe_dump quotes 'no' and 'off' (YAML 1.1 booleans), so any YAML reader gets the string back."""
    path = tmp_path / "config.yaml"
    save_config(load_config(None, ["train.mixed_precision=no", "explore.mode=off", "sampling.exact=no", "logging.report_to=none"]), path)
    text = path.read_text()
    assert "  mixed_precision: 'no'\n" in text and "  mode: 'off'\n" in text and "  exact: false\n" in text and "  report_to: none\n" in text


def test_noise_level_must_be_positive():
    assert config_error(None, ["sampling.noise_level=0"]) == "override 'sampling.noise_level=0': 'sampling.noise_level' = 0 is out of range; it must be > 0"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["sampling.num_steps=4", "tree.roots=1", "tree.splits=[[3, 2]]", "train.train_steps_fraction=0.75"],
         "the trainable steps 0..2 (train.train_steps_fraction = 0.75) all lead to depths with one node per prompt (the first split "
         "is at step 3): every advantage there is 0, so nothing would be trained; split earlier or raise train.train_steps_fraction"),
        (["sampling.num_steps=3", "tree.roots=4", "prune.depths=[1, 2, 3]"],
         "'prune.depths' = [1, 2, 3] prunes every trained depth (1..3): nothing would be trained while pruning is active; keep at least one of them"),
    ],
)
def test_trainable_steps_that_compare_nothing_are_refused(overrides, expected):
    """Regression (review): trainable steps before the first split, or every trained depth pruned,
    trained nothing without a word."""
    assert config_error(None, overrides) == expected


def test_sde_and_shift_must_fit_the_family_steps():
    assert config_error(None, ["model.family=sd15", "model.path=x", "sampling.sde=flow"]) == (
        "'sampling.sde' = 'flow' is not an SDE of model.family=sd15 (ddim steps); allowed: ddim")
    assert config_error(None, ["model.family=flux", "model.path=x", "sampling.sde=ddim"]) == (
        "'sampling.sde' = 'ddim' is not an SDE of model.family=flux (flow steps); allowed: dance, flow, cps")
    assert config_error(None, ["model.family=sd15", "model.path=x", "sampling.sde=ddim", "sampling.shift=3"]).startswith(
        "'sampling.shift' = 3 applies to flow families")


@pytest.mark.parametrize("preset, override, owner", [
    ("tiny-awm", "dpo.beta=5", "dpo"), ("tiny-chain", "awm.power=2", "awm"), ("tiny-chain", "nft.beta=0.5", "nft"),
    ("tiny-awm", "dgpo.reference=ema", "dgpo"), ("tiny-awm", "guard={clip_range: 1e-3}", "grpo-guard"),
    ("tiny-dpo", "dpo_offline.beta=50", "dpo-offline"), ("tiny-chain", "layertuning.sft_weight=0.5", "grpo-layertuning"),
])
def test_an_objectives_keys_on_a_run_of_another_objective_are_refused_naming_it(preset, override, owner):
    """They were accepted, recorded in config.yaml, and did nothing."""
    loss = load_config(preset).train.loss
    key, _, value = override.partition("=")
    section = key if "." not in key else key.split(".")[0]
    message = config_error(preset, [override])
    assert message.startswith(f"'{section}.") and message.endswith(f"is a key of train.loss={owner}, and this run trains train.loss={loss}, "
                                                                   f"which never reads it; remove it (or set train.loss={owner})"), message


def test_every_section_at_its_defaults_is_accepted_as_config_writes_it(tmp_path, capsys):
    """`branchdiff config` writes every objective's section: a file it wrote loads, and changing the objective of a file whose
    other sections hold defaults is accepted."""
    from branchdiff.cli import main

    assert main(["config", "tiny-awm"]) == 0
    written = tmp_path / "awm.yaml"
    written.write_text(capsys.readouterr().out)
    assert load_config(str(written), ["train.loss=nft"]).train.loss == "nft"
