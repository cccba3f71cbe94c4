"""Families from other packages (branchdiff/models/registry.py, branchdiff/testing.py): a distribution
installed on the path registers families through the `branchdiff.families` entry point group; in a
fresh process `branchdiff families` lists them, the documented checks pass on a right adapter and
fail on a wrong one, and the plugin family trains. The built-in table is checked in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_pipelines import save_pipeline

TESTS = Path(__file__).parent

PACKAGE = '''from branchdiff.models.registry import Family

FAMILY = Family("plugin_families.adapter:PluginSD3", "flow", 32, side_multiple=4)
BROKEN = Family("plugin_families.adapter:BrokenSD3", "flow", 32, side_multiple=4)
NOT_A_FAMILY = "plugin_families.adapter:PluginSD3"
'''
ADAPTER = '''from branchdiff.models.sd3 import SD3Adapter


class PluginSD3(SD3Adapter):
    family = "plugin-sd3"


class BrokenSD3(SD3Adapter):
    family = "broken-sd3"

    def vae_input(self, latents):
        return latents / self.pipe.vae.config.scaling_factor  # forgets SD3's shift_factor
'''
ENTRY_POINTS = """[branchdiff.families]
plugin-sd3 = plugin_families:FAMILY
broken-sd3 = plugin_families:BROKEN
sd3 = plugin_families:FAMILY
text-family = plugin_families:NOT_A_FAMILY
"""
SCRIPT = '''import json, sys
from branchdiff.cli import main
from branchdiff.testing import check_family

folder, run = sys.argv[1], sys.argv[2]
assert main(["families"]) == 0
print(json.dumps(check_family("plugin-sd3", folder, sizes=((32, 32), (32, 16)))))
try:
    check_family("broken-sd3", folder, sizes=((32, 32),))
    print("broken-sd3 passed")
except AssertionError as error:
    print(f"broken-sd3 failed: {error}")
sys.exit(main(["train", "tiny-chain", "model.family=plugin-sd3", f"model.path={folder}", "model.resolution=[32,16]", f"output_dir={run}",
               "reward=rewards_for_tests:Redness", "prompts.per_iteration=2", "sampling.num_steps=3", "tree.roots=2", "tree.splits=[[0,2]]",
               "iterations=1", "model.finetune=lora", "final_eval=false", "logging.report_to=none", "logging.sample_every=0", "train.learning_rate=0.05"]))
'''


def test_a_family_from_an_installed_package_is_listed_checked_and_trains(tmp_path):
    site = tmp_path / "site"
    (site / "plugin_families").mkdir(parents=True)
    (site / "plugin_families" / "__init__.py").write_text(PACKAGE)
    (site / "plugin_families" / "adapter.py").write_text(ADAPTER)
    dist_info = site / "plugin_families-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-families\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    folder = save_pipeline("sd3", tmp_path / "sd3")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(TESTS), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), str(tmp_path / "run")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    rows = {line.split()[0]: line for line in lines if line and not line.startswith(("size:", "{", "broken-sd3 "))}
    assert "plugin-sd3" in rows and "StableDiffusion3Pipeline" in rows["plugin-sd3"] and "entry point plugin_families.adapter:PluginSD3" in rows["plugin-sd3"]
    assert any(line.startswith("sd3 ") and "not used: entry point plugin_families:FAMILY (package plugin-families): the name of the built-in family 'sd3'" in line
               for line in lines)
    assert any("text-family" in line and "is a str, not a branchdiff.models.registry.Family" in line for line in lines)
    measured = json.loads(next(line for line in lines if line.startswith("{")))
    assert set(measured) == {"sampling 32x32", "lora 32x32", "sampling 32x16", "lora 32x16"} and max(measured.values()) <= 1e-4
    assert any(line.startswith("broken-sd3 failed: sampling 32x32: branchdiff and the pipeline differ by") for line in lines)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_families_lists_every_built_in_family(capsys):
    from branchdiff.cli import main
    from branchdiff.models.registry import BUILT_IN

    assert main(["families"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:] if line and not line.startswith("size:")}
    assert set(BUILT_IN) <= set(rows)
    assert rows["flux"][1:4] == ["FluxPipeline", "flow", "embedded"] and rows["sd15"][1:5] == ["StableDiffusionPipeline", "ddim", "CFG", "7.5"]
    assert rows["z-image"][1] == "ZImagePipeline" and rows["wan"][-3:] == ["16", "81", "built-in"] and rows["tiny"][-3:] == ["fixed", "-", "built-in"]


@pytest.mark.parametrize("family", ["sd3", "z-image"])
def test_the_documented_checks_pass_on_built_in_families(tmp_path, family):
    from branchdiff.testing import check_family

    measured = check_family(family, save_pipeline(family, tmp_path / family))
    assert len(measured) == 4 and max(measured.values()) <= 1e-4
