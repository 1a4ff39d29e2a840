"""A tensor-parallel target: N Ray actors hold one shard each and score token trees together.

`TensorParallelTarget` is what a Target deployment replica holds when `tensor_parallel_size > 1` (it is also
usable directly, e.g. in tests). It exposes the same `score(requests)` / `release(session_id)` as
`treeserve.engine.runners.target.TargetRunner`, so the Target deployment and the in-process engine can use
either. Like TargetRunner it returns the target's features for an EAGLE drafter (`provides_features`):
the row-parallel projections end in all-reduces, so every rank holds the full residual stream and the
final post-norm state; rank 0 returns the rows it fed (context extension + tree nodes) of the final state
(EAGLE-1/2) or of the fused `feature_layers` (EAGLE-3's hidden_states indices), on the CPU, as TargetRunner
does, and the Target replica sends them on to the router, which forwards to each Drafter replica only the
rows it lacks (services/features.py).

How it is laid out:

- **Placement.** Inside a Serve replica that was given `placement_group_bundles` (docs/design.md section 11; on cuda the
  replica holds no GPU itself), the rank actors are scheduled into the replica's own placement group: on
  cuda rank r into the r-th bundle that has a GPU, asking for that bundle's GPU share (below 1 where the
  rank shares its GPU with a drafter, as in the one-node 4xA100 layouts), elsewhere any bundle with room. Anywhere else it creates its own placement group of N bundles,
  `{"CPU": cpus_per_rank}` on cpu and `{"GPU": 1, "CPU": cpus_per_rank}` on cuda, `STRICT_PACK` by default so
  NCCL ranks share a node. Its own group is removed by `shutdown()`.
- **Process group.** Rank 0 picks its node IP and a free TCP port at run time (it hosts the rendezvous
  store, so its own node is the address that works when the group was placed elsewhere than the replica);
  all ranks then `init_process_group(backend, "tcp://ip:port")` with backend `nccl` on cuda and `gloo`
  otherwise - the only device-specific choice in the TP path.
- **Weights.** Each rank builds the model on the meta device and reads only its slices from the safetensors
  files (`treeserve.engine.models.tp_loading.load_tp_shard`), then wraps it in a `TargetRunner`. Each rank keeps
  its own per-session KV caches, sharded by KV head.
- **Steps.** Every rank receives the same inputs (`score`, `release`), one step at a time and in the same
  order (a lock around each step: collectives must pair up across ranks); rank 0 returns the results, the
  others return None. Head counts that do not divide N raise ValueError before any Ray or process-group work.
- **Health.** `health()` pings every rank on a separate actor thread (so it answers during a long step) and
  raises if any rank is dead or the group was broken by a failed step; a Serve replica's `check_health`
  calls it, so Serve replaces a replica that lost a rank. After a failure the object refuses further steps:
  its caches are gone with the rank, and the router rebuilds sessions from context on the new replica.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import torch

from treeserve.engine.kv_settings import KVSettings
from treeserve.engine.models.loading import resolve_model_dir
from treeserve.engine.models.tp_loading import load_tp_shard
from treeserve.engine.runners.step_settings import StaticStepSettings
from treeserve.engine.tp import check_tp_size

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def backend_for(device: str | torch.device) -> str:
    """torch.distributed backend for a device: NCCL on cuda, gloo everywhere else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def tp_placement_bundles(tensor_parallel_size: int, device: str = "cpu", cpus_per_rank: float = 1.0,
                         replica_cpus: float = 0.0) -> list[dict[str, float]]:
    """Serve `placement_group_bundles` for a Target replica that holds a TensorParallelTarget.

    One bundle per rank ({"CPU": cpus_per_rank} plus {"GPU": 1} on cuda); Serve puts the replica itself
    (`ray_actor_options`: `replica_cpus` CPUs, no GPU) in bundle 0, so that bundle also carries its CPUs. The
    ranks are then scheduled into whichever bundle has room, one each."""
    accel = torch.device(device).type != "cpu"
    bundles = [{"CPU": float(cpus_per_rank), **({"GPU": 1.0} if accel else {})} for _ in range(tensor_parallel_size)]
    bundles[0]["CPU"] += float(replica_cpus)
    return bundles


def rank_bundles(specs: list[dict[str, float]], n: int, accel: bool, own: bool,
                 cpus_per_rank: float) -> list[tuple[int, float, float]]:
    """(bundle index, CPUs, GPUs) of each rank's actor in a placement group whose bundles are `specs`.

    Its own group: one bundle per rank. A Serve replica's group on cuda: rank r takes the r-th bundle with a GPU
    and asks for that bundle's GPU share (a rank sharing its GPU with a drafter has less than 1) and at most its
    CPUs; otherwise (cpu) any bundle with room (-1)."""
    if own:
        return [(rank, cpus_per_rank, 1.0 if accel else 0.0) for rank in range(n)]
    if not accel:
        return [(-1, cpus_per_rank, 0.0)] * n
    gpu = [i for i, b in enumerate(specs) if b.get("GPU", 0) > 0]
    if len(gpu) != n:
        raise TPGroupError(f"the replica's placement group has {len(gpu)} GPU bundles for {n} ranks: give the Target "
                           "one placement_group_bundles entry with a GPU per rank")
    return [(i, min(cpus_per_rank, float(specs[i].get("CPU", 0.0))), float(specs[i]["GPU"])) for i in gpu]


class TPGroupError(RuntimeError):
    """A rank is dead or the group is broken; the holder must be replaced (its state is lost)."""


class _Rank:
    """One tensor-parallel rank: a shard of the model, a TargetRunner around it, its sessions' KV caches."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1):
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        torch.set_num_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.runner = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a currently free port (rank 0 hosts the TCP store)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, init_method: str, backend: str, model_dir: str, device: str, dtype: torch.dtype,
              max_sessions: int, timeout_s: float, from_slices: bool = True, max_context_tokens: int | None = None,
              gpu_memory_fraction: float | None = None,
              feature_layers: tuple[int, ...] | None = None,
              static: StaticStepSettings | None = None, kv: KVSettings | None = None) -> dict[str, Any]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        from treeserve.engine.runners.target import TargetRunner

        dev = torch.device(device)
        if dev.type != "cpu":
            # Ray gives each rank actor its own accelerator (visible as index 0).
            dev = torch.device(dev.type, dev.index or 0)
            torch.accelerator.set_device_index(dev.index)
        from treeserve.engine.runners.kv_pool import limit_gpu_memory

        limit_gpu_memory(dev, gpu_memory_fraction)  # before the weights: this rank's share of a shared GPU
        start = time.perf_counter()
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=timeout_s))
        mesh = DeviceMesh(dev.type, list(range(self.world_size)))
        init_s = time.perf_counter() - start
        model, tokenizer, info = load_tp_shard(model_dir, mesh, dev, dtype, from_slices=from_slices)
        # Each rank replays its own graphs, the all-reduces inside them (as vLLM captures NCCL collectives); each
        # masks a grammar's requests as rank 0 does (the same logits on every rank, the same collectives after).
        self.runner = TargetRunner(model, dev, dtype, max_sessions, feature_layers=feature_layers, static=static,
                                   tokenizer=tokenizer)
        if max_context_tokens is not None:  # the bounded KV pool, allocated now (every rank at once: collectives)
            self.runner.lm.bound(max_sessions, max_context_tokens, kv)
            self.runner.lm.warm_up()
        return {"rank": self.rank, "init_s": init_s, "load_s": info.load_s, "mode": info.mode,
                "local_param_bytes": info.local_param_bytes, "full_param_bytes": info.full_param_bytes,
                "pid": os.getpid()}

    def score(self, requests):
        from dataclasses import replace

        with torch.no_grad():
            out = self.runner.score(requests)
        if self.rank != 0:
            return None
        # Features leave the rank on the CPU (as the dists do): what the replica encodes for the router.
        return [replace(d, features=d.features.cpu()) if d.features is not None else d for d in out]

    def score_logits(self, requests):
        """Raw logits [N, V] per request (what `score` warps): for equality checks against TP=1."""
        from treeserve.engine.runners.cached_lm import ExtendRequest

        lm = self.runner.lm
        with torch.no_grad():
            for r in requests:
                lm.begin(r.session_id, r.context, r.accepted_nodes)
            logits = lm.extend([ExtendRequest(r.session_id, r.tree.tokens.tolist(), r.tree.parents.tolist())
                                for r in requests])
        return [l.cpu() for l in logits] if self.rank == 0 else None

    def release(self, session_id: str) -> bool:
        return self.runner.release(session_id)

    def kv_heads(self, session_id: str) -> int:
        """KV heads this rank caches for a session (num_key_value_heads / tp when sharded by head)."""
        lm = self.runner.lm
        if session_id not in lm.sessions:
            raise KeyError(session_id)
        return lm.kv_heads

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        return self.rank

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# Steps run in the default group (one thread: collectives in order); pings in their own thread.
_RankActor = ray.remote(concurrency_groups={"control": 1})(_Rank)


class TensorParallelTarget:
    """`score`/`release` like TargetRunner, computed by `tensor_parallel_size` rank actors."""

    provides_features = True  # honours ScoreRequest.want_features, as TargetRunner (EAGLE drafters need it)
    # TargetRunner's KV cache, which knows its sessions; here the caches live in the rank actors (the Target
    # servicer counts the sessions it scored and did not release).
    lm = None

    def __init__(self, model_path: str | os.PathLike = "default", tensor_parallel_size: int = 2,
                 device: str = "cpu", dtype: str | torch.dtype = "float32", *, cpus_per_rank: float = 1.0,
                 feature_layers: tuple[int, ...] | None = None,
                 max_sessions: int = 256, max_context_tokens: int | None = None,
                 gpu_memory_fraction: float | None = None, static: StaticStepSettings | None = None,
                 kv: KVSettings | None = None, num_threads: int = 1, placement_strategy: str = "STRICT_PACK",
                 start_timeout_s: float = 600.0, step_timeout_s: float = 600.0,
                 health_timeout_s: float = 30.0, load_from_slices: bool = True):
        from transformers import AutoConfig

        self.tensor_parallel_size = tensor_parallel_size
        self.device = str(device)
        self.dtype = _as_dtype(dtype)
        self.step_timeout_s = step_timeout_s
        self.health_timeout_s = health_timeout_s
        self.load_from_slices = load_from_slices
        self.max_context_tokens = max_context_tokens
        self.gpu_memory_fraction = gpu_memory_fraction
        self.static = static  # each rank's static-shape step (CUDA graphs); None: eager forwards
        self.kv = kv  # each rank's KV pages and prefix caching (the same decisions on every rank: same inputs)
        self.actors: list = []
        self.load_info: list[dict[str, Any]] = []
        self._own_pg = None
        self._broken: str | None = None
        self._lock = threading.Lock()
        # Validate before any Ray or process-group work.
        model_dir = resolve_model_dir(model_path)
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        check_tp_size(config, tensor_parallel_size)
        # The hidden_states an EAGLE-3 drafter fuses (None: the final state, EAGLE-1/2), checked here too.
        layers = config.num_hidden_layers
        if feature_layers is not None and any(not 0 <= i <= layers for i in feature_layers):
            raise ValueError(f"feature layers {list(feature_layers)} are not hidden_states indices of a "
                             f"{layers}-layer target (0..{layers})")
        self.feature_layers = None if feature_layers is None else tuple(int(i) for i in feature_layers)
        self.model_dir = Path(model_dir)
        self.vocab_size = config.vocab_size
        accel = torch.device(device).type != "cpu"
        if accel and torch.device(device).type != "cuda":
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        if not ray.is_initialized():
            raise RuntimeError("TensorParallelTarget needs a running Ray (ray.init() or a Serve replica)")
        try:
            self._start(model_dir, accel, cpus_per_rank, max_sessions, num_threads, placement_strategy,
                        start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start-up
    def _start(self, model_dir, accel, cpus_per_rank, max_sessions, num_threads, strategy, timeout_s) -> None:
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = self.tensor_parallel_size
        pg = get_current_placement_group()
        if pg is None:
            bundle = {"CPU": cpus_per_rank, **({"GPU": 1} if accel else {})}
            pg = self._own_pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
            try:
                ray.get(pg.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise TPGroupError(f"placement group of {n} x {bundle} not ready after {timeout_s:.0f} s: "
                                   f"the cluster lacks the resources") from None
        env = {"OMP_NUM_THREADS": str(num_threads), "MKL_NUM_THREADS": str(num_threads),
               "TOKENIZERS_PARALLELISM": "false"}
        slots = rank_bundles(pg.bundle_specs, n, accel, own=self._own_pg is not None, cpus_per_rank=cpus_per_rank)
        for rank, (bundle, cpus, gpus) in enumerate(slots):
            strategy_ = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=False)
            self.actors.append(_RankActor.options(
                num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy_,
                runtime_env={"env_vars": env}, max_restarts=0,
            ).remote(rank, n, num_threads))
        ip, port = ray.get(self.actors[0].rendezvous_address.remote(), timeout=timeout_s)
        init_method = f"tcp://{ip}:{port}"
        backend = backend_for(self.device)
        refs = [a.setup.remote(init_method, backend, str(model_dir), self.device, self.dtype, max_sessions,
                               self.step_timeout_s, self.load_from_slices, self.max_context_tokens,
                               self.gpu_memory_fraction, self.feature_layers, self.static, self.kv)
                for a in self.actors]
        self.load_info = self._gather(refs, timeout_s)
        self.init_method, self.backend = init_method, backend

    # ------------------------------------------------------------------ steps
    def _gather(self, refs: list, timeout_s: float) -> list:
        """Results of one call per rank; the first failure (or a timeout) breaks the group and raises."""
        results: dict[int, Any] = {}
        index = {ref: i for i, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._broken = f"ranks {sorted(index[r] for r in pending)} did not answer within {timeout_s:.0f} s"
                raise TPGroupError(self._broken)
            for ref in ready:
                try:
                    results[index[ref]] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._broken = f"rank {index[ref]} died: {exc}"
                    raise TPGroupError(self._broken) from exc
                except ray.exceptions.RayTaskError as exc:
                    # Same inputs on every rank: a rank raising (e.g. ValueError on a bad request, before
                    # any collective) means all of them raise. Wait for the rest so the next step starts
                    # with every rank idle, then re-raise the rank's own exception type.
                    ray.wait(pending, num_returns=len(pending), timeout=self.health_timeout_s)
                    raise exc.as_instanceof_cause() from None
        return [results[i] for i in range(len(refs))]

    def _step(self, method: str, *args) -> list:
        with self._lock:
            if self._broken:
                raise TPGroupError(f"tensor-parallel group unusable: {self._broken}")
            args = [ray.put(a) for a in args]
            refs = [getattr(a, method).remote(*args) for a in self.actors]
            return self._gather(refs, self.step_timeout_s)

    def score(self, requests: list) -> list:
        """Same as TargetRunner.score: one TargetDists per ScoreRequest (computed by all ranks, from rank 0)."""
        return self._step("score", list(requests))[0]

    def score_logits(self, requests: list) -> list[torch.Tensor]:
        """Raw target logits [N, V] per request (diagnostics and equality tests)."""
        return self._step("score_logits", list(requests))[0]

    def release(self, session_id: str) -> bool:
        return bool(self._step("release", session_id)[0])

    async def score_async(self, requests: list) -> list:
        """`score` without blocking an event loop (Serve replicas are async)."""
        return await asyncio.to_thread(self.score, requests)

    async def release_async(self, session_id: str) -> bool:
        return await asyncio.to_thread(self.release, session_id)

    # ------------------------------------------------------------------ lifecycle
    def health(self) -> None:
        """Raise TPGroupError unless every rank answers (pings run beside a step in progress)."""
        if self._broken:
            raise TPGroupError(f"tensor-parallel group unusable: {self._broken}")
        if not self.actors:
            raise TPGroupError("tensor-parallel target is shut down")
        refs = [a.ping.remote() for a in self.actors]
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=self.health_timeout_s)
            except ray.exceptions.RayActorError as exc:
                self._broken = f"rank {rank} is dead: {exc}"
                raise TPGroupError(self._broken) from exc
            except ray.exceptions.GetTimeoutError:
                raise TPGroupError(f"rank {rank} did not answer a ping within {self.health_timeout_s:.0f} s")

    def shutdown(self) -> None:
        """Kill the rank actors and remove the placement group this object created (idempotent)."""
        actors, self.actors = self.actors, []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        if self._own_pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._own_pg)
            except Exception:
                pass
            self._own_pg = None
        self._broken = self._broken or "shut down"

    def __enter__(self) -> "TensorParallelTarget":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

