import os
import socket

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read once, when huggingface_hub is first imported: no test reaches the network
# one compute thread in each process a test starts (a two-process run puts two on two cores; with torch's default, one
# per core each, they oversubscribed the CI machines: 21 min against 12:49 measured on the slower type); this process
# sets its own below
os.environ.setdefault("OMP_NUM_THREADS", "1")

import huggingface_hub.utils.logging  # noqa: F401  # outside any test's captured stderr: its log handler keeps the stream it finds
import pytest
import torch

# the suite runs on two workers (pyproject.toml's addopts: pytest-xdist, one test file per worker at a time), each with one
# thread; run alone (-n 0), one process with both cores
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# files holding the suite's longest launches, started first so that neither worker is left with a long file at the end
LONGEST_FIRST = ("test_sharding.py", "test_multiprocess.py", "test_readme.py", "test_finetune.py", "test_wan.py", "test_model_families.py",
                 "test_plan.py", "test_checks.py", "test_fuzz.py", "test_trainer.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other files keep their order


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised model of the built-in architecture, saved like assets/tiny."""
    from branchdiff.models.tiny import TinyAdapter

    path = tmp_path_factory.mktemp("tiny-model")
    TinyAdapter.random(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_adapter(tiny_model_dir):
    from branchdiff.models.tiny import TinyAdapter

    return TinyAdapter.from_pretrained(tiny_model_dir)


@pytest.fixture
def silent_server():
    """The URL of a server that accepts connections and never answers: the kernel completes each
    connection into the listening socket's backlog and nothing ever reads or writes it (a hung hub,
    reward server or tracker)."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def closed_port():
    """The URL of a port nothing listens on (connections are refused)."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def hub_at(monkeypatch):
    """huggingface_hub pointed at a URL, as HF_ENDPOINT does when it is imported, with a token and
    offline mode off (turned on above)."""
    from huggingface_hub import constants, hf_api

    def point(url: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(hf_api.api, "endpoint", url)  # the module's HfApi (model_info, diffusers' look-up) read ENDPOINT when imported
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_test_token_not_sent_anywhere")

    return point


TINY_CLIP = "branchdiff-test-geneval-clip"


@pytest.fixture(scope="module")
def geneval_parts(tmp_path_factory):
    """A tiny random Mask2Former (transformers' classes, 80 COCO labels) and a tiny open_clip checkpoint, saved."""
    import json

    import open_clip
    import torch
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor, SwinConfig

    folder = tmp_path_factory.mktemp("geneval-parts")
    backbone = SwinConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4, image_size=64,
                          out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, num_labels=80, num_queries=12, hidden_dim=32, mask_feature_size=32, feature_size=32,
                               encoder_layers=1, decoder_layers=2, num_attention_heads=2, dim_feedforward=32, encoder_feedforward_dim=32,
                               common_stride=4)
    torch.manual_seed(0)
    Mask2FormerForUniversalSegmentation(config).save_pretrained(folder / "detector")
    Mask2FormerImageProcessor().save_pretrained(folder / "detector")
    (folder / f"{TINY_CLIP}.json").write_text(json.dumps({"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": 1, "width": 32,
                                                                                              "head_width": 16, "patch_size": 16},
                                                          "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2,
                                                                       "layers": 1}}))
    open_clip.add_model_config(folder / f"{TINY_CLIP}.json")
    torch.save({"state_dict": open_clip.create_model(TINY_CLIP).state_dict()}, folder / "clip.pt")
    return folder
