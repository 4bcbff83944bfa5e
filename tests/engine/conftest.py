import pytest

from engine_helpers import save_tiny_model


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, save_tiny_model("llama", path)


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    return path, save_tiny_model("qwen3", path)


@pytest.fixture(params=["llama", "qwen3"])
def tiny_model(request):
    """(model directory, the HF model saved there), for each architecture."""
    return request.getfixturevalue(request.param)
