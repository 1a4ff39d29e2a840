"""services/config/: typed parsing, defaults, and errors that name the offending field path."""

import dataclasses
import json

import pytest

from treeserve.services import config as cfg
from treeserve.services.config import AppConfig, ServeConfigFile, load_serve_config


def _app(args=None, deployments=None):
    app = {"name": "treeserve", "import_path": "treeserve.services.app:build_app", "args": args or {}}
    if deployments is not None:
        app["deployments"] = deployments
    return {"applications": [app]}


def _error(data) -> str:
    with pytest.raises(ValueError) as info:
        load_serve_config(data)
    return str(info.value)


def test_empty_config_gives_local_cpu_defaults():
    config = load_serve_config({})
    assert isinstance(config, ServeConfigFile)
    assert config.grpc_options.grpc_servicer_functions == []  # no Serve gRPC proxy: the Router serves the API
    assert config.logging_config.enable_access_log is False
    args = config.app.args
    # The public API: this machine only, plaintext, no token, reflection off, a 4 MiB request cap.
    assert (args.api.host, args.api.port, args.api.enable_reflection) == ("127.0.0.1", 9000, False)
    assert args.api.max_request_bytes == 4 * 1024 * 1024
    assert not args.security.tls and args.security.auth_token_file is None
    assert (args.target.path, args.target.device, args.target.tensor_parallel_size) == ("default", "cpu", 1)
    assert (args.target.dtype, args.drafter.path, args.drafter.dtype) == ("float32", "eagle3", "auto")
    assert args.speculation.budget == "auto" and args.speculation.batch_method == "c2t_chain"


def test_from_args_parses_sections():
    args = AppConfig.from_args({"target": {"dtype": "bfloat16"}, "speculation": {"method": "c2t", "budget": 32},
                                "limits": {"max_batch_size": 2}, "grpc": {"max_message_bytes": 8 << 20},
                                "drafter": {"kind": "parallel"}})
    assert args.target.dtype == "bfloat16" and args.speculation.budget == 32
    assert args.limits.max_batch_size == 2 and args.drafter.kind == "parallel"
    assert args.speculation.lookup.shared_tokens == 16384  # each tenant's cross-request lookup index, by default
    speculation = {"method": "c2t+lookup", "lookup": {"shared_tokens": 65536, "max_ngram": 6}}
    lookup = AppConfig.from_args({"speculation": speculation}).speculation.lookup
    assert (lookup.shared_tokens, lookup.max_ngram) == (65536, 6)
    assert AppConfig.from_args(None) == AppConfig()


def test_fused_ops_is_a_model_setting_on_by_default():
    args = AppConfig.from_args({"target": {"fused_ops": False}})
    assert not args.target.fused_ops and args.drafter.fused_ops and AppConfig().target.fused_ops


def test_every_field_has_help():
    def walk(cls):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
    from treeserve.engine.lookup import LookupSettings

    for cls in (cfg.ModelFacts, cfg.ModelConfig, cfg.DrafterConfig, cfg.SpeculationConfig, LookupSettings,
                cfg.LimitsConfig, cfg.InternalGrpcConfig, cfg.ApiConfig, cfg.SecurityConfig, AppConfig,
                cfg.DeploymentConfig, cfg.RuntimeEnv, cfg.ApplicationConfig, ServeConfigFile):
        walk(cls)


def test_serve_sections_are_ray_serves_own_models():
    """Autoscaling, actor options and the proxies' and logging options are Ray Serve's own schema types: every
    field Serve knows is accepted (and reaches Serve), with the config's strictness and field paths."""
    from ray.serve.config import AutoscalingConfig, ProxyLocation
    from ray.serve.schema import HTTPOptionsSchema, LoggingConfig, RayActorOptionsSchema, gRPCOptionsSchema

    from treeserve.services.app import _deployment_options

    config = load_serve_config(_app(deployments=[{
        "name": "Target", "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "look_back_period_s": 30},
        "ray_actor_options": {"num_cpus": 0.5, "accelerator_type": "A100"}}]))
    assert isinstance(config.proxy_location, ProxyLocation) and isinstance(config.http_options, HTTPOptionsSchema)
    assert isinstance(config.grpc_options, gRPCOptionsSchema) and isinstance(config.logging_config, LoggingConfig)
    target = config.app.deployment("Target")
    assert isinstance(target.autoscaling_config, AutoscalingConfig)
    assert isinstance(target.ray_actor_options, RayActorOptionsSchema)
    options = _deployment_options(target, {})
    assert options["autoscaling_config"]["look_back_period_s"] == 30
    assert options["ray_actor_options"]["accelerator_type"] == "A100"
    assert (options["ray_actor_options"]["num_cpus"], options["ray_actor_options"]["num_gpus"]) == (0.5, 0.0)
    # strict and with field paths, like the rest of the config
    for section, value, words in (("autoscaling_config", {"min_replicas": "2"}, "min_replicas: expected an integer"),
                                  ("autoscaling_config", {"look_back": 1}, "look_back: unknown field"),
                                  ("ray_actor_options", {"num_gpus": True}, "num_gpus: expected a number")):
        message = _error(_app(deployments=[{"name": "Target", section: value}]))
        assert f"applications[0].deployments[0].{section}.{words}" in message, message


@pytest.mark.parametrize("args, message", [
    ({"target": {"tensor_parallel_size": 2}},
     "applications[0].args.target.tensor_parallel_size: must divide num_attention_heads=9"),
    ({"target": {"path": "/nowhere", "num_attention_heads": 64, "num_key_value_heads": 6,
                 "tensor_parallel_size": 4}},
     "applications[0].args.target.tensor_parallel_size: must divide num_key_value_heads=6"),
    ({"target": {"dtype": "float64"}}, "applications[0].args.target.dtype: must be one of"),
    # "auto" is a drafter's dtype only: the target's dtype defines the output.
    ({"target": {"dtype": "auto"}}, "applications[0].args.target.dtype: must be one of"),
    ({"target": {"path": "hf://meta-llama/Llama-2-7b"}}, "applications[0].args.target.path"),
    ({"target": {"tensor_parallel_size": True}}, "applications[0].args.target.tensor_parallel_size: expected an integer"),
    ({"speculation": {"method": "medusa"}}, "applications[0].args.speculation.method"),
    ({"speculation": {"budget": 0}}, "applications[0].args.speculation.budget"),
    ({"speculation": {"budget": 1025}}, "applications[0].args.speculation.budget"),
    ({"speculation": {"budget": "many"}}, "applications[0].args.speculation.budget"),
    ({"speculation": {"lookup": {"shared_tokens": -1}}},
     "applications[0].args.speculation.lookup: lookup.shared_tokens must be 0 (off) or an integer >= 2"),
    ({"speculation": {"lookup": {"max_ngam": 4}}}, "applications[0].args.speculation.lookup.max_ngam: unknown field"),
    ({"limits": {"max_batch_size": -1}}, "applications[0].args.limits.max_batch_size: must be > 0"),
    ({"limits": {"max_prompt_tokens": 4000}}, "applications[0].args.limits: max_prompt_tokens + max_new_tokens"),
    ({"grpc": {"max_message_bytes": 1024}}, "applications[0].args.grpc.max_message_bytes"),
    ({"drafter": {"kind": "medusa"}}, "applications[0].args.drafter.kind"),
    ({"drafter": {"path": "none"}}, "applications[0].args.speculation.method: c2t+lookup drafts with a drafter model"),
    ({"target": {"kv_page_tokens": 0}}, "applications[0].args.target.kv_page_tokens: must be > 0"),
    ({"target": {"kv_cache_tokens": -5}}, "applications[0].args.target.kv_cache_tokens"),
    ({"limits": {"prefill_chunk_tokens": 0}}, "applications[0].args.limits.prefill_chunk_tokens"),
    ({"targt": {}}, "applications[0].args.targt: unknown field"),
])
def test_bad_args_name_the_field(args, message):
    assert message in _error(_app(args))


@pytest.mark.parametrize("deployments, message", [
    ([{"name": "Router", "num_replicas": -1}], "applications[0].deployments[0].num_replicas: must be >= 1"),
    ([{"name": "Router", "num_replicas": "2"}], "applications[0].deployments[0].num_replicas: expected an integer"),
    ([{"name": "Router", "autoscaling_config": {"min_replicas": -1}}],
     "applications[0].deployments[0].autoscaling_config.min_replicas: must be >= 0"),
    ([{"name": "Router", "autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}],
     "applications[0].deployments[0].autoscaling_config.max_replicas"),
    ([{"name": "Router", "num_replicas": 1, "autoscaling_config": {}}], "not both"),
    ([{"name": "Ruoter"}], "applications[0].deployments[0].name: must be one of Router, Drafter, Target"),
    ([{"name": "Target", "ray_actor_options": {"num_cpus": -0.5}}],
     "applications[0].deployments[0].ray_actor_options.num_cpus"),
    ([{"name": "Router"}, {"name": "Router"}], "applications[0].deployments[1].name: Router listed twice"),
])
def test_bad_deployments_name_the_field(deployments, message):
    assert message in _error(_app(deployments=deployments))


def test_cuda_target_must_reserve_one_gpu_per_rank():
    args = {"target": {"path": "/models/x", "device": "cuda", "tensor_parallel_size": 4,
                       "num_attention_heads": 64, "num_key_value_heads": 8}}
    bundles = [{"CPU": 1}] + [{"GPU": 1}] * 3
    message = _error(_app(args, [{"name": "Target", "placement_group_bundles": bundles}]))
    assert "applications[0].deployments[0]: reserves 3 GPUs" in message
    ok = load_serve_config(_app(args, [{"name": "Target", "placement_group_bundles": bundles + [{"GPU": 1}]}]))
    assert ok.app.deployment("Target").gpus_per_replica() == 4


def test_model_config_json_is_the_source_of_truth(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 1024, "vocab_size": 100, "max_position_embeddings": 512}))
    args = {"target": {"path": str(model), "tensor_parallel_size": 4, "max_context_tokens": 512},
            # the drafter must fit the target (the shipped ones are SmolLM2's): the model drafts for itself
            "drafter": {"path": str(model), "max_context_tokens": 512},
            "limits": {"max_prompt_tokens": 256, "max_new_tokens": 128}}
    assert "must divide num_key_value_heads=2" in _error(_app(args))
    args["target"]["tensor_parallel_size"] = 2
    assert load_serve_config(_app(args)).app.args.target.facts().head_dim == 64
    args["target"]["num_attention_heads"] = 16
    assert "num_attention_heads: 16 disagrees with the model's config (8)" in _error(_app(args))


def test_model_facts_relative_to_the_config_file(tmp_path):
    (tmp_path / "facts.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 6, "intermediate_size": 128,
        "vocab_size": 10, "max_position_embeddings": 4096}))
    path = tmp_path / "serve.yaml"
    path.write_text("applications:\n- args:\n    target: {path: /nowhere, model_facts: facts.json, "
                    "tensor_parallel_size: 4}\n")
    assert "must divide num_attention_heads=6" in _error(path)
    path.write_text("applications:\n- args:\n    target: {path: /nowhere, model_facts: missing.json}\n")
    assert "applications[0].args.target.model_facts: cannot read" in _error(path)


def test_top_level_errors(tmp_path):
    # Serve's gRPC proxy would queue requests in front of the router's limit (and has no TLS/token/size cap).
    message = _error({"grpc_options": {"grpc_servicer_functions": [cfg.TREESERVE_SERVICER]}})
    assert "grpc_options.grpc_servicer_functions" in message and "queues requests" in message
    assert "grpc_options.port: must be a TCP port" in _error({"grpc_options": {"port": 70000}})
    assert "exactly one application" in _error({"applications": []})
    assert "proxy_location: must be one of" in _error({"proxy_location": "Everywhere"})
    (tmp_path / "bad.yaml").write_text("applications: [\n")
    assert "not valid YAML" in _error(tmp_path / "bad.yaml")
    assert "cannot read Serve config" in _error(tmp_path / "absent.yaml")


def test_eagle_drafter_with_a_tensor_parallel_target(tmp_path):
    """An EAGLE drafter reads the target's features, which the tensor-parallel target returns too: the config
    takes it with any tensor_parallel_size that divides the heads (tests/tp/test_tp_features.py serves it)."""
    config = {"hidden_size": 576, "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
              "treeserve_drafter": {"kind": "eagle", "target_vocab_size": 49152, "draft_vocab_size": 49152}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for path in ("eagle", str(tmp_path)):
        args = load_serve_config(_app({"drafter": {"path": path}, "target": {"tensor_parallel_size": 3}})).app.args
        assert args.drafter.reads_target_features() and args.target.tensor_parallel_size == 3
    # The default drafter (eagle3) reads the target's features; the distilled LM does not.
    default = load_serve_config(_app({})).app.args.drafter
    assert default.path == "eagle3" and default.reads_target_features()
    assert not load_serve_config(_app({"drafter": {"path": "distilled"}})).app.args.drafter.reads_target_features()


@pytest.mark.parametrize("args, message", [
    ({"api": {"host": "0.0.0.0"}}, "applications[0].args.api.host: 0.0.0.0 is reachable from the network but the API "
                                   "would be plaintext"),
    ({"security": {"tls_cert_file": "/tls/tls.crt"}}, "set tls_cert_file and tls_key_file together"),
    ({"security": {"tls_client_ca_file": "/tls/ca.crt"}}, "tls_client_ca_file: needs tls_cert_file"),
    ({"security": {"auth_token_file": ""}}, "security.auth_token_file: must be a file path"),
    ({"api": {"max_request_bytes": 100}}, "api.max_request_bytes: must lie in 1024..268435456"),
    ({"api": {"port": 0}}, "api.port: must be a TCP port"),
    ({"api": {"host": ""}}, "api.host: must not be empty"),
    ({"security": {"tls": True}}, "security.tls: unknown field"),
])
def test_api_and_security_errors(args, message):
    assert message in _error(_app(args))


def test_api_and_security_accepted(tmp_path):
    tls = {"tls_cert_file": "/etc/treeserve/tls/tls.crt", "tls_key_file": "/etc/treeserve/tls/tls.key"}
    args = load_serve_config(_app({"api": {"host": "0.0.0.0"}, "security": tls})).app.args
    assert args.security.tls and not args.api.loopback_only
    # Plaintext on the network only when TLS is terminated in front (explicitly).
    assert load_serve_config(_app({"api": {"host": "0.0.0.0"}, "security": {"allow_insecure": True}}))
    # The files are read when the Router starts (mounted secrets), not when the config is validated; relative
    # paths are resolved against the config file's folder.
    path = tmp_path / "serve.yaml"
    path.write_text("applications:\n- args:\n    security: {auth_token_file: secrets/tokens}\n")
    assert load_serve_config(path).app.args.security.auth_token_file == str(tmp_path / "secrets" / "tokens")


def test_auto_budget_is_refused_with_a_tensor_parallel_target():
    """'auto' times target forwards in the Drafter replica: with TP > 1 that would load the whole sharded
    target onto the drafter's device share."""
    import pytest

    from treeserve.services.config import AppConfig

    with pytest.raises(ValueError, match="speculation.budget: 'auto'"):
        AppConfig.from_args({"target": {"tensor_parallel_size": 3}, "drafter": {"device": "cuda"},
                             "speculation": {"budget": "auto"}})
    assert AppConfig.from_args({"target": {"tensor_parallel_size": 3}, "drafter": {"device": "cuda"},
                                "speculation": {"budget": 60}}).speculation.budget == 60


def test_drafter_kind_must_match_its_weights(tmp_path):
    """drafter.kind picks the drafter class (it used to be parsed and never read: kind parallel with path default
    loaded the autoregressive drafter); weights of the other kind are refused at config load."""
    parallel_dir = tmp_path / "parallel_drafter"
    parallel_dir.mkdir()
    llama = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 2,
             "intermediate_size": 1536,
             "vocab_size": 49152, "max_position_embeddings": 8192}
    (parallel_dir / "config.json").write_text(json.dumps({**llama, "treeserve_parallel_drafter": {"kind": "parallel"}}))
    message = _error(_app({"drafter": {"path": str(parallel_dir)}}))
    assert message.startswith("applications[0].args.drafter: drafter kind 'autoregressive' does not match")
    assert "set the kind to 'parallel'" in message
    # A parallel drafter cannot draft the default hybrid method (copy-from-context candidates): name a method.
    message = _error(_app({"drafter": {"kind": "parallel"}}))
    assert "drafts with the autoregressive drafter, not drafter.kind parallel" in message
    model_only = {"method": "dyspec"}
    message = _error(_app({"drafter": {"path": "eagle", "kind": "parallel"}, "speculation": model_only}))
    assert message.startswith("applications[0].args.drafter: drafter kind 'parallel' does not match the shipped "
                              'drafter "eagle"')
    config = load_serve_config(_app({"drafter": {"path": str(parallel_dir), "kind": "parallel"},
                                     "speculation": model_only}))
    assert config.app.args.drafter.kind == "parallel"


def test_drafter_dtype_auto_is_sized_as_the_larger_choice():
    """drafter.dtype auto (the faster of the target's dtype and bfloat16, measured at start) is accepted, and the
    memory estimate sizes it as the target's dtype (float32 here: the larger of the two)."""
    from treeserve.services.memory_estimate import dtype_bytes

    args = load_serve_config(_app({"drafter": {"dtype": "auto"}})).app.args
    assert args.drafter.dtype == "auto" and dtype_bytes(args.drafter, args) == 4
    args = load_serve_config(_app({"drafter": {"dtype": "auto"}, "target": {"dtype": "bfloat16"}})).app.args
    assert dtype_bytes(args.drafter, args) == 2


def test_feature_reading_heads_run_past_their_max_position_embeddings(tmp_path):
    """A head reading the target's features (here a published EAGLE-3 head, declared: its files are not readable
    here) runs at the target's positions past its own max_position_embeddings (2048 in the EAGLE authors' heads),
    as SGLang and vLLM serve them: it does not cap the service. An ordinary causal-LM drafter still may not."""
    smol = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 1,
            "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 2048}
    (tmp_path / "head.json").write_text(json.dumps({**smol, "architectures": ["LlamaForCausalLMEagle3"],
                                                    "draft_vocab_size": 32000}))
    (tmp_path / "narrow.json").write_text(json.dumps({**smol, "architectures": ["LlamaForCausalLMEagle3"],
                                                      "hidden_size": 384, "num_attention_heads": 6,
                                                      "num_key_value_heads": 2, "target_hidden_size": 576}))
    (tmp_path / "lm.json").write_text(json.dumps({**smol, "architectures": ["LlamaForCausalLM"]}))

    def args(drafter):
        return {"target": {"max_context_tokens": 8192},
                "drafter": {"max_context_tokens": 8192, **drafter},
                "limits": {"max_prompt_tokens": 6144, "max_new_tokens": 1024}}

    for facts in ("head.json", "narrow.json"):
        drafter = {"path": "/models/head", "layout": "eagle3", "model_facts": str(tmp_path / facts)}
        loaded = load_serve_config(_app(args(drafter))).app.args.drafter
        assert loaded.max_context_tokens == 8192 and loaded.facts().max_position_embeddings == 2048
    message = _error(_app(args({"path": "/models/lm", "model_facts": str(tmp_path / "lm.json")})))
    assert "args.drafter.max_context_tokens: 8192 exceeds the model's max_position_embeddings=2048" in message
    # a narrower head must fuse features of the target's width
    (tmp_path / "other.json").write_text(json.dumps({**json.loads((tmp_path / "narrow.json").read_text()),
                                                     "target_hidden_size": 1024}))
    other = {"path": "/models/head", "layout": "eagle3", "model_facts": str(tmp_path / "other.json")}
    message = _error(_app(args(other)))
    assert "it fuses features of hidden size 1024 (its target_hidden_size), the target's hidden size is 576" in message
    assert "\n" not in message
