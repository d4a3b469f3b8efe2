"""DeepSpeedTrainer: the ``Trainer`` on a DeepSpeed engine (ZeRO stage 0-3, fp32 or bf16), one rank
of a data-parallel group (the run's own process alone, or one of the ranks ``launch`` starts).

It is ``TorchTrainer`` with the optimizer step handed to DeepSpeed: the same batch preparation,
shuffling, minibatches and loss (``TorchTrainer._micro_loss``), so with one rank and fp32 it takes
the same steps as TorchTrainer up to float rounding. What changes:

- the model and a torch ``AdamW`` over the trainable parameters go to ``deepspeed.initialize``
  with a generated config (``deepspeed_config``: ZeRO stage, bf16, micro-batch size, gradient
  clipping = ``train.clip_grad``, plus ``config_overrides``). No DeepSpeed op is compiled: the
  optimizer is torch's, and the shared-memory all-reduce op of DeepSpeed's CPU backend (used only
  by its inference all-reduce) is marked unavailable (``init_process_group``);
- data parallel: every rank gets the whole batch and shuffles it with the same seeded generator,
  so all ranks agree on the minibatches. Each minibatch's rows are cut into ``world_size``
  contiguous shares (sizes differ by at most one); rank r trains on share r, in micro-batches of
  ``micro_batch_size``. A rank with fewer micro-batches than the others runs stand-in passes (one
  row, loss mask 0: no loss, no gradient) so every rank makes the same collective calls, which
  ZeRO-2 (reductions per backward) and ZeRO-3 (parameter gathers per forward) need;
- the loss: each micro-batch's loss is divided by the *whole* minibatch's denominator (as in
  TorchTrainer), and multiplied by ``world_size`` before ``engine.backward`` because DeepSpeed
  averages gradients over ranks: mean_r(world_size * grad_r) = sum_r grad_r = the gradient of the
  minibatch loss. ``engine.backward(..., scale_wrt_gas=False)`` keeps DeepSpeed from dividing by its
  accumulation count again; the accumulation boundary is set by hand (the last micro-batch of a
  minibatch), so minibatches of any size work, and ``engine.step()`` runs once per minibatch
  (clipping, AdamW, zeroing the gradients);
- old / reference logprobs: each rank computes those of its share of the batch, and a sum over
  ranks (every row filled by exactly one rank, zeros elsewhere) gives every rank the whole batch;
- metrics are summed over micro-batches (as in TorchTrainer) and then over ranks, so every rank
  reports the whole minibatch's numbers; ``grad_norm`` is the engine's norm before clipping;
- weights: ``weights()`` / ``export`` gather ZeRO-3 partitions (``deepspeed.zero.GatheredParameters``,
  a collective: every rank calls it); only rank 0 keeps the weights and publishes them (cast to the
  run's model dtype), and every rank returns rank 0's URI. With LoRA the adapter folder is published
  as by TorchTrainer;
- checkpoints: ``save(uri)`` writes DeepSpeed's own checkpoint (module weights, and each rank's
  optimizer partition, fp32 master weights included) into the sibling folder ``<stem>.deepspeed/``
  of ``uri``, then, last, ``uri`` itself (version, shuffle RNG, each rank's torch RNG, the layout),
  which is what marks the checkpoint complete. ``load(uri)`` restores all of it, so a resumed run
  continues exactly; it needs the same ``num_processes`` and ``zero_stage`` (DeepSpeed's optimizer
  shards are per rank). ``state_dict()`` is not available (the state is sharded).

Every public method is collective: all ranks call it, in the same order (``launch`` does that).
"""

from __future__ import annotations

import math
import os
import posixpath
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_core import processes
from miles_core.config import DeepSpeedTrainerConfig, TrainConfig
from miles_core.train.batch import TokenBatch
from miles_core.train.checkpoint import checkpoint_storage, load_torch, save_torch
from miles_core.train.torch_trainer import TorchTrainer

_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_ENGINE_TAG = "engine"  # DeepSpeed's checkpoint tag inside the sibling folder


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            "train.backend.type='deepspeed' needs deepspeed: DS_BUILD_OPS=0 pip install 'deepspeed>=0.19,<0.20'"
        ) from e
    return deepspeed


def init_process_group(cfg: DeepSpeedTrainerConfig) -> tuple[int, int, int]:
    """Join (or start) this process's torch.distributed group; returns (rank, local rank, world size).

    A process started by torchrun or the deepspeed launcher has RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT; a process without WORLD_SIZE becomes a group of one on a free local
    port. An existing group is reused (a process has at most one)."""
    deepspeed = _import_deepspeed()
    import torch.distributed as dist

    device_type = torch.device(cfg.device).type
    if device_type == "cpu":
        _use_cpu_accelerator()
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(processes.free_port()))
        missing = [k for k in _ENV if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"this process has WORLD_SIZE={os.environ['WORLD_SIZE']} but not {', '.join(missing)}: "
                "start the ranks with torchrun or the deepspeed launcher"
            )
    _skip_shm_comm()
    backend = cfg.dist_backend or ("nccl" if device_type == "cuda" else "gloo")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0")), dist.get_world_size()


def _use_cpu_accelerator() -> None:
    """DeepSpeed picks CUDA when it sees a GPU; ``device = "cpu"`` means its CPU accelerator."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


def _skip_shm_comm() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce op with g++ (about 45 s, once per
    machine) when its communication backend starts. Only its inference all-reduce uses that op;
    training collectives go through torch.distributed (gloo). Marking the op unavailable in
    DeepSpeed's table of compatible ops skips the build."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_config(train_cfg: TrainConfig) -> dict[str, Any]:
    """The DeepSpeed JSON config of a run: accumulation is driven by the trainer (one micro-batch per
    backward, the boundary set by hand), so ``gradient_accumulation_steps`` is 1."""
    backend = train_cfg.backend
    assert isinstance(backend, DeepSpeedTrainerConfig)
    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train_cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": train_cfg.clip_grad,
        "zero_optimization": {"stage": backend.zero_stage},
        "bf16": {"enabled": backend.precision == "bf16"},
        "steps_per_print": 2**31 - 1,  # the run reports its own metrics
        "wall_clock_breakdown": False,
    }
    return _merge(generated, backend.config_overrides)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class DeepSpeedTrainer(TorchTrainer):
    def __init__(self, model_dir: str, train_cfg: TrainConfig, *args: Any, **kwargs: Any) -> None:
        """``TorchTrainer``'s arguments; ``train_cfg.backend`` is a ``DeepSpeedTrainerConfig``."""
        backend = train_cfg.backend
        if not isinstance(backend, DeepSpeedTrainerConfig):
            raise TypeError(f"DeepSpeedTrainer needs train.backend.type='deepspeed', got {backend.type!r}")
        deepspeed = _import_deepspeed()
        self.backend = backend
        self.rank, self.local_rank, self.world_size = init_process_group(backend)
        super().__init__(model_dir, train_cfg, *args, **kwargs)
        self.zero_stage = backend.zero_stage
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model, optimizer=self.optimizer, config=deepspeed_config(train_cfg)
        )

    def _select_device(self, train_cfg: TrainConfig) -> torch.device:
        device = torch.device(train_cfg.backend.device)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.local_rank)
        return device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------------------------ step

    def logits(self, model: torch.nn.Module, mb: TokenBatch, route=None) -> Tensor:
        # the policy's passes go through the engine (its forward hooks: ZeRO-3 gathers, bf16)
        return super().logits(self.engine if model is self.model else model, mb, route)

    def _micro_batches(self, tokens: TokenBatch) -> Iterator[tuple[Tensor, TokenBatch]]:
        """This rank's share of ``tokens`` in micro-batches: (row indices into ``tokens``, rows).
        Every rank yields the same number; a stand-in has no row indices and a zero loss mask."""
        n, world, size = tokens.num_rows, self.world_size, self.cfg.micro_batch_size
        start = self.rank * (n // world) + min(self.rank, n % world)
        mine = torch.arange(start, start + n // world + (self.rank < n % world), device=self.device)
        longest = -(-n // world)
        for i in range(max(1, -(-longest // size))):
            rows = mine[i * size : (i + 1) * size]
            if len(rows):
                yield rows, tokens.select(rows)
            else:
                stand_in = tokens.select(torch.zeros(1, dtype=torch.long, device=self.device))
                stand_in.loss_mask = torch.zeros_like(stand_in.loss_mask)
                yield rows, stand_in

    def _forward_logprobs(self, model: torch.nn.Module, tokens: TokenBatch, temperature: float) -> Tensor:
        # this rank filled the rows of its share (zeros elsewhere): the sum over ranks is the whole batch
        return self._sum_over_ranks(super()._forward_logprobs(model, tokens, temperature))

    def _optimizer_step(self, minibatch: TokenBatch, temperature: float) -> dict[str, float] | None:
        denom = self.loss_denominator(minibatch)
        if denom == 0:  # the same on every rank: each one sees the whole minibatch
            return None
        micro_batches = list(self._micro_batches(minibatch))
        sums: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        for i, (_, mb) in enumerate(micro_batches):
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            loss, metrics = self._micro_loss(mb, denom, temperature)
            # DeepSpeed averages gradients over ranks; world_size * share sums them instead
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            for k, v in metrics.items():
                sums[k] = sums[k] + v.detach().float()
        names = sorted(sums)
        totals = dict(zip(names, self._sum_over_ranks(torch.stack([sums[k] for k in names])).tolist()))
        own_norm = self._grad_norm_of_plain_optimizer()
        if own_norm is not None and not math.isfinite(own_norm):  # torch's AdamW would apply it: drop it here
            self.engine.zero_grad()
            return {"nonfinite": 1.0}
        lr = self._set_lr(self.optimizer)
        self.engine.step()
        if not self.engine.was_step_applied():  # the engine found the gradient norm not finite and dropped it
            return {"nonfinite": 1.0}
        norm = float(self.engine.get_global_grad_norm() if own_norm is None else own_norm)
        if not math.isfinite(norm):
            raise FloatingPointError(
                f"DeepSpeed applied an optimizer step (weights version {self._version + 1}) whose gradient norm was "
                f"{norm} (loss {totals.get('loss')}); the weights are no longer trustworthy"
            )
        self._version += 1
        return {**totals, "grad_norm": norm, "lr": lr}

    def _grad_norm_of_plain_optimizer(self) -> float | None:
        """ZeRO stage 0 in fp32 steps torch's AdamW itself and keeps no gradient norm: measure the
        (already all-reduced) gradients before the engine clips them. None: the engine reports it."""
        if self.zero_stage > 0 or self.backend.precision != "fp32":
            return None
        grads = [p.grad for p in self.params if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def _sum_over_ranks(self, tensor: Tensor) -> Tensor:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    # ------------------------------------------------------------------------- weights and state

    @contextmanager
    def _gathered(self, params: list[torch.nn.Parameter] | None = None) -> Iterator[None]:
        """Under ZeRO-3, ``params`` (default: all) whole on every rank for the block (collective)."""
        if self.zero_stage < 3:
            yield
            return
        import deepspeed

        params = list(self.model.parameters()) if params is None else params
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield

    def weights(self) -> dict[str, Tensor]:
        """TorchTrainer's ``weights()`` (ZeRO-3 partitions gathered first), in the run's model dtype,
        on rank 0; other ranks take part in the gather and get an empty dict."""
        with self._gathered(self.params if self.lora is not None else None):
            state = super().weights() if self.is_main else {}
        return {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in state.items()}

    def merge(self) -> dict[str, Tensor]:
        if self.lora is not None and self.zero_stage == 3:
            raise NotImplementedError("merge() of a LoRA policy under ZeRO-3 is not supported; export the adapter")
        return super().merge() if self.lora is not None else self.weights()

    def export(self, version: int) -> str:
        """Publish as TorchTrainer does, from rank 0 only; every rank returns rank 0's URI."""
        uri = None
        if self.lora is None:
            state = self.weights()
            if self.is_main:
                uri = self.weight_store.publish(version, state)
        else:
            with self._gathered(self.params), self._adapter_in_export_dtype():
                if self.is_main:
                    uri = super().export(version)
        return self._from_rank0(uri)

    @contextmanager
    def _adapter_in_export_dtype(self) -> Iterator[None]:
        """bf16 training: the adapter is saved in the run's model dtype (PEFT saves what it holds)."""
        if self.backend.precision == "fp32" or not self.is_main:
            yield
            return
        saved = {p: p.data for p in self.params}
        try:
            for p in self.params:
                p.data = p.data.to(self.dtype)
            yield
        finally:
            for p, data in saved.items():
                p.data = data

    def _from_rank0(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "the DeepSpeed trainer's state is sharded over ranks (optimizer partitions): use save(uri) / load(uri)"
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state_dict()

    def save(self, uri: str) -> None:
        """DeepSpeed's checkpoint into ``<stem>.deepspeed/`` next to ``uri`` (each rank uploads the
        files it wrote), then ``uri``: version, RNG states and layout, written last by rank 0. Every
        storage call waits out an outage as run files do (``storage.max_outage_s``)."""
        import torch.distributed as dist

        storage, path = checkpoint_storage(uri, self.storage_options, self.weight_store)
        fs, shards = storage.fs, _shard_folder(path)
        if self.is_main and storage.exists(shards):
            storage.call(lambda: fs.rm(shards, recursive=True), shards)  # a stale save at the same URI
        dist.barrier()
        with tempfile.TemporaryDirectory(prefix="miles-ds-save-") as tmp:
            self.engine.save_checkpoint(
                tmp, tag=_ENGINE_TAG, client_state={}, save_latest=False,
                exclude_frozen_parameters=self.lora is not None,  # LoRA: the base loads from model_dir
            )
            local = Path(tmp) / _ENGINE_TAG
            storage.call(lambda: fs.makedirs(shards, exist_ok=True), shards)
            for file in sorted(local.iterdir()):
                target = posixpath.join(shards, file.name)
                storage.call(lambda: fs.put_file(str(file), target), target)
        rng = [None] * self.world_size
        dist.all_gather_object(rng, self._rng_state())
        dist.barrier()  # every shard is written before the marker
        if self.is_main:
            state = {"version": self._version, "shuffle_rng": self._generator.get_state(), "rank_rng": rng,
                     "world_size": self.world_size, "zero_stage": self.zero_stage, "lora": self.lora is not None}
            storage.call(lambda: save_torch(fs, path, state), path)
        dist.barrier()

    def load(self, uri: str) -> None:
        state = load_torch(uri, self.storage_options, self.weight_store, "cpu")
        layout = (state.get("world_size"), state.get("zero_stage"), state.get("lora"))
        if layout != (self.world_size, self.zero_stage, self.lora is not None):
            raise ValueError(
                f"checkpoint {uri} was written with num_processes={layout[0]}, zero_stage={layout[1]}, "
                f"lora={layout[2]}; this trainer has num_processes={self.world_size}, zero_stage={self.zero_stage}, "
                f"lora={self.lora is not None} (DeepSpeed's optimizer shards need the same layout)"
            )
        storage, path = checkpoint_storage(uri, self.storage_options, self.weight_store)
        fs, shards = storage.fs, _shard_folder(path)
        with tempfile.TemporaryDirectory(prefix="miles-ds-load-") as tmp:
            local = Path(tmp) / _ENGINE_TAG
            local.mkdir()
            for remote in storage.call(lambda: fs.ls(shards, detail=False), shards):
                storage.call(lambda: fs.get_file(remote, str(local / posixpath.basename(remote))), remote)
            loaded, _ = self.engine.load_checkpoint(
                tmp, tag=_ENGINE_TAG, load_module_strict=self.lora is None, load_optimizer_states=True,
                load_lr_scheduler_states=False,
            )
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the engine checkpoint in {shards}")
        self._version = int(state["version"])
        self._generator.set_state(state["shuffle_rng"])
        self._set_rng_state(state["rank_rng"][self.rank])

    def _rng_state(self) -> dict[str, Tensor]:
        state = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict[str, Tensor]) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)


def _shard_folder(path: str) -> str:
    """``.../step-3/trainer.pt`` -> ``.../step-3/trainer.deepspeed``."""
    stem = posixpath.splitext(path)[0]
    return stem + ".deepspeed"
