"""`treeserve generate` (through the service and in-process) and `treeserve serve`'s config handling."""

from __future__ import annotations

import pytest

from treeserve.cli.main import main
from treeserve.services.launch import DEFAULT_CONFIG, load_config


def test_generate_streams_from_the_service(serve_service, capsys):
    rc = main(["generate", "--address", serve_service.address, "--application", serve_service.app_name,
               "--prompt", "Hello there", "--max-new-tokens", "8"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out  # the tiny random model may well answer with whitespace only
    assert "MAL" in out.err and "completion 8 tok" in out.err and "per step: draft" in out.err


def test_generate_reports_bad_input_in_one_line(serve_service, capsys):
    rc = main(["generate", "--address", serve_service.address, "--prompt", "hi", "--max-new-tokens", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "INVALID_ARGUMENT" in err and len(err.strip().splitlines()) == 1


def test_generate_with_tls_and_token(secure_service, capsys, tmp_path, monkeypatch):
    """`treeserve generate` against a TLS + token service: the CA and the token from the command line (or
    $TREESERVE_TOKEN); without the token one line says UNAUTHENTICATED."""
    token_file = tmp_path / "token"
    token_file.write_text(secure_service.token + "\n")
    base = ["generate", "--address", secure_service.address, "--tls-ca", secure_service.pki.ca_cert,
            "--prompt", "Hello", "--max-new-tokens", "4"]
    rc = main(base + ["--token-file", str(token_file)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "completion 4 tok" in out.err
    monkeypatch.delenv("TREESERVE_TOKEN", raising=False)
    rc = main(base)
    err = capsys.readouterr().err
    assert rc == 2 and "UNAUTHENTICATED" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("TREESERVE_TOKEN", secure_service.token)
    assert main(base) == 0


def test_generate_in_process(tiny_target_dir, tiny_drafter_dir, capsys):
    rc = main(["generate", "--in-process", "--target", str(tiny_target_dir), "--drafter", str(tiny_drafter_dir),
               "--method", "chain", "--budget", "3", "--prompt", "Hi", "--max-new-tokens", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "MAL" in out.err


def test_generate_in_process_with_lookup_needs_no_drafter(tiny_target_dir, capsys):
    """Issue 61's repro: a target no shipped drafter fits decodes with method lookup (no drafter model loaded);
    a model method with --drafter none is refused in one line."""
    rc = main(["generate", "--in-process", "--target", str(tiny_target_dir), "--method", "lookup", "--budget", "4",
               "--prompt", "Say it twice: hello hello", "--max-new-tokens", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rc = main(["generate", "--in-process", "--target", str(tiny_target_dir), "--drafter", "none", "--method", "c2t",
               "--prompt", "Hi", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc != 0 and "drafts with a drafter model" in err and "Traceback" not in err


def test_generate_in_process_stops_on_the_generation_configs_eos_ids(multi_eos_model, capsys):
    """Issue 44's repro: `generate` stops on an EOS id only the generation config lists (the 4th token here), and
    so does `treeserve generate --in-process`; --stop-token-id adds one."""
    base = ["generate", "--in-process", "--target", str(multi_eos_model.path), "--method", "autoregressive",
            "--prompt", "Tell me a story about a fox.", "--max-new-tokens", "16"]
    assert len(multi_eos_model.greedy(multi_eos_model.prompts[0], 16)) == 4  # where generate stops
    assert main(base) == 0
    assert "[EOS] prompt" in (err := capsys.readouterr().err) and "completion 4 tok" in err
    assert main(base + ["--stop-token-id", str(multi_eos_model.free_run[1])]) == 0
    assert "[EOS] prompt" in (err := capsys.readouterr().err) and "completion 2 tok" in err


def test_serve_config_overrides(tiny_target_dir, tiny_drafter_dir):
    config = load_config(str(DEFAULT_CONFIG), method="chain", budget="4", target=str(tiny_target_dir),
                         drafter=str(tiny_drafter_dir), grpc_port=9123)
    args = config.app.args
    assert (args.speculation.method, args.speculation.budget, args.api.port) == ("chain", 4, 9123)
    assert args.target.path == str(tiny_target_dir)
    assert config.app.deployment("Target").autoscaling_config.max_replicas == 2
    with pytest.raises(ValueError, match="budget"):
        load_config(str(DEFAULT_CONFIG), method="autoregressive", budget="lots")
    with pytest.raises(FileNotFoundError, match="drafter"):
        load_config(str(DEFAULT_CONFIG), method="dyspec", drafter="/nowhere/drafter")


def test_serve_http_port_override(capsys):
    """`treeserve serve --http-port N` sets args.api.http_port (the OpenAI-compatible HTTP API), 0 turns it off,
    and it is re-validated with the rest of the config; --help documents it."""
    import argparse

    from treeserve.cli.serve import add_arguments

    assert load_config(str(DEFAULT_CONFIG), method="autoregressive").app.args.api.http_port == 9001  # the yaml's
    api = load_config(str(DEFAULT_CONFIG), method="autoregressive", grpc_port=9200, http_port=9201).app.args.api
    assert (api.port, api.http_port) == (9200, 9201)
    assert load_config(str(DEFAULT_CONFIG), method="autoregressive", http_port=0).app.args.api.http_port is None
    with pytest.raises(ValueError, match="http_port: must differ from args.api.port"):
        load_config(str(DEFAULT_CONFIG), method="autoregressive", http_port=9000)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--http-port", "9101"]).http_port == 9101 and parser.parse_args([]).http_port is None
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps after hyphens
    assert "--http-port N" in help_text and "OpenAI-compatible HTTP API" in help_text and "0 = off" in help_text


def test_app_options_follow_the_yaml():
    from treeserve.services.app import _deployment_options

    config = load_config(str(DEFAULT_CONFIG), method="autoregressive")
    options = _deployment_options(config.app.deployment("Target"), {"OMP_NUM_THREADS": "1"})
    assert options["autoscaling_config"]["max_replicas"] == 2
    assert options["ray_actor_options"]["num_cpus"] == 0.4
    assert options["autoscaling_config"]["min_replicas"] == 2  # a spare Target: streams move at once when one dies
    assert options["ray_actor_options"]["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"
    assert options["max_ongoing_requests"] == 8


def test_session_autoscaling_policy():
    from types import SimpleNamespace

    from ray.serve.config import AutoscalingConfig

    from treeserve.services.app import ROUTER_POLICY, SESSION_POLICY, session_autoscaling_policy

    AutoscalingConfig(min_replicas=1, max_replicas=3, policy={"policy_function": SESSION_POLICY})  # importable

    def ctx(sessions):
        return SimpleNamespace(aggregated_metrics={"active_sessions": dict(enumerate(sessions))},
                               config=SimpleNamespace(target_ongoing_requests=4), capacity_adjusted_min_replicas=1,
                               capacity_adjusted_max_replicas=3, policy_state={})
    assert session_autoscaling_policy(ctx([]))[0] == 1
    assert session_autoscaling_policy(ctx([3, 2]))[0] == 2
    assert session_autoscaling_policy(ctx([40]))[0] == 3
    config = load_config(str(DEFAULT_CONFIG), method="autoregressive")
    from treeserve.services.app import _deployment_options

    assert _deployment_options(config.app.deployment("Drafter"), {})["autoscaling_config"]["policy"] == {
        "policy_function": SESSION_POLICY}
    # The Router scales on requests in flight, not sessions (bug #30: services/app.py router_autoscaling_policy).
    assert _deployment_options(config.app.deployment("Router"), {})["autoscaling_config"]["policy"] == {
        "policy_function": ROUTER_POLICY}
