"""`branchdiff eval`: prompt sets with metadata, several rewards, the table, CSV, grid, JSON and the
HPDv2 folder layout; and the same numbers whichever process holds a prompt."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from branchdiff.cli import main
from branchdiff.data.prompts import PromptSet, load_prompt_set
from branchdiff.evaluation.evaluate import OdeSampling, ProcessShare, evaluate, sample_ode, summarize
from branchdiff.models.tiny import TinyAdapter
from rewards_for_tests import Redness

PROMPTS = [
    {"prompt": "one red circle on the left", "style": "photo"},
    {"prompt": "two blue squares at the top", "style": "anime"},
    {"prompt": "three green triangles at the bottom", "style": "photo"},
]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def test_prompt_files_carry_metadata(prompt_file, tmp_path):
    prompt_set = load_prompt_set(str(prompt_file))
    assert prompt_set.prompts == [p["prompt"] for p in PROMPTS] and prompt_set.metadata[1] == {"style": "anime"}
    table = tmp_path / "prompts.csv"
    table.write_text("prompt,style\na cat,photo\na dog,anime\n")
    assert load_prompt_set(str(table)).metadata == [{"style": "photo"}, {"style": "anime"}]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=rf"^{broken}:2: expected a JSON object with a \"prompt\" field$"):
        load_prompt_set(str(broken))


def test_hpdv2_offline_says_where_to_put_the_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("BRANCHDIFF_DATA", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=rf"^HPDv2 prompts {tmp_path}/hpdv2/anime.json not found and not fetched from the hub .*"
                                                rf"download benchmark/anime.json of the dataset zhwang/HPDv2 into {tmp_path}/hpdv2"):
        load_prompt_set("hpdv2:anime")
    (tmp_path / "hpdv2").mkdir()
    for style in ("anime", "concept-art", "paintings", "photo"):
        (tmp_path / "hpdv2" / f"{style}.json").write_text(json.dumps([f"{style} prompt {i}" for i in range(3)]))
    prompt_set = load_prompt_set("hpdv2")
    assert len(prompt_set.prompts) == 12 and prompt_set.metadata[3] == {"style": "concept-art"}


def test_eval_writes_table_csv_grid_json_and_the_benchmark_layout(prompt_file, tiny_model_dir, tmp_path, capsys):
    out, report = tmp_path / "eval", tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", str(prompt_file), "--rewards", "tiny-geneval,rewards_for_tests:Redness",
                 "--images-per-prompt", "2", "--steps", "3", "--out", str(out), "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "anime" in printed and "photo" in printed and "rewards_for_tests:Redness" in printed
    summary = json.loads(report.read_text())
    assert summary["prompts"] == str(prompt_file) and set(summary["scales"]) == {"tiny-geneval", "rewards_for_tests:Redness"}
    assert summary["scales"]["rewards_for_tests:Redness"] == Redness.scale
    # the mean redness against an independent generation with the same seed and noise addresses
    images, _ = sample_ode(TinyAdapter.from_pretrained(tiny_model_dir), [p["prompt"] for p in PROMPTS], OdeSampling(2, 3))
    expected = Redness()(images, [], [])
    assert summary["summary"]["all"]["rewards_for_tests:Redness"]["mean"] == pytest.approx(expected.mean().item(), abs=1e-6)
    assert summary["summary"]["photo"]["rewards_for_tests:Redness"]["mean"] == pytest.approx(expected[[0, 1, 4, 5]].mean().item(), abs=1e-6)
    with (out / "scores.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 6 and rows[2]["style"] == "anime" and rows[2]["seed"] == "0"
    # the HPDv2 layout: images/seed-<s>/<style>/<index within the style>.jpg
    assert rows[4]["image"] == "images/seed-0/photo/00001.jpg" and (out / rows[4]["image"]).is_file()
    assert (out / "grid.png").is_file() and (out / "summary.json").is_file()


def test_a_prompt_scores_the_same_whichever_process_holds_it(tiny_adapter):
    """Shares of two processes (every other prompt) joined equal the one-process result bit for bit."""
    prompt_set = PromptSet("p", [p["prompt"] for p in PROMPTS], [{} for _ in PROMPTS])
    rewards = {"red": Redness()}
    whole = evaluate(tiny_adapter, prompt_set, rewards, OdeSampling(2, 3))
    shares = [evaluate(tiny_adapter, prompt_set, rewards, OdeSampling(2, 3), ProcessShare(r, 2)) for r in (0, 1)]
    joined = torch.cat([s.scores["red"] for s in shares])
    order = torch.argsort(torch.cat([s.prompt_index * 2 + s.seed_index for s in shares]))
    assert torch.equal(joined[order], whole.scores["red"])
    assert summarize(whole)["all"]["red"]["images"] == 6
