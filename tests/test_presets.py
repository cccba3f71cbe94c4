"""The packaged presets and accelerate configs: each loads and validates, the real-family presets
carry the anchors' defaults they name, and `branchdiff accelerate-config` finds the configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from branchdiff.cli import main
from branchdiff.settings.load import load_config
from branchdiff.settings.trees import tree_spec

FAMILY_PRESETS = {"sd35-pickscore": "sd3", "flux-hps-branch": "flux", "flux-hps-mix": "flux", "sana-pickscore": "sana", "sd15-hps": "sd15",
                  "wan-mq-branch": "wan", "z-image-pickscore": "z-image",
                  "qwen-image-pickscore": "qwen-image", "flux2-klein-pickscore": "flux2-klein",
                  "flux2-pickscore": "flux2"}


@pytest.mark.parametrize("name", sorted(FAMILY_PRESETS))
def test_family_preset_and_its_explore_variant(name):
    config, explore = load_config(name), load_config(f"{name}-explore")
    assert config.model.family == FAMILY_PRESETS[name] and config.explore.mode == "off"
    assert explore.explore.mode in ("seeds", "tree") and explore.explore.backend == "torchao-fp8"
    assert config.model.dtype in ("bfloat16", "float16") and config.model.path  # real weights, bf16/fp16 base


SOL_PRESETS = {"sd35-pickscore-sol": ("sd3", "seeds"), "sana-pickscore-sol": ("sana", "seeds"), "flux-hps-branch-sol": ("flux", "tree"),
               "flux-hps-mix-sol": ("flux", "tree"), "wan-mq-branch-sol": ("wan", "tree"), "z-image-pickscore-sol": ("z-image", "seeds"),
               "qwen-image-pickscore-sol": ("qwen-image", "seeds"), "flux2-klein-pickscore-sol": ("flux2-klein", "seeds"),
               "flux2-pickscore-sol": ("flux2", "seeds")}  # sd15-hps has none: DiffusionNFT trains flow-matching families


@pytest.mark.parametrize("name", sorted(SOL_PRESETS))
def test_sol_presets_are_their_base_trained_with_nft_on_an_explored_pool(name):
    """Sol-RL's setting: 96 seeds previewed with 6 ODE steps, the 12 best and 12 worst regenerated
    CFG-free as ODE chains (on trees: the 4 best and 4 worst leaves), trained with DiffusionNFT."""
    config, base = load_config(name), load_config(name.removesuffix("-sol"))
    family, mode = SOL_PRESETS[name]
    assert config.model == base.model and config.model.family == family and config.reward == base.reward
    assert config.train.loss == "nft" and config.train.kl_beta == 1e-4 and (config.explore.mode, config.explore.selection) == (mode, "best_worst")
    if mode == "seeds":
        assert (config.explore.pool, config.explore.keep, config.explore.preview_steps, config.explore.preview_sampler) == (96, 24, 6, "ode")
        # no CFG: Z-Image's pipeline guides at any scale > 0; FLUX.2 [dev] embeds its scale (one row, CFG-free already)
        unguided = {"z-image": 0.0, "flux2": base.sampling.guidance}.get(family, 1.0)
        steps = base.sampling.num_steps  # 10 (SD3.5, SANA, Qwen-Image), Z-Image-Turbo's 9, FLUX.2's 8
        assert (config.sampling.sde, config.sampling.guidance, config.prompts.eval_guidance, config.sampling.num_steps) == ("ode", unguided, unguided, steps)
    else:
        assert config.explore.keep == 8 and config.tree == base.tree and config.sampling == base.sampling


@pytest.mark.parametrize("name", ["tiny-sol", "tiny-sol-tree"])
def test_the_tiny_sol_presets_run_an_iteration(name, tiny_model_dir, tmp_path):
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config(name, [f"output_dir={tmp_path}", f"model.path={tiny_model_dir}", "prompts.per_iteration=2",
                                         "explore.pool=8", "explore.keep=4", "explore.fidelity_every=0", "final_eval=false",
                                         "logging.report_to=none", "logging.sample_every=0"]))
    metrics = trainer.run_iteration(0).metrics
    assert metrics["optimizer_steps"] >= 1 and metrics["nfe_trained"] == 2 * 4 * 2  # 2 prompts × 4 kept samples × 2 steps
    assert metrics["edges_trained"] == 2 * 4  # the kept samples


def test_wan_presets_are_branchgrpo_video_and_its_dancegrpo_baseline():
    """BranchGRPO's video setting as far as the paper states it: Wan 2.1 T2V 1.3B, VideoAlign's motion quality, the image
    runs' tree (20 steps, k = 2 at steps 0, 3, 6, 9: 16 leaves, η 0.3); the chain baseline: 16 DanceGRPO chains, 60% of steps."""
    branch, chain = load_config("wan-mq-branch"), load_config("wan-mq-chain")
    for config in (branch, chain):
        assert (config.model.family, config.model.path) == ("wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
        assert config.reward["name"] == "videoalign" and config.reward["kwargs"]["dimension"] == "MQ"
        assert (config.sampling.num_steps, config.sampling.sde, config.sampling.noise_level) == (20, "dance", 0.3)
    spec = tree_spec(branch, 0)
    assert [s.step for s in spec.splits] == [0, 3, 6, 9] and spec.leaves == 16 == tree_spec(chain, 0).leaves
    assert chain.tree.splits == [] and chain.train.step_fraction == 0.6
    assert (chain.model, chain.train.learning_rate) == (branch.model, branch.train.learning_rate)


def test_the_image_to_video_preset_is_the_video_tree_on_ti2v_5b_at_its_published_size():
    """wan-i2v-mq-branch: Wan 2.2 TI2V-5B from a first frame at the release's 1280×704 (sides multiples of its 32: VAE 16 ×
    patch 2) and CFG 5, with wan-mq-branch's tree, SDE, reward and training; its prompt sets are JSONL (rows name images)."""
    i2v, t2v = load_config("wan-i2v-mq-branch"), load_config("wan-mq-branch")
    assert (i2v.model.family, i2v.model.path, i2v.model.resolution) == ("wan-i2v", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", [704, 1280])
    assert all(side % 32 == 0 for side in i2v.model.resolution) and i2v.sampling.guidance == 5.0
    assert (i2v.tree, i2v.sampling, i2v.train, i2v.reward) == (t2v.tree, t2v.sampling, t2v.train, t2v.reward)
    assert i2v.prompts.train.endswith(".jsonl") and i2v.prompts.eval.endswith(".jsonl")


def test_flux_branch_preset_is_branchgrpo():
    """BranchGRPO: 20 steps, shift 3, k = 2 at steps 0, 3, 6, 9 (16 leaves, 203 forwards a tree), η 0.3."""
    config = load_config("flux-hps-branch")
    spec = tree_spec(config, 0)
    assert (config.sampling.num_steps, config.sampling.shift, config.sampling.sde, config.sampling.noise_level) == (20, 3.0, "dance", 0.3)
    assert [(s.step, s.branches) for s in spec.splits] == [(0, 2), (3, 2), (6, 2), (9, 2)] and spec.leaves == 16
    assert load_config("flux-hps-mix").tree.mix_window > 0


def test_accelerate_configs_are_found_and_parse(capsys):
    from accelerate.commands.config.config_args import load_config_from_file

    assert main(["accelerate-config"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["fsdp", "fsdp-offload", "multi-gpu", "multi-node", "single-gpu"]
    expected = {"single-gpu": (1, 1), "multi-gpu": (8, 1), "multi-node": (16, 2), "fsdp": (8, 1), "fsdp-offload": (8, 1)}
    for name, (processes, machines) in expected.items():
        assert main(["accelerate-config", name]) == 0
        path = Path(capsys.readouterr().out.strip())
        parsed = load_config_from_file(str(path))
        assert (parsed.num_processes, parsed.num_machines, parsed.mixed_precision) == (processes, machines, "bf16")
        if name.startswith("fsdp"):  # FSDP2, the shards offloaded only in fsdp-offload (branchdiff/runtime/sharding.py reads these)
            assert parsed.distributed_type == "FSDP" and parsed.fsdp_config["fsdp_version"] == 2
            assert parsed.fsdp_config["fsdp_offload_params"] == (name == "fsdp-offload")
    assert main(["accelerate-config", "fsdp-typo"]) == 2
    assert "available: fsdp, fsdp-offload, multi-gpu, multi-node, single-gpu" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "family"), [("flux-kontext-pickscore", "flux-kontext"), ("qwen-image-edit-pickscore", "qwen-image-edit")])
def test_the_editing_presets_read_prompt_sets_with_sources(name, family):
    """The editing presets (Flow-Factory's examples) train an editing family from JSONL prompt sets (rows with an
    "image"); their evaluation scores what the edit kept of the source beside the preference reward."""
    config = load_config(name)
    assert config.model.family == family and config.prompts.train.endswith(".jsonl") and config.prompts.eval.endswith(".jsonl")
    assert "edit-consistency" in config.eval_rewards and config.model.dtype == "bfloat16" and config.model.path
    assert (config.sampling.num_steps, config.tree.roots, config.tree.mix_window, config.tree.mix_start) == (10, 16, 3, 1)


OBJECTIVE_PRESETS = {"awm": "awm", "dgpo": "dgpo", "dppo": "dppo", "dpo": "dpo", "mc-grpo": "grpo"}


@pytest.mark.parametrize("name", sorted(OBJECTIVE_PRESETS))
def test_objective_presets_are_sd35_pickscore_trained_with_the_objective(name):
    """One real-family preset per new objective: SD3.5-M toward PickScore as sd35-pickscore, its loss
    named, the forward-process ones on ODE chains, MC-GRPO with one more chain and the median baseline."""
    config, base = load_config(f"sd35-pickscore-{name}"), load_config("sd35-pickscore")
    assert config.model == base.model and config.reward == base.reward and config.train.loss == OBJECTIVE_PRESETS[name]
    assert config.sampling.sde == ("ode" if name in ("awm", "dgpo", "dpo") else "flow")
    if name == "mc-grpo":
        assert config.advantage.baseline == "median" and config.tree.roots == base.tree.roots + 1
    tiny = load_config(f"tiny-{name}")
    assert tiny.train.loss == OBJECTIVE_PRESETS[name] and tiny.model.family == "tiny"
