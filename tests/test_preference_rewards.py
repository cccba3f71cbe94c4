"""Preference rewards (hpsv2/hpsv2.1, pickscore, clip-score, aesthetic, imagereward) on tiny randomly
initialised models of the real classes, saved in the reference formats and loaded through the
rewards' own loading code. Each score is checked against a computation written out here from the
models' raw forward pieces; nothing is downloaded (the hub is forced offline)."""

from __future__ import annotations

import json
import math
import os
import sys
from argparse import Namespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as TF
from PIL import Image

from branchdiff.rewards.aesthetic import AestheticReward
from branchdiff.rewards.clip_score import CLIPScoreReward
from branchdiff.rewards.hps import HPSReward, hps_preprocess, hpsv2, hpsv2_1
from branchdiff.rewards.imagereward import ImageRewardReward
from branchdiff.rewards.model_reward import MissingWeightsError
from branchdiff.rewards.pickscore import PickScoreReward

CLIP_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(3, 1, 1)
CLIP_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(3, 1, 1)
TINY_OPEN_CLIP = "branchdiff-test-tiny-vit"  # registered with open_clip by the fixture below
TINY_OPEN_CLIP_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
PROMPTS = ["a red circle", "two blue squares on the left", "a photo of a cat", "an anime girl, concept art",
           "x", "a green triangle at the bottom", "three yellow circles", "a painting of a harbour at dusk"]


@pytest.fixture(autouse=True)
def offline_hub(monkeypatch):
    """No test may reach a model hub, whatever imported huggingface_hub first."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def random_images(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def quantised_pil(image: torch.Tensor) -> Image.Image:
    """The 8-bit picture a user would save: round(x · 255)."""
    return Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


# ---------------------------------------------------------------- HPS (open_clip)


@pytest.fixture(scope="module")
def hps_checkpoint(tmp_path_factory):
    """A tiny open_clip CLIP saved as the HPS release files are: torch.save({"state_dict": ...})."""
    import open_clip

    folder = tmp_path_factory.mktemp("hps")
    (folder / f"{TINY_OPEN_CLIP}.json").write_text(json.dumps(TINY_OPEN_CLIP_CONFIG))
    open_clip.add_model_config(folder / f"{TINY_OPEN_CLIP}.json")
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_OPEN_CLIP).eval()
    for file in ("HPS_v2.1_compressed.pt", "HPS_v2_compressed.pt"):
        torch.save({"state_dict": model.state_dict(), "epoch": 3, "name": "tiny"}, folder / file)
    return folder, model


@pytest.fixture(scope="module")
def hps(hps_checkpoint):
    folder, _ = hps_checkpoint
    return HPSReward(version="v2.1", checkpoint=folder / "HPS_v2.1_compressed.pt", architecture=TINY_OPEN_CLIP, batch_size=3)


def reference_hps_pixels(image: torch.Tensor) -> torch.Tensor:
    """The hpsv2 evaluation transform written out with torchvision on the saved PIL image: ToTensor,
    longest side to 224 (bicubic), zero pad to 224×224 centred (pad // 2 first), then Normalize."""
    picture = quantised_pil(image)
    width, height = picture.size
    new_height, new_width = round(height * 224 / max(height, width)), round(width * 224 / max(height, width))
    pad_h, pad_w = 224 - new_height, 224 - new_width
    transform = T.Compose([
        T.ToTensor(),
        T.Resize([new_height, new_width], interpolation=T.InterpolationMode.BICUBIC, antialias=True),
        T.Pad([pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0),
        T.Normalize(CLIP_MEAN.flatten().tolist(), CLIP_STD.flatten().tolist()),
    ])
    return transform(picture)


def test_hps_checkpoint_in_reference_format_loads(hps_checkpoint, hps):
    _, saved = hps_checkpoint
    loaded = hps.model.state_dict()
    assert loaded.keys() == saved.state_dict().keys()
    for key, value in saved.state_dict().items():
        assert torch.equal(loaded[key], value), key
    assert not hps.model.training and not any(p.requires_grad for p in hps.model.parameters())
    assert (hps.name, hps.higher_is_better, hps.device) == ("hpsv2.1", True, torch.device("cpu"))
    assert "cosine" in hps.scale and "100" in hps.scale


def test_hps_versions_find_their_file_in_a_folder(hps_checkpoint):
    folder, _ = hps_checkpoint
    v2 = hpsv2(checkpoint=folder, architecture=TINY_OPEN_CLIP)  # the registered factories
    assert v2.name == "hpsv2" and hpsv2_1.__name__ == "hpsv2_1"
    with pytest.raises(ValueError, match="v2.0, v2.1"):
        HPSReward(version="v3", checkpoint=folder, architecture=TINY_OPEN_CLIP)


def test_hps_score_is_the_cosine_of_the_reference_pipeline(hps_checkpoint, hps):
    _, model = hps_checkpoint
    images = random_images(4, 96, 64)
    prompts = PROMPTS[:4]
    pixels = torch.stack([reference_hps_pixels(image) for image in images])  # (4, 3, 224, 224)
    tokens = open_clip_tokens(prompts)
    with torch.no_grad():
        image_features = model.encode_image(pixels)
        text_features = model.encode_text(tokens)
    expected = (image_features / image_features.norm(dim=-1, keepdim=True) * (text_features / text_features.norm(dim=-1, keepdim=True))).sum(-1)
    scores = hps(images, prompts, [{}] * 4)
    assert scores.shape == (4,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)
    assert scores.abs().max() > 1e-3  # a non-trivial comparison


def open_clip_tokens(prompts: list[str]) -> torch.Tensor:
    import open_clip

    return open_clip.tokenize(prompts, context_length=TINY_OPEN_CLIP_CONFIG["text_cfg"]["context_length"])


def scores_at_batch_sizes(reward, images: torch.Tensor, prompts: list[str], sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """The reward's scores computed with each batch size in turn (one loaded model)."""
    original, results = reward.batch_size, []
    try:
        for size in sizes:
            reward.batch_size = size
            results.append(reward(images, prompts, [{}] * len(prompts)))
    finally:
        reward.batch_size = original
    return results


def test_hps_scores_do_not_depend_on_batch_size(hps):
    images, prompts = random_images(5, 80, 120, seed=1), PROMPTS[:5]
    one, two, all_at_once = scores_at_batch_sizes(hps, images, prompts, (1, 2, 5))
    assert one.shape == all_at_once.shape == (5,)
    torch.testing.assert_close(one, all_at_once, rtol=0, atol=1e-6)
    torch.testing.assert_close(two, all_at_once, rtol=0, atol=1e-6)


def test_rewards_refuse_images_that_do_not_match_the_protocol(hps):
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        hps(torch.rand(2, 4, 32, 32), PROMPTS[:2], [{}, {}])
    with pytest.raises(ValueError, match="3 images for 2 prompts"):
        hps(torch.rand(3, 3, 32, 32), PROMPTS[:2], [{}, {}])
    assert hps(torch.rand(0, 3, 32, 32), [], []).shape == (0,)


@pytest.mark.parametrize(("height", "width", "left", "top", "content_h", "content_w"), [
    (100, 50, 56, 0, 224, 112),   # portrait: pad left and right, 56 each
    (50, 100, 0, 56, 112, 224),   # landscape: pad top and bottom
    (100, 47, 59, 0, 224, 105),   # odd padding 119: 59 left, 60 right
])
def test_hps_preprocess_pads_the_longest_side_to_224_and_crops_nothing(height, width, left, top, content_h, content_w):
    image = torch.full((1, 3, height, width), 0.6)
    image[:, :, :10, :] = 1.0  # a white band on the top rows: cropping would cut it away
    pixels = hps_preprocess(image)[0]  # (3, 224, 224)
    assert pixels.shape == (3, 224, 224)
    pad_value = (0 - CLIP_MEAN) / CLIP_STD  # black padding added BEFORE normalisation
    content = pixels[:, top : top + content_h, left : left + content_w]
    mask = torch.ones(224, 224, dtype=torch.bool)
    mask[top : top + content_h, left : left + content_w] = False
    torch.testing.assert_close(pixels[:, mask], pad_value.view(3, 1).expand(3, int(mask.sum())), rtol=0, atol=1e-5)
    middle = content[:, content_h // 2 :, :]
    torch.testing.assert_close(middle, ((0.6 - CLIP_MEAN) / CLIP_STD).expand_as(middle), rtol=0, atol=1e-4)
    white = (1.0 - CLIP_MEAN) / CLIP_STD
    band = round(10 * content_h / height)  # the white band, scaled with the image (22 rows at 2.24×)
    inside = content[:, 2 : band - 6, 2:-2]  # away from the bicubic transition at its lower edge
    torch.testing.assert_close(inside, white.expand_as(inside), rtol=0, atol=2e-2)
    # the first padded column/row next to the content is padding, the first content one is not
    if left:
        assert torch.allclose(pixels[:, 100, left - 1], pad_value.flatten(), atol=1e-5)
        assert not torch.allclose(pixels[:, 100, left], pad_value.flatten(), atol=1e-2)


def test_hps_refuses_checkpoints_that_are_not_plain_tensors(tmp_path):
    torch.save({"state_dict": {}, "args": Namespace(lr=1e-3)}, tmp_path / "HPS_v2.1_compressed.pt")
    with pytest.raises(ValueError, match="not an open_clip") as error:
        HPSReward(checkpoint=tmp_path, architecture=TINY_OPEN_CLIP)
    assert "\n" not in str(error.value)


def test_hps_missing_weights_is_one_line_naming_path_and_source(tmp_path, hps_checkpoint):
    missing = tmp_path / "nowhere" / "HPS_v2.1_compressed.pt"
    with pytest.raises(MissingWeightsError) as error:
        HPSReward(checkpoint=missing, architecture=TINY_OPEN_CLIP)
    message = str(error.value)
    assert str(missing) in message and "huggingface.co/xswu/HPSv2" in message and "\n" not in message
    with pytest.raises(MissingWeightsError) as error:  # the default hub id, offline
        HPSReward(architecture=TINY_OPEN_CLIP)
    assert "xswu/HPSv2" in str(error.value) and "HPS_v2.1_compressed.pt" in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------- transformers CLIP (PickScore, CLIP score, aesthetic)


def tiny_clip_tokenizer(merges: int = 300):
    """A transformers CLIPTokenizer from the first BPE merges of open_clip's shipped vocabulary
    (offline: no hub download), as branchdiff.models.tiny does without importing diffusers."""
    import gzip
    from pathlib import Path

    import open_clip
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPTokenizer

    lines = gzip.open(Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz").read().decode("utf-8").split("\n")
    pairs = [tuple(line.split()) for line in lines[1 : 1 + merges]]
    byte_tokens = list(bytes_to_unicode().values())
    tokens = byte_tokens + [t + "</w>" for t in byte_tokens] + ["".join(pair) for pair in pairs] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={token: index for index, token in enumerate(tokens)}, merges=pairs)


@pytest.fixture(scope="module")
def hf_clip(tmp_path_factory):
    """A tiny transformers CLIPModel and CLIPProcessor, saved with save_pretrained like the hub repos."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = tiny_clip_tokenizer()
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=224, patch_size=32),
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(37.0))  # not the init value: the score must use the model's own
    folder = tmp_path_factory.mktemp("hf-clip")
    model.save_pretrained(folder / "model")
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer).save_pretrained(folder / "processor")
    return folder, model, tokenizer


def reference_clip_embeddings(
    model, tokenizer, images: torch.Tensor, prompts: list[str], resize: str = "torchvision"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised image and text embeddings written out: the saved 8-bit picture resized to 224 on
    its shortest side (bicubic, antialiased) by torchvision's uint8 kernel (what transformers 5's
    processor runs) or by PIL (what the references' processors ran; the two differ by 1–2 levels on
    <1% of pixels); centre crop 224; /255; CLIP mean/std; ViT pooled output -> visual projection;
    text EOS state -> text projection."""
    pixels = []
    for image in images:
        picture = quantised_pil(image)
        width, height = picture.size
        size = (224, int(224 * height / width)) if width <= height else (int(224 * width / height), 224)  # (w, h)
        if resize == "pil":
            resized = torch.from_numpy(np.array(picture.resize(size, Image.BICUBIC))).permute(2, 0, 1)  # (3, h, w) uint8
        else:
            as_tensor = torch.from_numpy(np.array(picture)).permute(2, 0, 1)
            resized = TF.resize(as_tensor, [size[1], size[0]], interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
        pixels.append((TF.center_crop(resized, [224, 224]).float() / 255 - CLIP_MEAN) / CLIP_STD)
    tokens = tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image_embeds = model.visual_projection(model.vision_model(pixel_values=torch.stack(pixels)).pooler_output)
        text_embeds = model.text_projection(model.text_model(**tokens).pooler_output)
    return image_embeds / image_embeds.norm(dim=-1, keepdim=True), text_embeds / text_embeds.norm(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def pickscore(hf_clip):
    folder, _, _ = hf_clip
    return PickScoreReward(model=folder / "model", processor=folder / "processor", batch_size=3)


@pytest.fixture(scope="module")
def clip_score(hf_clip):
    folder, _, _ = hf_clip
    return CLIPScoreReward(model=folder / "model", processor=folder / "processor", batch_size=8)


def test_pickscore_is_logit_scale_exp_times_cosine(hf_clip, pickscore):
    folder, model, tokenizer = hf_clip
    reward = pickscore
    images, prompts = random_images(5, 96, 160, seed=2), PROMPTS[:5]
    image_embeds, text_embeds = reference_clip_embeddings(model, tokenizer, images, prompts)
    expected = 37.0 * (image_embeds * text_embeds).sum(-1)
    scores = reward(images, prompts, [{}] * 5)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-4)
    image_embeds, text_embeds = reference_clip_embeddings(model, tokenizer, images, prompts, resize="pil")
    torch.testing.assert_close(scores, 37.0 * (image_embeds * text_embeds).sum(-1), rtol=0, atol=1e-2)  # PIL-resized reference
    assert scores.abs().max() > 0.1
    assert (reward.name, reward.higher_is_better) == ("pickscore", True) and "logit_scale" in reward.scale


def test_clip_score_is_100_times_the_positive_part_of_the_cosine(hf_clip, clip_score):
    folder, model, tokenizer = hf_clip
    reward = clip_score
    images, prompts = random_images(8, 64, 64, seed=3), PROMPTS
    image_embeds, text_embeds = reference_clip_embeddings(model, tokenizer, images, prompts)
    cosine = (image_embeds * text_embeds).sum(-1)
    assert (cosine < 0).any() and (cosine > 0).any()  # both branches of max(cos, 0) are exercised
    scores = reward(images, prompts, [{}] * 8)
    torch.testing.assert_close(scores, 100 * torch.where(cosine > 0, cosine, torch.zeros_like(cosine)), rtol=0, atol=1e-4)
    assert reward.name == "clip-score" and "100·max(cosine, 0)" in reward.scale


def test_clip_consistency_is_the_mean_cosine_of_adjacent_frames_embeddings(hf_clip):
    """clip-consistency against the written-out embeddings of every frame: the mean of <e_t, e_t−1>; the
    same at any batch size; a still video scores 1, a one-frame video 1; images are refused in one line."""
    from branchdiff.rewards.clip_consistency import CLIPConsistencyReward

    folder, model, tokenizer = hf_clip
    videos = random_images(3 * 4, 48, 80, seed=5).view(3, 4, 3, 48, 80)  # (B, F, 3, H, W)
    videos[2] = videos[2, :1]  # a still video
    frames, _ = reference_clip_embeddings(model, tokenizer, videos.flatten(0, 1), ["x"] * 12)
    frames = frames.view(3, 4, -1)
    expected = torch.stack([sum((frames[b, t] * frames[b, t - 1]).sum() for t in range(1, 4)) / 3 for b in range(3)])
    for batch_size in (1, 5, 16):
        reward = CLIPConsistencyReward(model=folder / "model", processor=folder / "processor", batch_size=batch_size)
        scores = reward(videos, PROMPTS[:3])
        torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)
    assert scores[:2].max() < 0.999 and abs(scores[2].item() - 1) < 1e-5
    assert torch.equal(reward(videos[:, :1], PROMPTS[:3]), torch.ones(3))
    assert (reward.name, reward.higher_is_better, reward.video) == ("clip-consistency", True, True)
    with pytest.raises(ValueError, match=r"scores videos \(B, F, 3, H, W\), got \(3, 3, 48, 80\)"):
        reward(videos[:, 0], PROMPTS[:3])


@pytest.mark.parametrize("reward", ["pickscore", "clip_score", "aesthetic"])
def test_clip_rewards_do_not_depend_on_batch_size(request, reward):
    reward = request.getfixturevalue(reward)
    images, prompts = random_images(6, 120, 90, seed=4), PROMPTS[:6]
    one, four, all_at_once = scores_at_batch_sizes(reward, images, prompts, (1, 4, 6))
    assert one.shape == (6,)
    tolerance = 1e-6 * max(1.0, all_at_once.abs().max().item())  # ~1e-6 relative to the score's scale (≈ 37 or 100 here)
    torch.testing.assert_close(one, all_at_once, rtol=0, atol=tolerance)
    torch.testing.assert_close(four, all_at_once, rtol=0, atol=tolerance)


@pytest.fixture(scope="module")
def aesthetic_mlp(tmp_path_factory):
    """An MLP with the predictor's layers, saved as its .pth is: a plain state dict."""
    from branchdiff.rewards.aesthetic import AestheticMLP

    torch.manual_seed(1)
    mlp = AestheticMLP(embed_dim=16)
    path = tmp_path_factory.mktemp("aesthetic") / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(mlp.state_dict(), path)
    return path, {key: value.clone() for key, value in mlp.state_dict().items()}


@pytest.fixture(scope="module")
def aesthetic(hf_clip, aesthetic_mlp):
    folder, _, _ = hf_clip
    return AestheticReward(mlp=aesthetic_mlp[0], clip_model=folder / "model", processor=folder / "processor", batch_size=2)


def test_aesthetic_is_the_linear_mlp_on_normalised_image_embeddings(hf_clip, aesthetic_mlp, aesthetic):
    folder, model, tokenizer = hf_clip
    path, weights = aesthetic_mlp
    assert sorted(weights) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    reward = aesthetic
    images, prompts = random_images(5, 100, 50, seed=5), PROMPTS[:5]
    hidden, _ = reference_clip_embeddings(model, tokenizer, images, prompts)  # (5, 16), L2-normalised
    for index in (0, 2, 4, 6, 7):  # no activations between the layers
        hidden = hidden @ weights[f"layers.{index}.weight"].T + weights[f"layers.{index}.bias"]
    scores = reward(images, prompts, [{}] * 5)
    assert scores.shape == (5,)
    torch.testing.assert_close(scores, hidden.squeeze(-1), rtol=0, atol=1e-5)
    assert scores.std() > 0
    assert reward.name == "aesthetic" and "1–10" in reward.scale


def test_aesthetic_refuses_a_wrong_mlp_and_pickled_objects(hf_clip, tmp_path):
    from branchdiff.rewards.aesthetic import AestheticMLP

    folder, _, _ = hf_clip
    torch.save(AestheticMLP(embed_dim=768).state_dict(), tmp_path / "wide.pth")  # the real 768-d head on a 16-d CLIP
    with pytest.raises(ValueError, match="16-d"):
        AestheticReward(mlp=tmp_path / "wide.pth", clip_model=folder / "model", processor=folder / "processor")
    torch.save({"layers": Namespace(a=1)}, tmp_path / "pickled.pth")
    with pytest.raises(ValueError, match="weights_only"):
        AestheticReward(mlp=tmp_path / "pickled.pth", clip_model=folder / "model", processor=folder / "processor")


def test_missing_transformers_weights_are_one_line_naming_path_and_source(hf_clip, tmp_path, aesthetic_mlp):
    folder, _, _ = hf_clip
    cases = [
        (lambda: PickScoreReward(model=tmp_path / "no-pickscore", processor=folder / "processor"), "no-pickscore", "yuvalkirstain/PickScore_v1"),
        (lambda: PickScoreReward(model=folder / "model"), "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "yuvalkirstain/PickScore_v1"),
        (lambda: CLIPScoreReward(), "openai/clip-vit-large-patch14", "openai/clip-vit-large-patch14"),
        (lambda: AestheticReward(clip_model=folder / "model", processor=folder / "processor"), "trl-lib/ddpo-aesthetic-predictor", "sac+logos+ava1-l14-linearMSE.pth"),
        (lambda: AestheticReward(mlp=aesthetic_mlp[0], clip_model=tmp_path / "no-clip"), "no-clip", "openai/clip-vit-large-patch14"),
    ]
    for build, asked, source in cases:
        with pytest.raises(MissingWeightsError) as error:
            build()
        message = str(error.value)
        assert asked in message and source in message and "\n" not in message, message


# ---------------------------------------------------------------- ImageReward (optional package)


def test_imagereward_without_its_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ImageReward", None)  # as if not installed, even where it is
    monkeypatch.setitem(sys.modules, "ImageReward.ImageReward", None)
    with pytest.raises(ImportError) as error:
        ImageRewardReward()
    message = str(error.value)
    assert "serve-reward imagereward" in message and "image-reward" in message and "\n" not in message


def test_sample_search_maximises_a_preference_reward_on_the_built_in_model(hf_clip, tiny_model_dir, tmp_path):
    """`sample --search best-of-n` with PickScore (the tiny CLIP, named in the config's form): the
    winner's recorded reward is the largest of its rounds and PickScore of the written image."""
    from branchdiff.cli import main

    folder, _, _ = hf_clip
    spec = f"[{{name: pickscore, kwargs: {{model: {folder / 'model'}, processor: {folder / 'processor'}}}}}]"
    out = tmp_path / "search"
    assert main(["sample", "--model", str(tiny_model_dir), "--steps", "4", "--prompt", "a red circle", "--search", "best-of-n",
                 "--budget", "16", "--reward", spec, "--out", str(out)]) == 0
    entry = json.loads((out / "search.json").read_text())["prompts"][0]
    assert entry["nfe"] == 16 and [r["images"] for r in entry["rounds"]] == [1, 2, 3, 4]
    best = entry["best"][0]["reward"]
    assert best == entry["rounds"][-1]["best"] and entry["rounds"][0]["best"] <= best
    image = torch.from_numpy(np.array(Image.open(out / entry["best"][0]["image"]))).permute(2, 0, 1).float()[None] / 255
    reward = PickScoreReward(model=folder / "model", processor=folder / "processor", batch_size=3)
    assert reward(image, ["a red circle"]).item() == pytest.approx(best, abs=0.5)  # the PNG is 8-bit; the search scored the float image
