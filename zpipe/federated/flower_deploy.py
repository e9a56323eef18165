"""Eco-FL on Flower's deployment engine: a SuperLink, SuperNodes, pipeline clients.

The simulation shell (:mod:`zpipe.federated.flower_app`) replays fl-sim's
simulated time; this one runs against the wall clock, for real SuperNodes:

- ``server_app`` (in :mod:`zpipe.federated.flower_deploy_apps`), a Flower
  ``ServerApp`` on the Message API: it profiles every SuperNode it sees,
  starts the server object of ``method`` (Eco-FL's grouping, Algorithm 1,
  drop-out, FedProx in groups, FedAsync between them; or a baseline) over the
  profiled clients, and carries out what
  :class:`~zpipe.federated.flower_deploy_control.DeployController` decides:
  tasks out, replies in, deadlines, profilings of dropped clients, SuperNodes
  that come back under a new node id;
- ``client_app`` (there too), a Flower ``ClientApp`` whose local training runs
  on a zpipe pipeline of ``stages`` stage processes
  (:class:`~zpipe.federated.pipeline_trainer.PipelineTrainer`: 1F1B-Sync,
  FedProx's proximal term on every stage's units). Client ``partition-id``
  holds fl-sim's shard ``partition-id`` of the run's seed.

Flower starts a fresh ``flwr-clientapp`` process for every message, so every
task (and every profiling, which does a small task's work) starts its
pipeline's stage processes again: a client's latency includes that start.

Both apps read one :class:`~zpipe.federated.flower_deploy_control.DeploySettings`
from the run config (``flwr run --run-config 'max-updates=8 stages=2'``).
:func:`write_app` writes a Flower App directory whose components are these
two objects; ``python -m zpipe.federated.flower_deploy DIR`` does the same.
The ServerApp appends its events to ``events-path`` (JSON lines) and writes
its result to ``result-path`` when the run config names them.

Flower is optional: ``pip install 'zpipe[flower]'``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from zpipe._errors import ConfigError, ProtocolError
from zpipe.devices import single_threaded_blas
from zpipe.federated.flower_deploy_control import (
    Command,
    DeployController,
    DeploySettings,
    Event,
    SendProfile,
    SendTrain,
    make_deploy_server,
)
from zpipe.federated.flower_messages import (
    PROFILE,
    TRAIN,
    FlowerProfileReply,
    FlowerProfileRequest,
    TrainReply,
    TrainRequest,
)
from zpipe.federated.model import MLPShape, accuracy, init_weights
from zpipe.federated.simulate import Federation, SimConfig, build_federation
from zpipe.lossy.data import Dataset, load_digits_dataset

log = logging.getLogger(__name__)

POLL_S = 0.1  # between pulls of replies: the engine's own polling is slower than this
NODES_EVERY_S = 1.0  # between looks at which SuperNodes are online
# a pipeline that does not finish a task's few steps in this long is stuck
PIPELINE_TIMEOUT_S = 300.0


@lru_cache(maxsize=1)
def _dataset() -> Dataset:
    return load_digits_dataset()


def shape_of(settings: DeploySettings) -> MLPShape:
    dataset = _dataset()
    return MLPShape(dataset.n_features, settings.hidden, dataset.n_classes)


def initial_weights_of(settings: DeploySettings) -> np.ndarray:
    return init_weights(shape_of(settings), np.random.default_rng([settings.seed, 3]))


@lru_cache(maxsize=4)
def federation_of(settings: DeploySettings) -> Federation:
    """fl-sim's federation of the run's seed: client n holds its shard n."""
    config = SimConfig(
        n_clients=settings.clients,
        n_groups=settings.n_groups,
        hidden=settings.hidden,
        samples_per_client=settings.samples_per_client,
        partition=settings.partition,
        seed=settings.seed,
    )
    return build_federation(config, _dataset())


# -- the client ----------------------------------------------------------------------------


def _client_id(context: Any, settings: DeploySettings) -> int:
    try:
        client_id = int(context.node_config["partition-id"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError("a SuperNode needs --node-config 'partition-id=N'") from None
    if not 0 <= client_id < settings.clients:
        raise ConfigError(
            f"partition-id {client_id} is not a client of the run (0..{settings.clients - 1})"
        )
    return client_id


async def _pipeline_train(
    settings: DeploySettings, weights: np.ndarray, client_id: int, steps: int, seed: list[int]
) -> np.ndarray:
    from zpipe.federated.pipeline_trainer import PipelineTrainer

    shard = federation_of(settings).shards[client_id]

    async def start_and_train() -> np.ndarray:
        async with PipelineTrainer(settings.stages) as trainer:
            return await trainer.train(
                weights,
                shape_of(settings),
                shard.x,
                shard.y,
                steps=steps,
                batch_size=settings.batch_size,
                lr=settings.lr,
                mu=settings.mu,
                rng=np.random.default_rng(seed),
            )

    # the stage processes' start is inside the deadline too
    return await asyncio.wait_for(start_and_train(), PIPELINE_TIMEOUT_S)


def make_client_app() -> Any:
    """The ``ClientApp``: profiling and tasks, trained on a zpipe pipeline."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.query()
    def profile(msg: Message, context: Context) -> Message:
        settings = DeploySettings.from_run_config(context.run_config)
        client_id = _client_id(context, settings)
        FlowerProfileRequest.from_content(msg.content)
        federation = federation_of(settings)
        started = time.perf_counter()
        # the work of a small task: the round trip the server measures is the client's
        # latency as a task's is (process and pipeline start included)
        asyncio.run(
            _pipeline_train(
                settings,
                initial_weights_of(settings),
                client_id,
                settings.probe_steps,
                [settings.seed, 6, client_id],
            )
        )
        reply = FlowerProfileReply(
            client_id,
            time.perf_counter() - started,
            federation.shards[client_id].label_counts(federation.n_classes),
        )
        return Message(reply.to_content(), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        settings = DeploySettings.from_run_config(context.run_config)
        client_id = _client_id(context, settings)
        request = TrainRequest.from_content(msg.content)
        if request.client_id != client_id:
            raise ProtocolError(f"task {request.task_id} is for client {request.client_id}")
        if request.weights.shape != (shape_of(settings).size,):
            raise ProtocolError(f"task {request.task_id} carries {request.weights.size} weights")
        started = time.perf_counter()
        weights = asyncio.run(
            _pipeline_train(
                settings,
                request.weights,
                client_id,
                settings.local_steps,
                [settings.seed, 5, request.task_id],
            )
        )
        n_samples = len(federation_of(settings).shards[client_id].y)
        reply = TrainReply(request.task_id, weights, n_samples, time.perf_counter() - started)
        return Message(reply.to_content(), reply_to=msg)

    return app


# -- the server ----------------------------------------------------------------------------


class _EventLog:
    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None

    def write(self, event: dict[str, Any]) -> None:
        log.info("eco-fl %s", json.dumps(event))
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(event) + "\n")


class _DeployShell:
    """One run of the ServerApp: the controller's commands carried out on the Grid."""

    def __init__(self, grid: Any, settings: DeploySettings) -> None:
        self.grid, self.settings = grid, settings
        dataset = _dataset()
        shape = shape_of(settings)
        self.controller = DeployController(
            settings,
            make_deploy_server(settings, initial_weights_of(settings)),
            lambda w: accuracy(w, shape, dataset.x_test, dataset.y_test),
        )
        self.events = _EventLog(settings.events_path)
        self.pending: dict[
            str, tuple[str, int]
        ] = {}  # message id -> ("profile", node) | ("train", task)
        self.tried: dict[int, float] = {}  # node id -> when it was last profiled unasked
        self._nodes_at = -float("inf")

    def _carry_out(self, commands: Iterable[Command]) -> None:
        from flwr.app import Message

        for command in commands:
            match command:
                case Event(fields=fields):
                    self.events.write(dict(fields))
                case SendProfile(node_id=node):
                    msg = Message(
                        FlowerProfileRequest(0).to_content(),
                        node,
                        PROFILE,
                        ttl=self.settings.profile_timeout_s,
                    )
                    (msg_id,) = self.grid.push_messages([msg])
                    self.pending[str(msg_id)] = ("profile", node)
                case SendTrain(node_id=node, task=task):
                    request = TrainRequest(task.task_id, task.client_id, task.weights)
                    msg = Message(
                        request.to_content(), node, TRAIN, ttl=self.settings.task_timeout_s
                    )
                    (msg_id,) = self.grid.push_messages([msg])
                    self.pending[str(msg_id)] = ("train", task.task_id)

    def _look_for_nodes(self, now: float) -> None:
        """Profile every online SuperNode that is not a known client yet."""
        if now - self._nodes_at < NODES_EVERY_S:
            return
        self._nodes_at = now
        controller = self.controller
        online = sorted(int(n) for n in self.grid.get_node_ids())
        controller.set_online(online)
        for node in online:
            if node in controller.client_of or controller.profiling(node):
                continue
            if now - self.tried.get(node, -float("inf")) < self.settings.profile_timeout_s:
                continue
            self.tried[node] = now
            self._carry_out(controller.profile(node, now))

    def _pull(self) -> None:
        if not self.pending:
            return
        for reply in self.grid.pull_messages(list(self.pending)):
            what = self.pending.pop(reply.metadata.reply_to_message_id, None)
            if what is not None:
                self._carry_out(self._on_reply(what, reply, time.monotonic()))

    def _on_reply(self, what: tuple[str, int], reply: Any, now: float) -> list[Command]:
        kind, key = what
        controller = self.controller
        if kind == "profile":
            if reply.has_error():
                log.warning("node %d: profiling failed: %s", key, reply.error.reason)
                return controller.on_profile_failed(key, now)
            try:
                profile = FlowerProfileReply.from_content(reply.content)
                return controller.on_profile(key, profile.client_id, profile.label_counts, now)
            except (ProtocolError, ConfigError) as exc:
                log.warning("node %d: bad profile reply: %s", key, exc)
                return controller.on_profile_failed(key, now)
        if not controller.started:
            return []
        if reply.has_error():
            log.warning("task %d failed on its node: %s", key, reply.error.reason)
            return controller.on_train_reply(key, None, 0, now)
        try:
            trained = TrainReply.from_content(reply.content)
        except ProtocolError as exc:
            log.warning("task %d: bad reply: %s", key, exc)
            return controller.on_train_reply(key, None, 0, now)
        if trained.task_id != key:
            log.warning("task %d answered as task %d", key, trained.task_id)
            return controller.on_train_reply(key, None, 0, now)
        return controller.on_train_reply(key, trained.weights, trained.n_samples, now)

    def _drop_stale(self) -> None:
        """Forget the messages the controller no longer waits for (failed tasks)."""
        live = self.controller.outstanding_tasks()
        for msg_id, (kind, key) in list(self.pending.items()):
            if kind == "train" and key not in live:
                del self.pending[msg_id]

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        controller = self.controller
        while not controller.ready(time.monotonic()):
            now = time.monotonic()
            if now - started > self.settings.nodes_timeout_s + self.settings.profile_timeout_s:
                raise ConfigError(
                    f"{len(controller.pending_profiles)} of {self.settings.clients} SuperNodes "
                    "answered their profiling before the deadline"
                )
            self._look_for_nodes(now)
            self._pull()
            time.sleep(POLL_S)
        self._carry_out(controller.start(time.monotonic()))
        while True:
            now = time.monotonic()
            self._look_for_nodes(now)
            self._pull()
            commands, done = controller.tick(time.monotonic())
            self._carry_out(commands)
            self._drop_stale()
            if done:
                break
            time.sleep(POLL_S)
        self._carry_out(controller.finish(time.monotonic()))
        return self.result(time.monotonic() - started)

    def result(self, wall_s: float) -> dict[str, Any]:
        controller = self.controller
        server = controller.server
        assert server is not None
        events = controller.log.events
        return {
            "engine": "flower-deployment",
            "method": self.settings.method,
            "reason": controller.reason,
            "curve": [[v, a] for v, a in controller.log.curve],
            "final_acc": controller.log.curve[-1][1],
            "version": server.version,
            "updates": controller.log.updates,
            "failed_tasks": controller.log.failed_tasks,
            "dropped": [e["client"] for e in events if e["event"] == "dropped"],
            "readmitted": [e["client"] for e in events if e["event"] == "readmitted"],
            "dropped_now": sorted(c for c in server.profiles if server.is_dropped(c)),
            "stats": server.stats(),
            "wall_s": round(wall_s, 3),
        }


def make_server_app() -> Any:
    """The ``ServerApp``: Eco-FL (or ``method``) over the SuperNodes, in wall-clock time."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        settings = DeploySettings.from_run_config(context.run_config)
        with single_threaded_blas():
            result = _DeployShell(grid, settings).run()
        if settings.result_path:
            Path(settings.result_path).write_text(json.dumps(result, indent=1), encoding="utf-8")
        log.info("eco-fl result %s", json.dumps(result))

    return app


# -- the Flower App directory ---------------------------------------------------------------

APP_NAME = "zpipe-ecofl"


def app_pyproject(settings: DeploySettings | None = None) -> str:
    """A Flower App's ``pyproject.toml`` whose components are this module's apps and
    whose run config holds ``settings``' values (the defaults if none)."""
    config = (settings or DeploySettings()).run_config()
    lines = [
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        f'name = "{APP_NAME}"',
        'version = "1.0.0"',
        'description = "Eco-FL (zpipe) on Flower\'s deployment engine"',
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        'publisher = "zpipe"',
        "",
        "[tool.flwr.app.components]",
        'serverapp = "zpipe.federated.flower_deploy_apps:server_app"',
        'clientapp = "zpipe.federated.flower_deploy_apps:client_app"',
        "",
        "[tool.flwr.app.config]",
    ]
    lines += [f"{key} = {json.dumps(value)}" for key, value in config.items()]
    return "\n".join(lines) + "\n"


def write_app(directory: Path, settings: DeploySettings | None = None) -> Path:
    """Write the Flower App directory that ``flwr run DIR`` submits to a SuperLink."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(app_pyproject(settings), encoding="utf-8")
    return directory


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m zpipe.federated.flower_deploy APP_DIR", file=sys.stderr)
        return 2
    print(write_app(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
