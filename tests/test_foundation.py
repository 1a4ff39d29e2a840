"""Packaging, generated stubs, CLI and model loading: the foundation every other part stands on."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_generic_top_level_modules_installed(tmp_path):
    # From outside the checkout (the repository root itself would be on sys.path), only `treeserve` imports.
    code = ("import importlib.util as u; import treeserve.engine, treeserve.services, treeserve.tools, treeserve.v1; "
            "print([n for n in ('engine', 'services', 'tools', 'deploy', 'helm') if u.find_spec(n)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("proto", sorted((ROOT / "proto").rglob("*.proto")), ids=lambda p: p.name)
def test_generated_stubs_match_proto(proto, tmp_path):
    """The installed stubs were generated from exactly this .proto (else: reinstall the package)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    rel = proto.relative_to(ROOT / "proto")
    out = tmp_path / "set.pb"
    include = Path(protoc.__file__).parent / "_proto"
    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--descriptor_set_out={out}", str(rel)]) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    module = importlib.import_module(str(rel.with_suffix("")).replace("/", ".") + "_pb2")
    installed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    _drop_json_names(fresh)  # descriptor sets carry derived json_name values that generated code omits
    _drop_json_names(installed)
    assert installed == fresh, f"stubs for {rel} are stale: run `pip install -e .` to regenerate them"
    grpc_module = importlib.import_module(str(rel.with_suffix("")).replace("/", ".") + "_pb2_grpc")
    for service in fresh.service:
        assert hasattr(grpc_module, f"{service.name}Stub")


def _drop_json_names(file_proto) -> None:
    def visit(message):
        for f in message.field:
            f.ClearField("json_name")
        for nested in message.nested_type:
            visit(nested)

    for message in file_proto.message_type:
        visit(message)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "treeserve.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_help_lists_subcommands():
    from treeserve.cli.main import SUBCOMMANDS

    out = run_cli("--help")
    assert out.returncode == 0
    for name in SUBCOMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("command", ["train-drafter", "train-c2t", "tune-c2t", "bench", "agreement", "prepare-model",
                                     "memory-estimate", "profile"])
def test_subcommand_help(command):
    out = run_cli(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: treeserve " + command in out.stdout


def test_train_drafter_help_documents_every_option():
    out = run_cli("train-drafter", "--help").stdout
    for option in ("--layers", "--draft-vocab-size", "--minutes", "--response-prompts", "--reference-tokens",
                   "--out", "--target"):
        assert option in out
    # Every option has a description (argparse prints the help text after the flag).
    import argparse

    from treeserve.cli import train_drafter

    parser = argparse.ArgumentParser()
    train_drafter.add_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help"


def test_missing_model_path_is_one_line_error(tmp_path):
    out = run_cli("prepare-model", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "does not exist" in out.stderr


def test_gguf_that_is_not_a_causal_lm(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    out = run_cli("prepare-model", str(bad))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "garbage.gguf" in out.stderr


def test_gguf_with_non_causal_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "encoder.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_context_length(8)
    writer.add_embedding_length(4)
    writer.add_head_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = run_cli("prepare-model", str(path))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "encoder.gguf" in out.stderr


def test_drafter_vocabulary_mismatch(tmp_path, tiny_target_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from treeserve.engine.drafters.models.loading import load_drafter
    from treeserve.engine.models.loading import load_causal_lm

    other = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    other.save_pretrained(tmp_path / "small_vocab")
    target = load_causal_lm(tiny_target_dir).model
    with pytest.raises(ValueError, match="vocabulary has 1000 tokens"):
        load_drafter(str(tmp_path / "small_vocab"), target)


def test_default_target_loads_and_answers(default_model_dir):
    import torch

    from treeserve.engine.models.loading import load_causal_lm

    model = load_causal_lm("default")
    assert model.path == default_model_dir
    assert model.model.config.num_attention_heads == 9
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                              add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.model.generate(**ids, max_new_tokens=8, do_sample=False, top_p=None, top_k=None, temperature=None)
    assert "Paris" in model.tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
    with torch.no_grad():
        assert torch.isfinite(model.model(**ids).logits).all()
