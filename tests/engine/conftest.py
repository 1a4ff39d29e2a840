import pytest
import torch

from toy import ToyModels


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The CI box has 2 shared cores; tiny tensors only lose from intra-op threads.
    torch.set_num_threads(1)


@pytest.fixture
def models() -> ToyModels:
    return ToyModels(vocab=24, seed=0)
