"""`--device`: cpu or a CUDA device this machine has, refused in one line otherwise (before any model loads)."""

import pytest
import torch

from treeserve.cli.main import main
from treeserve.engine.devices import check_device, device_name


def test_devices_are_checked(monkeypatch):
    check_device("cpu")
    for bad in ("gpu", "cuda:x", "CUDA", "mps"):
        with pytest.raises(ValueError, match="cpu or cuda"):
            check_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda")
    check_device("cuda:0")
    with pytest.raises(ValueError, match="1 CUDA device"):
        check_device("cuda:1")
    assert device_name("cpu") == "cpu"


@pytest.mark.parametrize("command", [["bench"], ["make-corpus", "--max-chunks", "0"], ["train-eagle3"]])
def test_commands_refuse_a_device_this_machine_lacks(command, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = ["--out", str(tmp_path / "out")] if command[0] != "bench" else []
    assert main(command + out + ["--device", "cuda:0"]) == 2
    assert "this machine has no CUDA device" in capsys.readouterr().err
