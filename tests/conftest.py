import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read once, when huggingface_hub is first imported: no test reaches the network

import pytest
import torch

torch.set_num_threads(2)


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
