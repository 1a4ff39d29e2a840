"""Direct gRPC between the Router and the Drafter / Target replicas (docs/design.md, "Transport").

Serve owns lifecycle, health and scaling; the per-step traffic (trees, distributions) goes over direct grpc.aio
channels because a DeploymentHandle round trip costs ~5x a gRPC call on a small box. One module per role:

- `replica_server`: a replica's grpc.aio server on its own thread and loop, and the model worker thread.
- `replica`: what every Drafter / Target replica shares (server start, heartbeat, health, session clock,
  the autoscaling metric).
- `discovery`: where replicas publish their address (Ray's internal KV, with a heartbeat) and how the router
  lists them.
- `pool`: the router's view of one deployment's replicas (least-loaded sticky placement; a replica whose call
  failed or whose connection dropped is marked down at once and re-admitted only when a probe answers; refresh)
  and the grouped caller that retries a failed group on another replica.
- `clients`: `RemoteTarget` / `RemoteDrafter`, the engine's async Target / Drafter protocols (engine/parts.py) over
  a pool, awaited by the engine's step on the router's loop.

EAGLE's target features on their way from the Target to the Drafter replicas are services/features.py.
"""
