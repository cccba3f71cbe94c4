"""The bad-input catalogue of docs/errors.md, end to end through the CLI: every case ends with one
line `branchdiff: error: ...` naming the problem and the fix, exit status 2, no traceback, and
every file that existed before is still there with the same bytes. (Ctrl-C, exit 130, and kills
at any moment are in test_crash_resume.py.)
"""

from __future__ import annotations

import errno
import fcntl
import json
import re
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from branchdiff.cli import main

DOCS = Path(__file__).parent.parent / "docs" / "errors.md"
PREFIX = "branchdiff: error: "


@dataclass
class Env:
    tmp: Path  # empty per case
    model: Path  # a saved tiny model
    run: Path  # a finished 2-iteration run (checkpoints iter-000000, iter-000001), a copy per case
    kontext: Path  # a saved tiny FLUX.1 Kontext pipeline (an editing family)
    held: list = field(default_factory=list)  # open files a case holds (a lock) until it ends

    def checkpoint(self, iteration: int = 1) -> Path:
        return self.run / "checkpoints" / f"iter-{iteration:06d}"

    def train(self, *overrides: str, resume: bool = False) -> list[str]:
        """`branchdiff train` with the finished run's settings (model, output_dir, size) and `overrides`."""
        return ["train", "tiny-chain", *RUN_SETTINGS, f"model.path={self.model}", f"output_dir={self.run}", *overrides,
                *(["--resume", "latest"] if resume else [])]

    def fresh(self, *overrides: str) -> list[str]:
        """`branchdiff train` into a new output_dir."""
        return ["train", "tiny-chain", *RUN_SETTINGS, f"model.path={self.model}", f"output_dir={self.tmp / 'new'}", *overrides]


RUN_SETTINGS = ["iterations=2", "seed=0", "model.finetune=lora", "train.learning_rate=1e-3", "prompts.per_iteration=2", "tree.roots=3", "sampling.num_steps=3", "sampling.max_batch=8",
                "final_eval=false", "logging.checkpoint_every=1", "logging.sample_every=0", "logging.report_to=none"]


@dataclass
class Case:
    id: str  # the heading of the case in docs/errors.md
    argv: Callable[[Env], list[str]]
    message: str  # a regular expression the error line matches after the prefix
    setup: Callable[[Env], None] = lambda env: None
    creates_nothing: bool = True  # refused before anything is written: a new output_dir is not even created
    max_length: int = 600  # characters of the error line


def _write(name: str, text: str) -> Callable[[Env], None]:
    return lambda env: (env.tmp / name).write_text(text)


def _image(path: Path) -> None:
    """A small valid PNG at `path`."""
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 30, 30)).save(path)


def _damage(file: str, how: str) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        path = env.run / "checkpoints" / "iter-000001" / file
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if how == "truncate" else b"\x00garbage" * 64)

    return setup


def _rewrite_state(**changes) -> Callable[[Env], None]:
    """Change fields of iter-000001's trainer_state.json (None: remove the field) and write a manifest
    that matches: a checkpoint whose files agree with its manifest but whose state is wrong."""
    def setup(env: Env) -> None:
        from branchdiff.runtime import checkpoint

        path = env.checkpoint() / "trainer_state.json"
        state = json.loads(path.read_text())
        for key, value in changes.items():
            state.pop(key) if value is None else state.__setitem__(key, value)
        path.write_text(json.dumps(state))
        checkpoint.write_manifest(env.checkpoint())

    return setup


def _empty_lora(env: Env) -> None:
    """A valid safetensors file with no tensor in it, and a manifest that agrees."""
    from safetensors.torch import save_file

    from branchdiff.runtime import checkpoint

    save_file({}, env.checkpoint() / "pytorch_lora_weights.safetensors")
    checkpoint.write_manifest(env.checkpoint())


def _flip_byte(file: str) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        path = env.checkpoint() / file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    return setup


def _damage_all(env: Env) -> None:
    for iteration in (0, 1):
        (env.checkpoint(iteration) / "optimizer.bin").write_bytes(b"\x00")


def _hold_lock(env: Env) -> None:
    """Another run holds the output_dir: its lock file, locked, with its pid."""
    handle = (env.run / ".lock").open("a+")
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.seek(0)
    handle.truncate()
    handle.write('{"pid": 4242, "host": "gpu-node-7", "started": "2026-11-23 09:00:00"}')
    handle.flush()
    env.held.append(handle)


def _edits(row: dict, images: dict[str, tuple[int, int]], folders: tuple[str, ...] = ()) -> Callable[[Env], None]:
    """A one-row edits file e.jsonl beside images of the given (width, height) and empty folders."""
    def setup(env: Env) -> None:
        from PIL import Image

        for name, size in images.items():
            Image.new("RGB", size, (200, 30, 30)).save(env.tmp / name)
        for name in folders:
            (env.tmp / name).mkdir()
        (env.tmp / "e.jsonl").write_text(json.dumps(row) + "\n")

    return setup


def _sample(env: Env, *options: str, prompt: str = "one red circle on the left") -> list[str]:
    """`branchdiff sample` of the tiny model into work/out."""
    return ["sample", "--model", str(env.model), "--prompt", prompt, "--out", str(env.tmp / "out"), *options]


def _kontext(env: Env, *options: str) -> list[str]:
    """`branchdiff sample` of the tiny FLUX.1 Kontext at 32×32 into work/out."""
    return ["sample", "--family", "flux-kontext", "--model", str(env.kontext), "--resolution", "32", "--prompt", "make it blue",
            "--out", str(env.tmp / "out"), *options]


def _unwritable(env: Env) -> None:
    (env.tmp / "a-file").write_text("not a folder")  # an output_dir inside a file cannot be created, even by root


LONG_PROMPT = "two red circles on the left " * 40  # 1,120 characters: within what the tiny family's text encoder takes (1,232)

def _damaged_set(kind: str) -> Callable[[Env], None]:
    """A one-row JSONL set in work/: `sft` names half a JPEG, `pair` names one image as both chosen and rejected, `long` a
    demonstration prompt of 13,000 characters."""
    def setup(env: Env) -> None:
        from PIL import Image

        Image.new("RGB", (32, 32), (200, 30, 30)).save(env.tmp / "good.png")
        Image.new("RGB", (32, 32), (20, 130, 30)).save(env.tmp / "photo.jpg", quality=90)
        whole = (env.tmp / "photo.jpg").read_bytes()
        (env.tmp / "half.jpg").write_bytes(whole[: len(whole) // 2])
        row = {"sft": {"prompt": "one red circle on the left", "image": "half.jpg"},
               "pair": {"prompt": "one red circle on the left", "chosen": "good.png", "rejected": "good.png"},
               "long": {"prompt": "one red circle on the left " * 500, "image": "good.png"}}[kind]
        (env.tmp / "set.jsonl").write_text(json.dumps(row) + "\n")

    return setup


def _judge(env: Env, *settings: str) -> list[str]:
    """`train` with a vlm-judge reward at a port nothing listens on (settings: more of its kwargs)."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    reward = f"{{name: vlm-judge, kwargs: {{url: 'http://127.0.0.1:{port}/v1', model: judge-7b, retries: 0{''.join(', ' + s for s in settings)}}}}}"
    return env.fresh(f"reward={reward}")


CASES = [
    # configuration
    Case("list-for-a-text-key", lambda e: ["train", "model.family=[sd3]", f"output_dir={e.tmp / 'new'}"],
         r"override 'model.family=\[sd3\]': 'model.family' = \['sd3'\] has the wrong type; expected str; allowed: tiny, "),
    Case("unknown-key", lambda e: e.fresh("tree.rots=2"), r"override 'tree.rots=2': unknown key 'tree.rots'; did you mean tree.roots\?"),
    Case("unknown-section", lambda e: e.fresh("trainer.learning_rate=1e-4"), r"unknown key 'trainer'; did you mean train\?"),
    Case("wrong-type", lambda e: e.fresh("iterations=ten"), r"'iterations' = 'ten' has the wrong type; expected int"),
    Case("value-not-allowed", lambda e: e.fresh("sampling.sde=flw"), r"'sampling.sde' = 'flw' is not allowed; allowed: .*did you mean 'flow'"),
    Case("out-of-range", lambda e: e.fresh("prompts.per_iteration=0"), r"'prompts.per_iteration' = 0 is out of range; it must be > 0"),
    Case("not-a-number", lambda e: e.fresh("train.max_grad_norm=.nan"), r"'train.max_grad_norm' = nan is not a finite number; give a number \(default: 1.0\)"),
    Case("infinite-number", lambda e: e.fresh("sampling.noise_level=.inf"), r"'sampling.noise_level' = inf is not a finite number"),
    Case("learning-rate-nan", lambda e: e.fresh("train.learning_rate=.nan"), r"'train.learning_rate' = nan is not a finite number"),
    Case("seed-out-of-range", lambda e: e.fresh("seed=-1"), r"'seed' = -1 is out of range; it must be in \[0, 4294967295\]"),
    Case("reward-weight-nan", lambda e: e.fresh("reward={name: tiny-geneval, weight: .nan}"), r"'reward' entry .*: weight must be a finite number"),
    Case("reward-name-null", lambda e: e.fresh("reward={name: null}"), r"'reward' entry \{'name': None\}: 'name' must be a non-empty string"),
    Case("split-noise-level-nan", lambda e: e.fresh("tree.splits=[[0, 2, {noise_level: .nan}]]"), r"'tree.splits' entry .*: noise_level must be a finite number > 0"),
    Case("resolution-of-a-fixed-family", lambda e: e.fresh("model.resolution=64"), r"'model.resolution' = 64: model.family=tiny makes only 32×32 images"),
    Case("output-dir-empty", lambda e: e.fresh("output_dir="), r"'output_dir' is empty; pass output_dir= a folder for the run"),
    Case("renamed-key", lambda e: e.fresh("logging.keep_checkpoints=3"), r"'logging.keep_checkpoints' was replaced: renamed logging.checkpoints_total_limit"),
    Case("unknown-preset", lambda e: ["train", "tiny-mixx"], r"no preset or file 'tiny-mixx'; did you mean tiny-mix, .*\? \(branchdiff train --help lists every preset\)"),
    Case("family-without-preset", lambda e: ["train", "model.family=sd3", f"model.path={e.tmp}", f"output_dir={e.tmp / 'new'}"],
         r"model.family=sd3 without a preset would train with the default preset tiny-mix-full, the built-in tiny model's recipe .*; "
         r"start from one of its presets \(sd35-geneval-flow-grpo, (sd35-[a-z-]+, ){5}… \(\d+ in all: branchdiff train --help\)\), "
         r"e.g. branchdiff train sd35-geneval-flow-grpo"),
    Case("expert-of-a-one-denoiser-family", lambda e: e.fresh("model.expert=low"),
         r"'model.expert' = 'low' chooses one of Wan 2.2's two experts; model.family=tiny has one denoiser: leave model.expert unset"),
    Case("both-experts-fully-fine-tuned", lambda e: ["config", "wan-mq-branch", "model.expert=both", "model.finetune=full", "model.dtype=float32"],
         r"'model.expert' = 'both' trains LoRA on Wan 2.2's two experts; full fine-tuning trains one expert per run: "
         r"set model.finetune=lora, or model.expert=high or low"),
    Case("guidance-2-of-a-one-denoiser-family", lambda e: e.fresh("model.guidance_2=3"),
         r"'model.guidance_2' = 3 is the guidance of Wan 2.2's low-noise expert; model.family=tiny has one denoiser: leave model.guidance_2 unset"),
    Case("frames-on-an-image-family", lambda e: e.fresh("model.frames=5"),
         r"'model.frames' = 5: model.family=tiny makes images, not videos; leave model.frames unset"),
    Case("loss-of-another-family", lambda e: ["config", "sd15-hps", "train.loss=grpo-layertuning"],
         r"'train.loss' = 'grpo-layertuning' regresses flow-matching velocities .*model.family=sd15 is an ε-prediction \(DDIM\) family: use train.loss=grpo"),
    Case("yaml-unknown-key", lambda e: ["train", str(e.tmp / "my.yaml")], r".*my.yaml:3: unknown key 'train.learning_rat'; did you mean train.learning_rate\?",
         _write("my.yaml", "iterations: 2\ntrain:\n  learning_rat: 1.0e-4\n")),
    Case("yaml-syntax", lambda e: ["train", str(e.tmp / "my.yaml")], r".*my.yaml:3: not valid YAML \(expected ',' or '\]'", _write("my.yaml", "iterations: 2\ntree: [roots: 1\n")),
    Case("yaml-duplicate-key", lambda e: ["train", str(e.tmp / "my.yaml")], r".*my.yaml:4: key 'train' is given twice \(first at line 1\); YAML would keep only the last",
         _write("my.yaml", "train:\n  learning_rate: 1.0e-4\niterations: 2\ntrain:\n  lora_rank: 4\n")),
    Case("yaml-not-utf8", lambda e: ["train", str(e.tmp / "my.yaml")], r".*my.yaml:2: not UTF-8 text \(byte 0xe9\); save the file as UTF-8",
         lambda e: (e.tmp / "my.yaml").write_bytes(b"iterations: 2\n# caf\xe9\n")),
    Case("override-form", lambda e: e.fresh("--resume", "latest", "roots"), r"train: unrecognized arguments: roots"),
    # trees and sampling
    Case("split-after-last-step", lambda e: e.fresh("tree.splits=[[5,2]]"), r"'tree.splits' = \[\[5, 2\]\]: split step 5 is outside 0..2 \(num_steps = 3\)"),
    Case("group-of-one", lambda e: e.fresh("tree.roots=1"), r"'tree.roots' = 1 with no 'tree.splits' grows one sample per prompt: .*use tree.roots ≥ 2 or add a split"),
    Case("no-trainable-step", lambda e: e.fresh("train.train_steps_fraction=0.05"), r"'train.train_steps_fraction' = 0.05 trains only steps .*nothing would be trained; use train.train_steps_fraction ≥ 0.34"),
    Case("sde-of-another-family", lambda e: e.fresh("sampling.sde=ddim"), r"'sampling.sde' = 'ddim' is not an SDE of model.family=tiny \(flow steps\); allowed: dance, flow, cps"),
    # prompts
    Case("prompt-file-missing", lambda e: e.fresh(f"prompts.train={e.tmp / 'nope.txt'}"), r"prompt source '.*nope.txt' is neither"),
    Case("prompt-file-empty", lambda e: e.fresh(f"prompts.train={e.tmp / 'empty.txt'}"), r"prompt source '.*empty.txt' holds no prompts",
         _write("empty.txt", "\n  \n")),
    Case("prompt-file-not-utf8", lambda e: e.fresh(f"prompts.train={e.tmp / 'p.txt'}"), r".*p.txt:2: not UTF-8 text \(byte 0xff\); save the file as UTF-8",
         lambda e: (e.tmp / "p.txt").write_bytes(b"one red circle on the left\ntwo \xff squares\n")),
    Case("prompt-jsonl-malformed", lambda e: e.fresh(f"prompts.train={e.tmp / 'p.jsonl'}"), r".*p.jsonl:2: expected a JSON object with a \"prompt\" field",
         _write("p.jsonl", '{"prompt": "one red circle on the left"}\n{"text": "two blue squares"}\n')),
    Case("prompt-jsonl-not-a-string", lambda e: e.fresh(f"prompts.train={e.tmp / 'p.jsonl'}"), r".*p.jsonl:2: \"prompt\" must be a non-empty string, got '3'",
         _write("p.jsonl", '{"prompt": "one red circle on the left"}\n{"prompt": 3}\n')),
    Case("prompt-source-image-missing", lambda e: e.fresh(f"prompts.train={e.tmp / 'e.jsonl'}"),
         r".*e.jsonl:2: source image 'images/gone.png' not found \(looked for .*gone.png\); fix the path, relative to the prompt file's folder",
         _write("e.jsonl", '{"prompt": "one red circle on the left"}\n{"prompt": "make it blue", "image": "images/gone.png"}\n')),
    Case("prompt-source-image-unreadable", lambda e: e.fresh(f"prompts.train={e.tmp / 'e.jsonl'}"),
         r".*e.jsonl:1: source image 'notes.png' could not be read as an image",
         lambda e: ((e.tmp / "notes.png").write_text("not an image"), (e.tmp / "e.jsonl").write_text('{"prompt": "make it blue", "image": "notes.png"}\n'))),
    Case("prompt-source-on-a-text-family", lambda e: e.fresh(f"prompts.train={e.tmp / 'e.csv'}"),
         r"prompt 1 of '.*e.csv' comes with a source image \(\"image\", --image\) and model.family=tiny makes images from text alone: use an editing family",
         lambda e: (_image(e.tmp / "red.png"), (e.tmp / "e.csv").write_text("prompt,image\nmake it blue,red.png\n"))),
    Case("prompt-csv-no-column", lambda e: e.fresh(f"prompts.train={e.tmp / 'p.csv'}"), r".*p.csv:1: no \"prompt\" column \(columns: text, style\)",
         _write("p.csv", "text,style\ntwo red circles,anime\n")),
    Case("prompt-csv-empty-prompt", lambda e: e.fresh(f"prompts.train={e.tmp / 'p.csv'}"), r".*p.csv:3: \"prompt\" must be a non-empty string, got '\"\"'",
         _write("p.csv", "prompt,style\ntwo red circles on the left,anime\n,photo\n")),
    Case("prompt-too-long", lambda e: e.fresh(f"prompts.train={e.tmp / 'one-line.txt'}"),
         r"prompt 1 of '.*one-line.txt' is 50,000 characters \('xxxx.*'\): more than model.family=tiny's text encoders read \(77 tokens, at most 1,232 characters\)",
         _write("one-line.txt", "x" * 50_000)),
    Case("prompt-the-reward-cannot-score", lambda e: e.fresh(f"prompts.train={e.tmp / 'p.txt'}"),
         r"reward 'tiny-geneval' cannot score '.*p.txt': prompt 2: prompt 'a photo of a cat' is not in the tiny grammar",
         _write("p.txt", "two red circles on the left\na photo of a cat\n")),
    Case("eval-prompts-missing", lambda e: e.fresh("final_eval=true", f"prompts.eval={e.tmp / 'held.txt'}"), r"prompt source '.*held.txt' is neither"),
    # model and reward weights
    Case("model-missing", lambda e: ["train", "tiny-chain", f"model.path={e.tmp / 'no-model'}", f"output_dir={e.tmp / 'new'}"],
         r"no tiny model at .*no-model: expected .*no-model/transformer/config.json; set model.path or \$BRANCHDIFF_TINY_MODEL"),
    Case("model-folder-incomplete", lambda e: e.fresh("model.family=sd3", f"model.path={e.tmp}", "model.resolution=64"),
         r"model.path='.*' could not be loaded as a StableDiffusion3Pipeline \(no model_index.json in that folder\); pass model.path= a local diffusers folder"),
    Case("model-hub-unreachable", lambda e: e.fresh("model.family=sd3", "model.path=stabilityai/not-cached-here", "model.resolution=64"),
         r"model.path='stabilityai/not-cached-here' could not be loaded as a StableDiffusion3Pipeline \(not in the local hub cache, and the hub could not be reached\)"),
    Case("reward-weights-missing", lambda e: e.fresh(f"reward={{name: hpsv2.1, kwargs: {{checkpoint: {e.tmp / 'HPS.pt'}}}}}"),
         r"reward 'hpsv2.1': no weights at '.*HPS.pt'; download HPS_v2.1_compressed.pt from https://huggingface.co/xswu/HPSv2 .*and pass its local path"),
    Case("reward-unknown", lambda e: e.fresh("reward=hpsv3"), r"unknown reward 'hpsv3'.*available: .*dotted path"),
    Case("eval-reward-unknown", lambda e: e.fresh("final_eval=true", "eval_rewards=[pickscor]"), r"unknown reward 'pickscor' \(did you mean pickscore\?\)"),
    Case("eval-reward-unknown-not-evaluated", lambda e: e.fresh("final_eval=false", "eval_every=0", "eval_rewards=[pickscor]"),
         r"unknown reward 'pickscor' \(did you mean pickscore\?\)"),
    Case("reward-kwarg-unknown", lambda e: e.fresh("reward={name: rewards_for_tests:Redness, kwargs: {strength: 2}}"),
         r"reward 'rewards_for_tests:Redness' takes no keyword argument 'strength'"),
    Case("remote-reward-kwarg-unknown", lambda e: e.fresh(f"reward={{remote: http://127.0.0.1:9, kwargs: {{token_file: {e.tmp / 'token'}, colour: red}}}}"),
         r"reward 'http://127.0.0.1:9' takes no keyword argument 'colour'; it takes: timeout, retries, backoff, image_format, chunk_size, token_file$",
         _write("token", "a-shared-token-of-32-characters-\n")),
    Case("remote-replicas-not-distinct", lambda e: e.fresh("reward={remote: [http://127.0.0.1:9, http://127.0.0.1:9]}"),
         r"'reward' entry .*: 'remote' must be a server's URL or a list of distinct URLs of its replicas"),
    Case("remote-replicas-all-down", lambda e: e.fresh("reward={remote: [http://127.0.0.1:9, http://127.0.0.1:7], kwargs: {retries: 0}}"),
         r"every reward replica is down \(2 of 2\): http://127.0.0.1:9: reward server http://127.0.0.1:9/health is not reachable .*; "
         r"http://127.0.0.1:7: reward server http://127.0.0.1:7/health is not reachable"),
    # rewards misbehaving during a run
    Case("reward-raises", lambda e: e.fresh("reward=rewards_for_tests:Failing"), r"reward 'rewards_for_tests:Failing' failed.*weights not found second line",
         creates_nothing=False),
    Case("reward-raises-on-a-long-prompt", lambda e: e.fresh("reward=rewards_for_tests:Failing", f"prompts.train={e.tmp / 'long.txt'}"),
         r"reward 'rewards_for_tests:Failing' failed on a batch of \d+ images \(first prompt 'two red circles on t… circles on the left'\): RuntimeError",
         _write("long.txt", LONG_PROMPT + "\n"), creates_nothing=False, max_length=300),
    Case("reward-wrong-shape", lambda e: e.fresh("reward=rewards_for_tests:WrongShape"), r"reward 'rewards_for_tests:WrongShape' returned .*shape",
         creates_nothing=False),
    Case("reward-all-nan", lambda e: e.fresh("reward=rewards_for_tests:AllNaN"), r"every group of iteration 0 had a non-finite reward .*--resume latest",
         creates_nothing=False),
    Case("reward-all-inf", lambda e: e.fresh("reward=rewards_for_tests:AllInf"), r"every group of iteration 0 had a non-finite reward .*--resume latest",
         creates_nothing=False),
    # checkpoints and the output directory
    Case("output-dir-holds-a-run", lambda e: e.train(), r"output_dir .* already holds a run .*--resume latest, or pass another output_dir="),
    Case("output-dir-unwritable", lambda e: e.fresh(f"output_dir={e.tmp / 'a-file' / 'run'}"), r"output_dir .*a-file/run is not writable \(Not a directory\)",
         _unwritable),
    Case("output-dir-in-use", lambda e: e.train(resume=True), r"output_dir .*run is in use by another run \(pid 4242 on gpu-node-7, since 2026-11-23 09:00:00\); "
         "wait for it to end or stop it, or pass another output_dir=", _hold_lock),
    Case("resume-config-differs", lambda e: e.train("train.lora_rank=4", resume=True), r"--resume .*iter-000001: the config differs .*train.lora_rank: checkpoint 8, now 4"),
    Case("resume-no-checkpoint", lambda e: e.fresh("--resume", "latest"), r"--resume latest: no checkpoint under .*new/checkpoints"),
    Case("resume-not-a-checkpoint", lambda e: e.train("--resume", str(e.tmp)), r"--resume .*is not a checkpoint \(no trainer_state.json\)"),
    Case("resume-every-checkpoint-damaged", lambda e: e.train(resume=True),
         r"--resume latest: every checkpoint under .*checkpoints is damaged; the newest: .*iter-000001 is damaged \(optimizer.bin has 1 bytes, the manifest says \d+\); start a new run",
         _damage_all),
    Case("checkpoint-state-corrupt", lambda e: e.train("--resume", str(e.checkpoint())),
         r"--resume: checkpoint .*iter-000001 is damaged \(its trainer_state.json is unreadable \(JSONDecodeError\)\); resume from an older one \(--resume .*iter-000000\)",
         lambda e: (e.checkpoint() / "trainer_state.json").write_text('{"iteration": ')),
    Case("checkpoint-state-field-missing", lambda e: e.train("--resume", str(e.checkpoint())),
         r"--resume: checkpoint .*iter-000001 is damaged \(trainer_state.json: field 'iteration' is missing\); resume from an older one", _rewrite_state(iteration=None)),
    Case("checkpoint-state-field-mistyped", lambda e: e.train("--resume", str(e.checkpoint())),
         r"--resume: checkpoint .*iter-000001 is damaged \(trainer_state.json: field 'iteration' = \"1\" is not an integer ≥ 0\)", _rewrite_state(iteration="1")),
    Case("checkpoint-manifest-missing", lambda e: e.train("--resume", str(e.checkpoint())),
         r"--resume: checkpoint .*iter-000001 is damaged \(its manifest.json is missing\)", lambda e: (e.checkpoint() / "manifest.json").unlink()),
    Case("checkpoint-file-changed", lambda e: e.train("--resume", str(e.checkpoint())),
         r"--resume: checkpoint .*iter-000001 is damaged \(optimizer.bin does not match its SHA-256 in the manifest\)", _flip_byte("optimizer.bin")),
    Case("checkpoint-lora-corrupt", lambda e: e.train("--resume", str(e.checkpoint())),
         r"--resume: checkpoint .*iter-000001 is damaged \(pytorch_lora_weights.safetensors has 512 bytes, the manifest says \d+\); resume from an older one \(--resume .*iter-000000\)",
         _damage("pytorch_lora_weights.safetensors", "garbage")),
    Case("checkpoint-lora-empty", lambda e: e.train("--resume", str(e.checkpoint())),
         r"--resume: checkpoint .*iter-000001 is damaged or not this run's \(ValueError: .*pytorch_lora_weights.safetensors does not match the model's LoRA: (\d+) of its \1 tensors missing",
         _empty_lora),
    Case("checkpoint-optimizer-truncated", lambda e: e.train("--resume", str(e.checkpoint())),
         r"--resume: checkpoint .*iter-000001 is damaged \(optimizer.bin has \d+ bytes, the manifest says \d+\); resume from an older one \(--resume .*iter-000000\)",
         _damage("optimizer.bin", "truncate")),
    Case("checkpoint-other-process-count", lambda e: e.train(resume=True), r"the run was trained on 2 processes, this launch has 1; resume with --num_processes 2",
         _rewrite_state(num_processes=2)),
    Case("metrics-field-mistyped", lambda e: e.train(resume=True), r".*run/metrics.jsonl:2: field 'iteration' = \"x\" is not an integer ≥ 0; delete that line and resume again",
         lambda e: _edit_metrics(e, 1, '{"iteration": "x"}')),
    Case("metrics-not-utf8", lambda e: e.train(resume=True), r".*run/metrics.jsonl:2: not UTF-8 text \(byte 0xff\)",
         lambda e: _edit_metrics(e, 1, '{"iteration": 1, "note": "\udcff"}')),
    # commands
    Case("report-not-a-run", lambda e: ["report", str(e.tmp)], r".* is not a run directory \(no metrics.jsonl\); pass the output_dir of branchdiff train"),
    Case("unknown-command", lambda e: ["trian"], r"argument command: invalid choice: 'trian'"),
    Case("bad-number", lambda e: ["eval", "--steps", "many"], r"eval: argument --steps: invalid int value: 'many'"),
    Case("count-below-one", lambda e: ["eval", "--images-per-prompt", "0"], r"eval: argument --images-per-prompt/--seeds: must be ≥ 1, got 0"),
    Case("minutes-not-finite", lambda e: ["bench", "curves", "--minutes", "nan"], r"bench curves: argument --minutes: must be a finite number, got nan"),
    Case("lora-missing", lambda e: ["sample", "--model", str(e.model), "--lora", str(e.tmp / "no-lora"), "--prompt", "one red circle on the left",
                                    "--out", str(e.tmp / "out"), "--steps", "1", "--images-per-prompt", "1"], r"no LoRA or fine-tuned denoiser at .*no-lora; pass a run folder, its lora/ or transformer/ folder, a pytorch_lora_weights.safetensors, or a checkpoint folder \(iter-N\)"),
    Case("weights-not-a-lora", lambda e: ["sample", "--model", str(e.model), "--weights", str(e.tmp / "foreign.safetensors"), "--prompt",
                                          "one red circle on the left", "--out", str(e.tmp / "out"), "--steps", "1", "--images-per-prompt", "1"],
         r".*foreign.safetensors holds no LoRA for this model's transformer .*; it holds 2 tensors, e.g. 'encoder.conv.weight'; pass a LoRA exported",
         lambda e: __import__("safetensors.torch").torch.save_file({"encoder.conv.weight": torch.zeros(2), "head.bias": torch.zeros(1)},
                                                                  str(e.tmp / "foreign.safetensors"))),
    Case("sample-resolution-of-a-fixed-family", lambda e: ["sample", "--model", str(e.model), "--resolution", "64", "--prompt", "x",
                                                           "--out", str(e.tmp / "out")],
         r"resolution 64x64: model.family=tiny makes only 32×32 images; leave the resolution unset"),
    Case("sample-no-prompt", lambda e: ["sample", "--model", str(e.model), "--out", str(e.tmp / "out")],
         r"sample needs --prompt \(or --from-trace OUT/search.json to regrow a search's best images\)"),
    Case("search-no-budget", lambda e: ["sample", "--model", str(e.model), "--prompt", "one red circle on the left", "--search", "dts-star",
                                        "--out", str(e.tmp / "out")], r"--search dts-star needs --budget: the network rows to spend per prompt"),
    Case("search-budget-below-one-image", lambda e: ["sample", "--model", str(e.model), "--prompt", "one red circle on the left", "--search", "dts",
                                                     "--budget", "5", "--out", str(e.tmp / "out")],
         r"--budget 5 network rows cannot make one image: a 10-step image costs at least 10; give --budget ≥ 10, or fewer --steps"),
    Case("search-early-stops-finish-no-image", lambda e: ["sample", "--model", str(e.model), "--prompt", "one red circle on the left", "--search",
                                                          "dts-star", "--budget", "30", "--rollout-depth", "1", "--out", str(e.tmp / "out")],
         r"--rollout-depth 1: the search finished no image of 'one red circle on the left' within --budget 30 \(its rollouts stopped early"),
    Case("search-option-of-another-search", lambda e: ["sample", "--model", str(e.model), "--prompt", "one red circle on the left", "--search",
                                                       "best-of-n", "--budget", "40", "--rollout-depth", "2", "--x0-value", "--out", str(e.tmp / "out")],
         r"--search best-of-n does not use --x0-value, --rollout-depth 2: these set how dts, dts-star, dts-is grow their trees; leave them out"),
    Case("search-exploration-without-greedy", lambda e: _sample(e, "--search", "dts", "--budget", "40", "--exploration", "1"),
         r"exploration 1.0 is DTS\*'s visit-count bonus on its greedy choice of a child, and dts and dts-is draw their children by their "
         r"values, so it would be ignored: use dts-star, or leave exploration at 0"),
    Case("search-x0-value-on-dts-is", lambda e: _sample(e, "--search", "dts-is", "--budget", "40", "--x0-value"),
         r"x0_value values the children whose first image is still in flight, and dts-is keeps one selection in flight, so none is: "
         r"leave x0_value out"),
    Case("search-dts-is-in-parallel", lambda e: _sample(e, "--search", "dts-is", "--budget", "40", "--parallel", "2"),
         r"--search dts-is keeps one selection in flight per prompt \(its weights follow each selection to its leaf\): leave --parallel "
         r"at 1 \(got 2\)"),
    Case("bench-search-bad-variant", lambda e: ["bench", "search", "--variants", "dts-star:depth=3", "--images", "2", "--seeds", "1",
                                                "--out", str(e.tmp / "out")],
         r"bench search: 'depth=3' in 'dts-star:depth=3' is not key=value with a key of max_children, root_children, widening, exploration"),
    Case("bench-option-of-another-benchmark", lambda e: ["bench", "tree", "--sampler"],
         r"bench tree: --sampler is an option of bench search, not of bench tree; see branchdiff bench search --help"),
    Case("bench-temperature-without-sampler", lambda e: ["bench", "search", "--temperature", "2", "--out", str(e.tmp / "out")],
         r"bench search: --temperature is λ of the reward-tilted target of bench search --sampler; add --sampler or leave --temperature out"),
    Case("trace-unreadable", lambda e: ["sample", "--model", str(e.model), "--from-trace", str(e.tmp / "none.json"), "--out", str(e.tmp / "out")],
         r"--from-trace .*none.json: not a search trace written by 'branchdiff sample --search' \(FileNotFoundError: "),
    Case("device-unavailable", lambda e: ["eval", "--device", "cuda", "--model", str(e.model)],
         r"--device cuda: no CUDA device is visible here \(torch.cuda.is_available\(\) is False\); use --device cpu"),
    Case("accelerate-config-unknown", lambda e: ["accelerate-config", "multi-gpus"],
         r"no packaged accelerate config 'multi-gpus'; available: fsdp, fsdp-offload, multi-gpu, multi-node, single-gpu"),
    Case("resolution-not-a-size", lambda e: e.fresh("model.resolution=[64, 32, 16]"),
         r"'model.resolution' = \[64, 32, 16\] is not an image size; give the side H \(a square\) or \[H, W\]"),
    Case("resolution-flag-not-a-size", lambda e: ["sample", "--resolution", "64by32", "--prompt", "x", "--out", str(e.tmp / "out")],
         r"sample: argument --resolution: '64by32' is not an image size; give H \(a square\) or HxW"),
    Case("prompt-instruction-without-one", lambda e: e.fresh("model.prompt_instruction=false"),
         r"'model.prompt_instruction' = false applies to families whose prompts carry an instruction \(sana\); model.family=tiny has none"),
    Case("solver-release-with-search", lambda e: ["sample", "--model", str(e.model), "--prompt", "one red circle on the left", "--search", "dts",
                                                  "--budget", "8", "--solver", "release", "--out", str(e.tmp / "out")],
         r"--solver release samples the model's own ODE; .*leave --solver unset with --search or --from-trace"),
    Case("solver-release-without-one", lambda e: ["sample", "--model", str(e.model), "--prompt", "one red circle on the left", "--solver",
                                                  "release", "--steps", "1", "--images-per-prompt", "1", "--out", str(e.tmp / "out")],
         r"the tiny model ships no sampler of its own \(--solver release needs a diffusers pipeline folder\)"),
    Case("attention-backend-unavailable", lambda e: e.fresh("model.attention_backend=flash"),
         r"model.attention_backend=flash: its package is not installed here \(installed: .*\); install it \(flash: flash-attn"),
    Case("attention-backend-not-dispatched", lambda e: e.fresh("model.attention_backend=_native_math"),
         r"model.attention_backend=_native_math: the tiny family's attention calls PyTorch's SDPA directly, not diffusers' dispatcher"),
    Case("tracker-unknown", lambda e: e.fresh("logging.report_to=[tensorboard,neptune]"),
         r"logging.report_to=\['tensorboard', 'neptune'\]: choose tensorboard, wandb, swanlab or none, or a list of them without repeats"),
    Case("serve-beyond-loopback-without-token", lambda e: ["serve-reward", "tiny-geneval", "--host", "0.0.0.0"],
         r"serve-reward --host 0.0.0.0: a server listening beyond this machine needs a shared token; give --token-file FILE"),
    Case("serve-port-out-of-range", lambda e: ["serve-reward", "tiny-geneval", "--port", "70000"],
         r"serve-reward: argument --port: a TCP port is a whole number from 1 to 65535, got 70000; see branchdiff serve-reward --help"),
    Case("serve-port-in-use", lambda e: ["serve-reward", "tiny-geneval", "--port", str(e.held[0].getsockname()[1])],
         r"reward server cannot listen on 127.0.0.1:\d+ \(Address already in use\); give a --port nothing else listens on \(or stop what listens there\)",
         setup=lambda e: e.held.append(socket.create_server(("127.0.0.1", 0)))),
    Case("token-file-without-a-token", lambda e: ["serve-reward", "tiny-geneval", "--token-file", str(e.tmp / "token")],
         r"token file .*token: holds no token of 16 characters or more; write one", setup=_write("token", "short\n")),
    Case("plan-unknown-gpu", lambda e: ["plan", "tiny-chain", "--gpu", "h1000"], r"--gpu h1000: not a GPU plan knows; choose one of h100-80gb"),
    Case("plan-klein-size-unknown", lambda e: ["plan", "flux2-klein-pickscore", "model.path=someone/klein"],
         r"model.path=someone/klein: plan knows FLUX.2 \[klein\] 4B and 9B by name; plan with model.path=black-forest-labs/FLUX.2-klein-base-4B"),
    # checked before the model loads (BEFORE_LOAD below)
    Case("sample-image-on-a-text-family", lambda e: _sample(e, "--image", str(e.tmp / "red.png")),
         r"prompt 1 of '--prompt' comes with a source image \(\"image\", --image\) and model.family=tiny makes images from text alone: "
         r"use an editing family", lambda e: _image(e.tmp / "red.png")),
    Case("sample-edit-without-image", lambda e: _kontext(e),
         r"prompt 1 of '--prompt' has no source image and model.family=flux-kontext edits images: give every prompt its source \(sample --image"),
    Case("sample-source-of-another-shape", lambda e: _kontext(e, "--image", str(e.tmp / "wide.png"), "--fit", "refuse"),
         r"prompt 1 of '--prompt': source image '.*wide.png' is 64×32 \(width × height\) and the edits 32×32, another aspect ratio, and "
         r"sources.fit is refuse: fit it \(sources.fit / --fit resize, crop or pad\)",
         _edits({}, {"wide.png": (64, 32)})),
    Case("sample-too-many-sources", lambda e: _kontext(e, "--prompt", "make it red", "--image", str(e.tmp / "red.png"), "--image",
                                                       str(e.tmp / "red.png"), "--image", str(e.tmp / "red.png")),
         r"--image was given 3 times for 2 prompts: give it once \(every prompt edits that image\) or once per --prompt", lambda e: _image(e.tmp / "red.png")),
    Case("set-image-unreadable", lambda e: e.fresh("train.loss=sft", f"sft.data={e.tmp / 'set.jsonl'}"),
         r".*set.jsonl:1: \"image\" 'half.jpg' could not be read as an image \(OSError: .*; the file is cut short: copy or export it again\)",
         _damaged_set("sft")),
    Case("pair-of-one-image", lambda e: e.fresh("train.loss=dpo-offline", f"dpo_offline.data={e.tmp / 'set.jsonl'}"),
         r".*set.jsonl:1: \"chosen\" and \"rejected\" are the same image, and a pair trains on their difference: give the rejected image "
         r"of the pair, or drop the row", _damaged_set("pair")),
    Case("demonstration-prompt-too-long", lambda e: e.fresh("train.loss=sft", f"sft.data={e.tmp / 'set.jsonl'}"),
         r"prompt 1 of demonstrations set '.*set.jsonl' is 13,500 characters .*: more than model.family=tiny's text encoders read "
         r"\(at most [\d,]+ characters\); shorten it", _damaged_set("long")),
    Case("judge-unreachable", lambda e: _judge(e), r"judge http://127.0.0.1:\d+/v1/chat/completions is not reachable \(.*\) \(1 attempt\)"),
    Case("judge-key-unset", lambda e: _judge(e, "api_key_env: BRANCHDIFF_NO_SUCH_KEY"),
         r"reward 'vlm-judge': api_key_env=BRANCHDIFF_NO_SUCH_KEY names an environment variable that is not set \(or empty\): export "
         r"BRANCHDIFF_NO_SUCH_KEY=<the judge's key>, or leave api_key_env out for a server that takes no key"),
    Case("judge-replicas-not-distinct", lambda e: e.fresh("reward={name: vlm-judge, kwargs: {url: [http://127.0.0.1:9/v1, http://127.0.0.1:9/v1], "
                                                          "model: judge-7b}}"),
         r"reward 'vlm-judge': url=\[.*\] must be a URL or a list of distinct URLs \(replicas of one judge\)"),
    Case("judge-top-logprobs-one", lambda e: _judge(e, "top_logprobs: 1"),
         r"reward 'vlm-judge': top_logprobs=1 must be an integer ≥ 2 \(with one, the answer's own token is all it lists: P\(yes\) would be "
         r"0, 1 or its bound ½\)"),
    Case("eval-resolution-not-possible", lambda e: ["train", "tiny-chain", "model.family=flux-kontext", f"model.path={e.kontext}",
                                                    "model.resolution=32", "eval.resolution=30", "final_eval=false", f"output_dir={e.tmp / 'new'}"],
         r"eval.resolution=\[30, 30\] \(height, width\) is not possible for flux-kontext: each side must be a multiple of 4 \(e.g. \[32, 32\]\)"),
    Case("search-prompt-the-reward-cannot-score", lambda e: _sample(e, "--search", "dts", "--budget", "20", prompt="a photo of a cat"),
         r"reward 'tiny-geneval' cannot score '--prompt': prompt 1: prompt 'a photo of a cat' is not in the tiny grammar"),
    Case("search-sde-of-another-family", lambda e: _sample(e, "--search", "dts", "--budget", "20", "--sde", "ddim"),
         r"--sde ddim is not an SDE of the tiny family \(flow steps\); choose one of dance, flow, cps, or leave --sde unset"),
    Case("eval-prompts-the-reward-cannot-score", lambda e: ["eval", "--family", "tiny-video", "--prompts", "tiny:held_out", "--rewards", "tiny-video",
                                                            "--out", str(e.tmp / "out")],
         r"reward 'tiny-video' cannot score 'tiny:held_out': prompt 1: prompt '.*' is not in the tiny-video grammar"),
    Case("rewards-check-prompt-the-reward-cannot-score", lambda e: ["rewards", "check", "tiny-geneval", "--model", str(e.model), "--prompts",
                                                                    str(e.tmp / "p.txt")],
         r"reward 'tiny-geneval' cannot score '.*p.txt': prompt 1: prompt 'a photo of a cat' is not in the tiny grammar",
         _write("p.txt", "a photo of a cat\n")),
    Case("out-not-writable", lambda e: _sample(e, "--out", "/sys/branchdiff-out"),
         r"--out /sys/branchdiff-out: cannot write in /sys \(.*\); pass --out a folder you can write to"),
    Case("out-inside-a-file", lambda e: ["eval", "--model", str(e.model), "--out", str(e.tmp / "a-file" / "out")],
         r"--out .*a-file/out: .*a-file is a file, not a folder; pass --out a folder", _unwritable),
    Case("model-path-missing", lambda e: ["train", "tiny-chain", "model.family=wan", f"output_dir={e.tmp / 'new'}"],
         r"model.path is required for model.family=wan: a local diffusers pipeline folder or a hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    Case("eval-model-missing", lambda e: ["eval", "--family", "wan", "--out", str(e.tmp / "out")],
         r"--model is required for model.family=wan: a local diffusers pipeline folder or a hub id"),
    Case("edit-mask-of-another-size", lambda e: e.fresh(f"prompts.train={e.tmp / 'e.jsonl'}"),
         r".*e.jsonl:1: the mask 'mask.png' is 16×8 \(width × height\) and its source 'red.png' 8×8; give a mask of the source's size",
         _edits({"prompt": "make it blue", "image": "red.png", "mask": "mask.png"}, {"red.png": (8, 8), "mask.png": (16, 8)})),
    Case("source-image-is-a-folder", lambda e: e.fresh(f"prompts.train={e.tmp / 'e.jsonl'}"),
         r".*e.jsonl:1: source image 'adir.png' is a folder \(.*adir.png\), not an image file",
         _edits({"prompt": "make it blue", "image": "adir.png"}, {}, ("adir.png",))),
    Case("plan-utilisation-out-of-range", lambda e: ["plan", "tiny-mix", "--utilisation", "0"], r"plan: argument --utilisation: must be in \(0, 1\], got 0"),
    Case("plan-gpu-memory-not-finite", lambda e: ["plan", "tiny-mix", "--gpu-memory", "nan"], r"plan: argument --gpu-memory: must be a finite number, got nan"),
    Case("plan-gpu-tflops-not-positive", lambda e: ["plan", "tiny-mix", "--gpu-tflops", "-1"], r"plan: argument --gpu-tflops: must be > 0, got -1"),
    Case("plan-json-folder-missing", lambda e: ["plan", "tiny-mix", "--json", str(e.tmp / "plans" / "mix.json")],
         r"plan: argument --json: .*plans/mix.json: the folder .*plans does not exist; create it first \(mkdir -p .*plans\) or give a file in an existing folder"),
    Case("push-not-a-run", lambda e: ["push", str(e.tmp), "--repo-id", "me/x"], r"not a run folder \(no config.yaml\); pass the output_dir"),
    Case("push-bad-repo-id", lambda e: ["push", str(e.run), "--repo-id", "x"], r"--repo-id x: a hub repository is OWNER/NAME"),
]


def _edit_metrics(env: Env, index: int, line: str) -> None:
    """Replace line `index` of the finished run's metrics.jsonl (surrogates become raw bytes: not UTF-8)."""
    path = env.run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[index] = line
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None), by path: a refused command leaves no empty folder behind either."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["train", "tiny-chain", *RUN_SETTINGS, f"model.path={tiny_model_dir}", f"output_dir={run}"]) == 0
    return run


@pytest.fixture(scope="module")
def kontext_model(tmp_path_factory) -> Path:
    from tiny_pipelines import build_flux_kontext

    folder = tmp_path_factory.mktemp("kontext")
    build_flux_kontext().save_pretrained(folder)
    return folder


@pytest.fixture
def env(tmp_path, tiny_model_dir, finished_run, kontext_model, monkeypatch) -> Env:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # model-hub-unreachable: no network here, and none wanted in a test
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (tmp_path / "work").mkdir()
    env = Env(tmp_path / "work", tiny_model_dir, run, kontext_model)
    yield env
    for handle in env.held:
        handle.close()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_gives_one_line_exit_2_and_loses_nothing(case, env, capsys):
    case.setup(env)
    before_run, before_work = snapshot(env.run), snapshot(env.tmp)
    assert main(case.argv(env)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1].startswith(PREFIX) and sum(line.startswith(PREFIX) for line in lines) == 1, err
    assert re.search(case.message, lines[-1][len(PREFIX):]), lines[-1]
    assert len(lines[-1]) <= case.max_length, len(lines[-1])
    assert "Traceback" not in err
    after_run, after_work = snapshot(env.run), snapshot(env.tmp)
    assert all(after_run.get(name) == data for name, data in before_run.items())  # nothing written before is lost or changed
    assert all(after_work.get(name) == data for name, data in before_work.items())
    if case.creates_nothing:  # refused before the run directory was created or anything written into one
        assert after_run.keys() == before_run.keys() and after_work.keys() == before_work.keys()
        assert not (env.tmp / "new").exists()


BEFORE_LOAD = ["sample-image-on-a-text-family", "sample-edit-without-image", "sample-source-of-another-shape", "sample-too-many-sources",
               "search-prompt-the-reward-cannot-score", "search-sde-of-another-family", "search-budget-below-one-image",
               "search-option-of-another-search", "eval-prompts-the-reward-cannot-score", "rewards-check-prompt-the-reward-cannot-score", "out-not-writable", "out-inside-a-file", "eval-model-missing",
               "sample-resolution-of-a-fixed-family", "lora-missing", "device-unavailable"]


@pytest.mark.parametrize("case", [case for case in CASES if case.id in BEFORE_LOAD], ids=[case.id for case in CASES if case.id in BEFORE_LOAD])
def test_sample_and_eval_refuse_before_the_model_loads(case, env, capsys, monkeypatch):
    """What needs only the options, the prompt files and the images' headers is checked before any weight is read: the
    same line with loading made impossible (a model loaded first made such a refusal wait for it, or for minutes of sampling)."""
    import branchdiff.models

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(branchdiff.models, "load_adapter", loaded)
    case.setup(env)
    assert main(case.argv(env)) == 2
    assert re.search(case.message, capsys.readouterr().err.strip().splitlines()[-1][len(PREFIX):])


# cases tested outside the parametrised test above: the tests that run them, "module::name" or a name in this module
TESTED_ELSEWHERE = {
    "bench-inputs-checked-first": ["test_cli_errors::test_a_benchmarks_inputs_are_checked_before_any_model_loads"],
    "compile-without-a-compiler": ["test_compile::test_a_compiled_run_without_a_compiler_is_one_line_and_nothing_is_left"],
    "prompt-without-source-on-an-editing-family": ["test_editing::test_a_csv_row_names_several_sources_and_a_text_family_refuses_them"],
    "non-finite-gradients": ["test_non_finite_gradients_skip_steps_then_stop_after_a_checkpoint"],
    "out-of-memory": ["test_out_of_memory_is_one_line_naming_what_to_lower", "test_a_failed_cpu_allocation_is_recognised"],
    "full-disk": ["test_full_disk_during_a_checkpoint_keeps_the_previous_one", "test_full_disk_on_one_file_of_a_checkpoint_names_the_whole_checkpoint",
                  "test_faults::test_a_real_full_disk_stops_with_one_line_keeps_the_last_checkpoint_and_resumes_exactly",
                  "test_faults::test_every_writer_on_a_full_filesystem_raises_disk_full_and_keeps_the_old_file",
                  "test_multiprocess::test_a_full_disk_on_one_process_stops_both_at_the_checkpoint_and_keeps_the_last_one"],
    "dependency-import-failed": ["test_cli_errors::test_a_dependency_that_fails_to_import_is_one_line_naming_it_the_versions_and_the_fix"],
    "resume-falls-back": ["test_faults::test_resume_latest_falls_back_past_a_damaged_checkpoint_and_ends_as_if_never_stopped"],
    "video-frames-not-possible": ["test_wan::test_bad_video_input_is_one_line_before_anything_is_written"],
    "video-reward-without-frames": ["test_wan::test_bad_video_input_is_one_line_before_anything_is_written"],
    "ctrl-c": ["test_crash_resume::test_ctrl_c_stops_after_the_iteration_with_a_checkpoint_and_exit_130",
               "test_multiprocess::test_ctrl_c_on_one_process_stops_both_after_the_same_iteration",
               "test_vlm_judge::test_a_second_ctrl_c_ends_the_process_at_once_while_the_judge_never_answers",
               "test_vlm_judge::test_a_ctrl_c_pair_while_the_first_iteration_compiles_ends_the_process"],
    "reward-hacking": ["test_hacking::test_a_hackable_proxy_is_flagged_and_stopped_and_the_verifier_is_not"],
    "frozen-rank": ["test_multiprocess::test_a_frozen_rank_ends_the_job_with_one_line_naming_it_and_the_run_resumes_exactly",
                    "test_watchdog::test_a_rank_whose_process_ended_on_this_machine_is_named_at_once"],
    "push-hub-unreachable": ["test_push::test_a_hub_that_refuses_the_connection_is_one_line_naming_it"],
    "push-hub-no-answer": ["test_push::test_a_hub_that_never_answers_is_one_line_after_the_timeout"],
    "tracker-not-logged-in": ["test_trackers::test_a_tracker_online_without_credentials_is_one_line_before_anything_is_written"],
    "remote-reward-no-answer": ["test_network::test_a_reward_server_that_never_answers_is_one_line_before_the_run_writes"],
    "hub-no-answer-downloading": ["test_network::test_a_hub_that_never_answers_while_prompts_download_is_one_line"],
    "tracker-no-answer": ["test_network::test_a_wandb_server_that_never_answers_ends_the_run_with_one_line",
                          "test_network::test_a_swanlab_server_that_never_answers_ends_the_run_with_one_line"],
    "model-hub-no-answer": ["test_network::test_a_hub_that_never_answers_while_a_model_loads_is_one_line"],
    "videoalign-release-damaged": ["test_videoalign_release::test_a_damaged_release_is_one_line_naming_its_file"],
    "judge-cannot-score": ["test_vlm_judge::test_a_judge_that_cannot_score_stops_train_before_anything_is_written"],
    "group-rank-of-frames": ["test_video_rewards::test_a_group_reward_of_images_on_a_video_family_is_refused_before_the_model_loads"],
    "judge-answer-impossible": ["test_vlm_judge::test_each_failure_is_one_line_naming_the_url"],
    "ocr-setting-not-allowed": ["test_ocr_reward::test_it_is_listed_and_its_settings_are_checked"],
    "gpu-bench-row-counts": ["test_gpu_bench::test_row_counts_that_are_not_whole_numbers_are_one_line"],
    "data-set-unavailable": ["test_benchmarks::test_a_changed_or_cut_download_is_refused_and_nothing_is_kept",
                             "test_benchmarks::test_offline_or_a_damaged_copy_is_one_line_and_a_damaged_copy_is_fetched_again",
                             "test_benchmarks::test_a_run_whose_prompt_set_cannot_be_fetched_stops_before_the_model_loads"],
    "benchmark-options": ["test_benchmarks::test_bad_benchmark_options_are_one_line_before_the_model_loads"],
}
ALSO_TESTED = {"output-dir-in-use": "test_faults::test_two_runs_started_at_once_on_one_output_dir_one_trains_the_other_stops",
               "fsdp-version-1": "test_sharding::test_settings_come_from_accelerates_fsdp_variables",
               "fsdp-single-process": "test_sharding::test_fsdp_in_a_single_process_or_with_8bit_adam_is_refused_before_the_model_loads",
               "fsdp-compile": "test_compile::test_model_compile_is_applied_by_the_trainer_and_refused_where_it_cannot"}


def _test_exists(name: str) -> bool:
    import importlib

    module, _, function = name.rpartition("::")
    return hasattr(importlib.import_module(module) if module else sys.modules[__name__], function)


def test_the_docs_list_every_case_and_only_those():
    documented = re.findall(r"^### `([a-z0-9-]+)`", DOCS.read_text(), flags=re.M)
    assert len(documented) == len(set(documented)) >= 60
    assert sorted(documented) == sorted([case.id for case in CASES] + list(TESTED_ELSEWHERE))
    for tests in [*TESTED_ELSEWHERE.values(), list(ALSO_TESTED.values())]:
        assert all(_test_exists(name) for name in tests), tests
        assert all(name.rpartition("::")[2] in DOCS.read_text() for name in tests)  # the docs name the test


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(env, capsys, monkeypatch):
    """The disk fills while checkpoint 2 is written: one line, the staging folder removed, checkpoint 1
    and the metrics intact; the run then resumes from checkpoint 1 once there is space."""
    import accelerate.checkpointing

    save = accelerate.checkpointing.save

    def full_disk(obj, path, *args, **kwargs):
        if "iter-000002" in str(path) or "staging-000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(accelerate.checkpointing, "save", full_disk)
    before = snapshot(env.run)
    assert main(env.train("iterations=3", resume=True)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(re.escape(f"{PREFIX}could not write {env.run / 'checkpoints' / 'iter-000002'} (No space left on device: ")
                        + r"[\d.]+ [kMG]?B free, about [\d.]+ kB needed\); "
                        + re.escape(f"the newest complete checkpoint, {env.run / 'checkpoints' / 'iter-000001'}, is intact; "
                                    "free disk space (or pass another output_dir=) and continue with --resume latest"), line), line
    assert sorted(p.name for p in (env.run / "checkpoints").iterdir()) == ["iter-000000", "iter-000001"]
    after = snapshot(env.run)
    unchanged = [name for name in before if name not in ("metrics.jsonl", "config.yaml", ".lock")]  # iterations=3; the lock names this run
    assert all(after[name] == before[name] for name in unchanged)
    monkeypatch.setattr(accelerate.checkpointing, "save", save)
    assert main(env.train("iterations=3", resume=True)) == 0
    assert (env.run / "checkpoints" / "iter-000002").is_dir()


def test_full_disk_on_one_file_of_a_checkpoint_names_the_whole_checkpoint(env, capsys, monkeypatch):
    """The disk fills while the checkpoint's LoRA file is written (its own whole-or-nothing write): the
    line names the checkpoint and the space the whole checkpoint needs (the last one's size), not the
    file's (it said "995.3 kB free, about 263.6 kB needed", the LoRA file's size)."""
    import pathlib

    from branchdiff.runtime.storage import size_text, tree_size

    write_bytes = pathlib.Path.write_bytes

    def full_disk(self, data):
        if self.name.startswith(".pytorch_lora_weights") and "000002" in str(self.parent):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_bytes(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", full_disk)
    whole = size_text(tree_size(env.checkpoint(1)))
    assert main(env.train("iterations=3", resume=True)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"{PREFIX}could not write {env.run / 'checkpoints' / 'iter-000002'} (No space left on device: "), line
    assert f" free, about {whole} needed); the newest complete checkpoint, {env.checkpoint(1)}, is intact" in line, line


def test_non_finite_gradients_skip_steps_then_stop_after_a_checkpoint(env, capsys, monkeypatch):
    """A NaN loss skips the optimizer step (weights and moments untouched, counted); after
    train.max_skipped_steps skips in a row the run stops with one line, after a checkpoint."""
    from branchdiff.objectives.grpo import GRPOPlan

    edge_losses = GRPOPlan.edge_losses

    def nan_losses(self, *args):
        per_edge, *rest = edge_losses(self, *args)
        return (per_edge * float("nan"), *rest)

    monkeypatch.setattr(GRPOPlan, "edge_losses", nan_losses)
    before = snapshot(env.run / "checkpoints" / "iter-000001")
    assert main(env.train("iterations=5", "train.max_skipped_steps=2", "logging.checkpoints_total_limit=5", resume=True)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"{PREFIX}2 optimizer steps in a row had a non-finite loss or gradient (up to iteration 3); the weights before them "
                    "are saved; lower train.learning_rate or check the reward's scale, then start a new run")
    import json

    lines = [json.loads(line) for line in (env.run / "metrics.jsonl").read_text().splitlines()]
    assert [(line["iteration"], line["steps_skipped"], line["optimizer_steps"]) for line in lines[2:]] == [(2, 1, 0), (3, 1, 0)]
    from safetensors.torch import load_file

    lora = "pytorch_lora_weights.safetensors"
    kept, stopped = (load_file(env.run / "checkpoints" / name / lora) for name in ("iter-000001", "iter-000003"))
    assert all(torch.equal(kept[k], stopped[k]) for k in kept)  # skipped steps left the weights as they were
    assert json.loads((env.run / "checkpoints" / "iter-000003" / "trainer_state.json").read_text())["run_state"]["skipped_in_a_row"] == 2
    assert snapshot(env.run / "checkpoints" / "iter-000001") == before


def test_debug_shows_the_traceback(env):
    from branchdiff.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown key 'tree.rots'"):
        main([*env.fresh("tree.rots=2"), "--debug"])


def test_out_of_memory_is_one_line_naming_what_to_lower(env, capsys, monkeypatch):
    """The device's allocator fails in iteration 2's rollout (mocked at the hardware boundary, the
    model's forward): one line naming what to lower and the checkpoint to continue from, exit 2."""
    from branchdiff.models.tiny import TinyAdapter

    forward = TinyAdapter.forward
    calls = []

    def out_of_memory(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:  # iteration 2 rolls out its 3 steps; the first forward of iteration 2's update fails
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.10 GiB")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TinyAdapter, "forward", out_of_memory)
    before = snapshot(env.run)
    assert main(env.train("iterations=4", resume=True)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"{PREFIX}out of memory during training (CUDA out of memory. Tried to allocate 20.00 GiB.")
    assert re.search(r"lower sampling.max_batch or turn on train.gradient_checkpointing or model.offload, and continue from "
                     r".*/iter-00000[123] with --resume latest \(or start a new run with a smaller train.minibatch or prompts.per_iteration\)$", line)
    after = snapshot(env.run)
    assert all(after[name] == data for name, data in before.items() if name.startswith("checkpoints/iter-000001"))


def test_a_failed_cpu_allocation_is_recognised():
    """A real allocation failure: a petabyte tensor, refused at once by the CPU allocator."""
    from branchdiff.errors import is_out_of_memory

    with pytest.raises(RuntimeError) as failure:
        torch.empty(2**50, dtype=torch.uint8)
    assert is_out_of_memory(failure.value)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
