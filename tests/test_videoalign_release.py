"""`branchdiff rewards convert videoalign` (branchdiff/rewards/videoalign_release.py) on a tiny random checkpoint in
VideoReward's release layout, on a base that ties its output embeddings to its input ones (as Qwen2-VL-2B, the
release's base, does): the converted `videoalign` reward equals the release's own inference path, written here from
its code (its reward model's forward: the vision tower's merged features scattered at the video tokens, the language
model called without position ids, which numbers the tokens 0, 1, 2, ... as the transformers it shipped with did, its
special-token head; its LoRA loading, its frame sampling at 2 frames a second and its resize into the pixel budget,
its prompt template, right padding, its standardisation), on the same videos, to 1e-5. Both checkpoint forms (LoRA
with the other trained weights; the whole model) convert alike. A damaged release is one line naming its file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from branchdiff.cli import main
from branchdiff.rewards.registry import build_reward
from tiny_pipelines import tiny_qwen2_vl

TOKENS = ["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]
EXCLUDED = ["lm_head", "rm_head", "embed_tokens", "visual"]  # the release's lora_namespan_exclude
TEMPLATE = 'Rate the clip made for "{text_prompt}". Visual: <|VQ_reward|>\nEND\nMotion: <|MQ_reward|>\nEND\nAlignment: <|TA_reward|>\nEND\n'
PROMPTS = ["a fox runs", "two birds fly over a long river at dusk, the camera follows them", "rain"]
MEAN, STD = {"VQ": 0.3, "MQ": -1.5, "TA": 2.0}, {"VQ": 1.5, "MQ": 0.25, "TA": 3.0}
VIDEO_FPS = 8.0


def _release_model_class():
    from transformers import Qwen2VLForConditionalGeneration

    class ReleaseRewardModel(Qwen2VLForConditionalGeneration):
        """The release's reward model, from its trainer.py (Qwen2VLRewardModelBT.forward), with today's module names:
        a bias-free head (output_dim rows) on the language model's last hidden state, read at the three special tokens
        of each sequence in their order; output_dim 3 reads row d at the d-th token. Logits (B, 3)."""

        def __init__(self, config, special_token_ids=None, output_dim=1):
            super().__init__(config)
            self.rm_head = torch.nn.Linear(config.text_config.hidden_size, output_dim, bias=False)
            self.special_token_ids, self.output_dim = special_token_ids, output_dim

        def reward_logits(self, input_ids, attention_mask, pixel_values_videos, video_grid_thw) -> torch.Tensor:
            inner = self.model
            embeds = inner.language_model.embed_tokens(input_ids)  # (B, L, D)
            video = inner.visual(pixel_values_videos.type(inner.visual.get_dtype()), grid_thw=video_grid_thw).pooler_output  # (N, D) merged
            video_places = (input_ids == self.config.video_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(video_places, video.to(embeds.dtype))
            hidden = inner.language_model(input_ids=None, position_ids=None, attention_mask=attention_mask, inputs_embeds=embeds)[0]
            logits = self.rm_head(hidden)  # (B, L, N)
            mask = torch.zeros_like(input_ids, dtype=torch.bool)
            for token in self.special_token_ids:
                mask |= input_ids == token
            pooled = logits[mask].view(len(hidden), 3, -1)  # (B, 3, N)
            if self.output_dim == 3:
                pooled = pooled.diagonal(dim1=1, dim2=2)
            return pooled.reshape(len(hidden), -1)

    return ReleaseRewardModel


def _old_layout(key: str) -> str:
    """A key as the release's transformers (4.4x) named it: the text model under model., the vision tower under visual."""
    return key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")


def _new_layout(key: str) -> str:
    key = key.replace("base_model.model.model.", "base_model.model.model.language_model.", 1) if ".model.model." in key else key
    return key.replace("base_model.model.visual.", "base_model.model.model.visual.")


def _release_model(base: Path, rank: int, alpha: int):
    """The base with the three tokens and the release's LoRA (every Linear outside the excluded names), as its
    create_model_and_processor builds it: (peft model, processor, the tokens' ids)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(base, padding_side="right")
    processor.tokenizer.add_special_tokens({"additional_special_tokens": TOKENS})
    ids = processor.tokenizer.convert_tokens_to_ids(TOKENS)
    plain = Qwen2VLForConditionalGeneration.from_pretrained(base)  # (a subclass would miss transformers' renaming of the saved keys)
    model = _release_model_class()(plain.config, special_token_ids=ids)
    assert model.load_state_dict(plain.state_dict(), strict=False).missing_keys == ["rm_head.weight"]
    model.resize_token_embeddings(len(processor.tokenizer))
    targets = [name for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and not any(word in name for word in EXCLUDED)]
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets, r=rank, lora_alpha=alpha, lora_dropout=0.05, bias="none",
                                                  task_type="CAUSAL_LM"))
    return peft_model, processor, ids


def _write_release(folder: Path, base: Path, whole: bool) -> None:
    """A trained tiny release: random LoRA B factors, head and reward-token embeddings; `whole`: checkpoint-5/model.pth
    (the whole model's state), else checkpoint-3/adapter_model.safetensors and non_lora_state_dict.pth."""
    torch.manual_seed(7)
    model, _, ids = _release_model(base, rank=4, alpha=8)
    state = model.state_dict()
    for key in state:
        if "lora_B" in key or "rm_head" in key:
            state[key] = torch.randn_like(state[key]) * 0.5
    embed = next(k for k in state if k.endswith("embed_tokens.weight"))
    state[embed][ids] = torch.randn(3, state[embed].shape[1])
    model.load_state_dict(state)
    named = {_old_layout(k): v.clone() for k, v in model.state_dict().items()}
    if whole:
        (folder / "checkpoint-5").mkdir(parents=True)
        torch.save(named, folder / "checkpoint-5" / "model.pth")
    else:
        (folder / "checkpoint-3").mkdir(parents=True)
        lora = {k.replace(".default", ""): v for k, v in named.items() if "lora_" in k}
        save_file(lora, str(folder / "checkpoint-3" / "adapter_model.safetensors"))
        trained = {k: v for k, v in named.items() if k.endswith(("rm_head.weight", "embed_tokens.weight"))}
        torch.save(trained, folder / "checkpoint-3" / "non_lora_state_dict.pth")
    (folder / "model_config.json").write_text(json.dumps({
        "data_config": {"meta_data": "train.csv", "data_dir": "videos", "max_frame_pixels": 240 * 320, "num_frames": None, "fps": 2.0,
                        "eval_dim": ["VQ", "MQ", "TA"], "prompt_template_type": "detailed_special", "sample_type": "uniform"},
        "model_config": {"model_name_or_path": str(base), "output_dim": 1, "use_special_tokens": True, "reward_token": "special",
                         "torch_dtype": "float32"},
        "peft_lora_config": {"lora_enable": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.05, "use_rslora": False,
                             "lora_namespan_exclude": EXCLUDED, "lora_task_type": "CAUSAL_LM", "num_lora_modules": -1},
        "inference_config": {**{f"{d}_mean": v for d, v in MEAN.items()}, **{f"{d}_std": v for d, v in STD.items()}}}))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = tmp_path_factory.mktemp("videoreward")
    model, processor = tiny_qwen2_vl([], seed=1, tied=True)
    model.save_pretrained(folder / "base")
    processor.save_pretrained(folder / "base")
    _write_release(folder / "lora", folder / "base", whole=False)
    _write_release(folder / "whole", folder / "base", whole=True)
    (folder / "prompt_template.py").write_text(f'OTHER = "no tokens"\nDETAILED_PROMPT_WITH_SPECIAL_TOKEN = """{TEMPLATE}"""\n')
    return folder


def _release_scores(release_dir: Path, base: Path, videos: torch.Tensor) -> dict[str, torch.Tensor]:
    """The release's inference.py on these videos: its loader (adapter name inserted, state updated), frames at 2 per
    second of a clip playing at VIDEO_FPS, resized by its vision_process rule, its template, right padding, its norm."""
    from torchvision.transforms.functional import InterpolationMode, resize

    settings = json.loads((release_dir / "model_config.json").read_text())
    model, processor, ids = _release_model(base, rank=4, alpha=8)
    checkpoint = release_dir / "checkpoint-3"
    lora = {_new_layout(k).replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
            for k, v in load_file(str(checkpoint / "adapter_model.safetensors")).items()}
    others = {_new_layout(k): v for k, v in torch.load(checkpoint / "non_lora_state_dict.pth", weights_only=True).items()}
    state = model.state_dict()
    assert set(lora) | set(others) <= set(state)
    state.update(others)
    state.update(lora)
    model.load_state_dict(state)
    model.eval()
    # 9 frames at 8 a second are 1.125 s: 2.25 frames at 2 a second, raised to the minimum of 4, at round(linspace(0, 8, 4));
    # 24×40 frames are 28×28 at the nearest multiples of 28, below 128·28·28 pixels: scaled up by √(100352 / 960) and rounded up
    assert videos.shape[1:] == (9, 3, 24, 40)
    picked = (videos[:, [0, 3, 5, 8]] * 255).round().to(torch.uint8)
    frames = [resize(clip, [252, 420], interpolation=InterpolationMode.BICUBIC, antialias=True).float() for clip in picked]
    chats = [[{"role": "user", "content": [{"type": "video", "video": "clip.mp4", "max_pixels": 240 * 320, "fps": 2.0, "sample_type": "uniform"},
                                           {"type": "text", "text": TEMPLATE.format(text_prompt=prompt)}]}] for prompt in PROMPTS]
    batch = processor(text=processor.apply_chat_template(chats, tokenize=False, add_generation_prompt=True), videos=frames, padding=True,
                      return_tensors="pt", videos_kwargs={"do_rescale": True})
    with torch.no_grad():
        logits = model.base_model.model.reward_logits(batch["input_ids"], batch["attention_mask"], batch["pixel_values_videos"],
                                                      batch["video_grid_thw"])  # (B, 3)
        stock = model.base_model.model.model(**batch).last_hidden_state  # Qwen2-VL's own forward: 3-D M-RoPE positions
    tokens = torch.isin(batch["input_ids"], torch.tensor(ids))
    stock_logits = model.base_model.model.rm_head(stock)[tokens].view(len(PROMPTS), 3)
    assert (stock_logits - logits).abs().max() > 1e-3  # the positions matter here: a reward on the stock forward would fail below
    norm = settings["inference_config"]
    scores = {d: (logits[:, i] - norm[f"{d}_mean"]) / norm[f"{d}_std"] for i, d in enumerate(["VQ", "MQ", "TA"])}
    return {**scores, "overall": scores["VQ"] + scores["MQ"] + scores["TA"]}


def test_the_converted_release_scores_as_the_releases_own_inference(release, tmp_path, capsys):
    converted = tmp_path / "videoalign"
    assert main(["rewards", "convert", "videoalign", str(release / "lora"), str(converted), "--template", str(release / "prompt_template.py")]) == 0
    assert "wrote" in capsys.readouterr().out
    torch.manual_seed(3)
    videos = torch.rand(3, 9, 3, 24, 40)
    reward = build_reward("videoalign", "cpu", {"path": str(converted), "video_fps": VIDEO_FPS, "batch_size": 2})
    scores = reward.score(videos, PROMPTS)
    expected = _release_scores(release / "lora", release / "base", videos)
    for key in ("VQ", "MQ", "TA", "overall"):
        assert torch.allclose(scores[key], expected[key], rtol=0, atol=1e-5), (key, scores[key], expected[key])
    assert expected["overall"].std() > 0.01  # the videos and prompts score differently: order and padding matter
    # the whole-model form of the same weights converts to the same folder
    whole = tmp_path / "whole"
    assert main(["rewards", "convert", "videoalign", str(release / "whole"), str(whole), "--template", str(release / "prompt_template.py"),
                 "--base", str(release / "base")]) == 0
    a, b = load_file(str(converted / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    differ = [k for k in a if not torch.allclose(a[k], b[k], atol=1e-6)]
    assert a.keys() == b.keys() and not differ and "lm_head.weight" not in a, differ  # tied: the output embeddings are the input ones


def test_a_folder_that_is_not_the_release_is_one_line(release, tmp_path, capsys):
    template = str(release / "prompt_template.py")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    (tmp_path / "plain.txt").write_text("no tokens here {text_prompt}")
    bare = tmp_path / "bare"
    shutil.copytree(release / "lora", bare)
    shutil.rmtree(bare / "checkpoint-3")
    cases = [
        ([str(tmp_path), str(tmp_path / "a"), "--template", template], "no model_config.json; expected VideoReward's release folder"),
        ([str(release / "lora"), str(tmp_path / "taken"), "--template", template], "is not empty; give a new folder"),
        ([str(release / "lora"), str(tmp_path / "b"), "--template", str(tmp_path / "plain.txt")], "the template must hold {text_prompt} and each of"),
        ([str(release / "lora"), str(tmp_path / "c"), "--template", str(tmp_path / "none.py")], "no such file"),
        ([str(bare), str(tmp_path / "d"), "--template", template], "no checkpoint-N folder"),
        ([str(release / "lora"), str(tmp_path / "e"), "--template", template, "--step", "4"], "no checkpoint-4; it holds checkpoint-3"),
    ]
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "model_config.json").write_text("[1, 2]")
    nameless = tmp_path / "nameless"
    shutil.copytree(release / "lora", nameless)
    settings = json.loads((nameless / "model_config.json").read_text())
    del settings["model_config"]["model_name_or_path"]
    (nameless / "model_config.json").write_text(json.dumps(settings))
    other_base = tmp_path / "other-base"
    shutil.copytree(release / "base", other_base)
    weights = load_file(str(other_base / "model.safetensors"))
    save_file({k.replace("model.embed_tokens.", "model.token_table."): v for k, v in weights.items()}, str(other_base / "model.safetensors"))
    cases += [
        ([str(tmp_path / "list"), str(tmp_path / "f"), "--template", template], "expected an object with the sections"),
        ([str(nameless), str(tmp_path / "g"), "--template", template], "names no base model (model_config.model_name_or_path); give its local"),
        ([str(release / "lora"), str(tmp_path / "h"), "--template", template, "--base", str(other_base)],
         f"{release / 'lora' / 'checkpoint-3' / 'non_lora_state_dict.pth'}: 1 trained weights have no counterpart in the base"),
    ]
    for arguments, words in cases:
        assert main(["rewards", "convert", "videoalign", *arguments]) != 0
        error = capsys.readouterr().err.strip()
        assert words in error and len(error.splitlines()) == 1, error
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine" and not (tmp_path / "a").exists()


def test_a_failed_write_leaves_nothing_and_a_converted_folder_refuses_num_frames(release, tmp_path, monkeypatch):
    import branchdiff.rewards.videoalign_release as conversion

    writes = []

    def full_disk(tensors, path, **kwargs):
        writes.append(path)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return save_file(tensors, path, **kwargs)

    monkeypatch.setattr(conversion, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        conversion.convert_videoalign(release / "lora", tmp_path / "out", release / "prompt_template.py")
    assert len(writes) == 2 and not (tmp_path / "out").exists()
    monkeypatch.undo()
    conversion.convert_videoalign(release / "lora", tmp_path / "out", release / "prompt_template.py")
    with pytest.raises(ValueError, match=r"is a converted release, which reads its frames by its own rule .*leave num_frames out"):
        build_reward("videoalign", "cpu", {"path": str(tmp_path / "out"), "num_frames": 4})


def test_a_damaged_release_is_one_line_naming_its_file(release, tmp_path, capsys):
    """Each damage a download or an edit can do: one line naming the file (and key), nothing written."""
    template = release / "prompt_template.py"

    def copy(name: str, form: str = "lora") -> Path:
        shutil.copytree(release / form, tmp_path / name)
        return tmp_path / name

    rank_zero = copy("rank-zero")
    settings = json.loads((rank_zero / "model_config.json").read_text())
    settings["peft_lora_config"]["lora_r"] = 0
    (rank_zero / "model_config.json").write_text(json.dumps(settings))
    truncated_adapter = copy("truncated-adapter")
    adapter = truncated_adapter / "checkpoint-3" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])
    truncated_whole = copy("truncated-whole", "whole")
    whole = truncated_whole / "checkpoint-5" / "model.pth"
    whole.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    misshapen = copy("misshapen")
    others = torch.load(misshapen / "checkpoint-3" / "non_lora_state_dict.pth", weights_only=True)
    embed = next(k for k in others if k.endswith("embed_tokens.weight"))
    others[embed] = others[embed][:, :16].clone()
    torch.save(others, misshapen / "checkpoint-3" / "non_lora_state_dict.pth")
    wrong_rank = copy("wrong-rank")
    factors = load_file(str(wrong_rank / "checkpoint-3" / "adapter_model.safetensors"))
    a_key = next(k for k in factors if ".lora_A." in k)
    factors[a_key] = factors[a_key][:2].clone()
    save_file(factors, str(wrong_rank / "checkpoint-3" / "adapter_model.safetensors"))
    three_heads = copy("three-heads")
    settings = json.loads((three_heads / "model_config.json").read_text())
    settings["model_config"]["output_dim"] = 3
    (three_heads / "model_config.json").write_text(json.dumps(settings))
    headless = copy("headless")
    others = torch.load(headless / "checkpoint-3" / "non_lora_state_dict.pth", weights_only=True)
    torch.save({k: v for k, v in others.items() if not k.endswith("rm_head.weight")}, headless / "checkpoint-3" / "non_lora_state_dict.pth")
    no_b = copy("no-b")
    factors = load_file(str(no_b / "checkpoint-3" / "adapter_model.safetensors"))
    save_file({k: v for k, v in factors.items() if k != a_key.replace(".lora_A.", ".lora_B.")}, str(no_b / "checkpoint-3" / "adapter_model.safetensors"))
    grown = copy("grown")
    others = torch.load(grown / "checkpoint-3" / "non_lora_state_dict.pth", weights_only=True)
    others[embed] = torch.cat([others[embed], others[embed][-1:]])  # one row more than the base's tokenizer and the reward tokens
    torch.save(others, grown / "checkpoint-3" / "non_lora_state_dict.pth")
    text_mean = copy("text-mean")  # "could not convert string to float: 'abc'" named neither the file nor the key, after the model was written
    settings = json.loads((text_mean / "model_config.json").read_text())
    settings.setdefault("inference_config", {})["VQ_mean"] = "abc"
    (text_mean / "model_config.json").write_text(json.dumps(settings))
    (tmp_path / "broken.py").write_text('DETAILED_PROMPT_WITH_SPECIAL_TOKEN = """unterminated\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 {text_prompt}".encode("latin-1"))
    cases = [
        (rank_zero, template, "peft_lora_config.lora_r = 0: a LoRA has rank ≥ 1"),
        (text_mean, template, f"{text_mean / 'model_config.json'}: inference_config.VQ_mean is 'abc'; the release writes a number there"),
        (truncated_adapter, template, f"{adapter} could not be read (SafetensorError"),
        (truncated_whole, template, f"{whole} could not be read ("),
        (misshapen, template, "non_lora_state_dict.pth: 'model.embed_tokens.weight' is (266, 16) and the base"),
        (wrong_rank, template, f"adapter_model.safetensors: the LoRA of {a_key.split('.lora_A.')[0].removeprefix('base_model.model.')!r} has A (2, "),
        (three_heads, template, "non_lora_state_dict.pth: 'rm_head.weight' is (1, 32); model_config's output_dim 3"),
        (headless, template, f"{headless / 'checkpoint-3'}: the checkpoint holds no rm_head.weight or model.embed_tokens.weight"),
        (no_b, template, f"{no_b / 'checkpoint-3' / 'adapter_model.safetensors'}: the LoRA of {a_key.split('.lora_A.')[0].removeprefix('base_model.model.')!r} has no base weight "),
        (grown, template, f"{grown / 'checkpoint-3'}: 'model.embed_tokens.weight' holds 267 tokens, the base's tokenizer with the reward tokens 266"),
        (release / "lora", tmp_path / "broken.py", f"--template {tmp_path / 'broken.py'} is not valid Python (line 1: "),
        (release / "lora", tmp_path / "latin1.txt", "is not UTF-8 text"),
    ]
    for number, (source, template_file, words) in enumerate(cases):
        destination = tmp_path / f"out-{number}"
        arguments = ["rewards", "convert", "videoalign", str(source), str(destination), "--template", str(template_file)]
        assert main([*arguments, "--base", str(release / "base")]) == 2
        error = capsys.readouterr().err.strip()
        assert words in error and len(error.splitlines()) == 1, (words, error)
        assert not destination.exists()
