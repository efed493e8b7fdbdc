"""A tensor-parallel model runner: rank 0's `LeaderRunner` and the other ranks' loop.

Rank 0 runs the engine (scheduler, sampler, speculator) on a `LeaderRunner`; each `execute`
first sends the step's inputs to every other rank in one `StepChannel` message, then all ranks
run the forward pass together. KV moves of accepted drafts (`copy_slots`) travel with the next
message, so they reach every rank before the next forward pass reads them.

A failure anywhere (a rank that exits, a collective that errs or waits longer than
`EngineConfig.shard_timeout_s`) breaks the group for good: `ShardProcesses.fail` reports it
and every later `execute` raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.kv_sizing import MemoryGauge
from engine.model_runner import ModelRunner
from engine.models.config import LlamaConfig
from engine.parallel.channel import StepChannel
from engine.parallel.processes import ShardProcesses
from engine.parallel.shard import Shard, check_shardable
from engine.step_io import ModelOutput, SequenceInput

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0
"""How long `close` waits for the other ranks to exit before killing them."""


@dataclass
class _Step:
    seqs: list[SequenceInput]
    slot_moves: list[tuple[list[int], list[int]]] = field(default_factory=list)


@dataclass
class _ReadKV:
    slots: list[int]
    slot_moves: list[tuple[list[int], list[int]]] = field(default_factory=list)


@dataclass
class _Stop:
    slot_moves: list[tuple[list[int], list[int]]] = field(default_factory=list)


_Message = _Step | _ReadKV | _Stop


def _init_group(
    rank: int,
    size: int,
    config: EngineConfig,
    num_threads: int,
    ranks: ShardProcesses | None = None,
) -> tuple[Shard, StepChannel]:
    """Join the group at MASTER_ADDR:MASTER_PORT (rank 0 hosts the store). Rank 0 passes its
    `ranks`: it waits for every rank to join for as long as none has failed (RuntimeError once
    one has)."""
    torch.set_num_threads(num_threads)
    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    store = dist.TCPStore(
        config.master_addr,
        config.master_port,
        size,
        is_master=rank == 0,
        timeout=timedelta(seconds=config.shard_timeout_s),
        wait_for_workers=False,
    )
    store.add("joined", 1)
    while ranks is not None and store.add("joined", 0) < size:
        if ranks.failure is not None:
            raise RuntimeError(f"tensor parallelism failed: {ranks.failure}")
        time.sleep(0.05)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=config.shard_timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    return Shard(rank, size, dist.group.WORLD, control), StepChannel(control)


def _on_cpu(seq: SequenceInput) -> SequenceInput:
    """`seq` with its tensors on the CPU (a pickled CUDA tensor would land on cuda:0)."""
    mask, embeds = seq.tree_mask, seq.prefix_embeds
    if (mask is None or not mask.is_cuda) and (embeds is None or not embeds.is_cuda):
        return seq
    return replace(
        seq,
        tree_mask=None if mask is None else mask.cpu(),
        prefix_embeds=None if embeds is None else embeds.cpu(),
    )


class LeaderRunner(ModelRunner):
    """Rank 0's runner: a `ModelRunner` over rank 0's share that drives the other ranks.
    Construction (loading, the profile step) runs on every rank alike, without messages; the
    first message is the first `execute`'s."""

    def __init__(
        self,
        config: EngineConfig,
        shard: Shard,
        channel: StepChannel,
        ranks: ShardProcesses,
        memory: MemoryGauge | None = None,
    ) -> None:
        self.channel = channel
        self.ranks = ranks
        self._slot_moves: list[tuple[list[int], list[int]]] = []
        self._closed = False
        super().__init__(config, shard, memory)

    def _send(self, message: _Message) -> None:
        if self.ranks.failure is not None:
            raise RuntimeError(f"tensor parallelism failed: {self.ranks.failure}")
        message.slot_moves, self._slot_moves = self._slot_moves, []
        self.channel.send(message)

    def execute(self, seqs: list[SequenceInput]) -> ModelOutput:
        try:
            self._send(_Step([_on_cpu(s) for s in seqs]))
            return super().execute(seqs)
        except Exception as e:
            self.ranks.fail(f"rank 0's step failed: {e}", grace_s=2.0)
            raise

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        super().copy_slots(src, dst)
        if src:
            self._slot_moves.append((src, dst))

    def read_kv(self, slots: list[int]) -> list[torch.Tensor]:
        self._send(_ReadKV(slots))
        mine = super().read_kv(slots)[0]
        parts = [torch.empty_like(mine) for _ in range(self.shard.size)]
        dist.gather(mine, parts, dst=0, group=self.shard.group)
        return parts

    def watch(self, on_failure: Callable[[str], None]) -> None:
        self.ranks.on_failure = on_failure
        if self.ranks.failure is not None:
            on_failure(self.ranks.failure)

    def close(self) -> None:
        """Tell every rank to stop, wait for them (up to STOP_TIMEOUT_S, then kill them) and
        leave the process group; after a failure, kill them at once."""
        if self._closed:
            return
        self._closed = True
        timeout = STOP_TIMEOUT_S
        try:
            self._send(_Stop())
        except Exception as e:  # a broken group: its ranks cannot follow a message
            logger.warning("killing the shard ranks: %s", e)
            timeout = 0.0
        self.ranks.stop(timeout)
        dist.destroy_process_group()


def _watch_parent(parent: int) -> None:
    """Exit this process once rank 0's is gone (its pid is no longer our parent)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _follow(
    rank: int,
    size: int,
    config: EngineConfig,
    num_threads: int,
    parent: int,
    memory: MemoryGauge | None,
) -> None:
    """Rank `rank`'s process: load its share of the model (sizing its KV pool with `memory`,
    as `ModelRunner` does) and run every step rank 0 sends until told to stop, then exit 0.
    Exits 1 (logged) on any error."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 handles Ctrl-C and stops the group
    logging.basicConfig(
        level=os.environ.get("LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s",
    )
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        shard, channel = _init_group(rank, size, config, num_threads)
        runner = ModelRunner(config, shard, memory)
        while True:
            message: _Message = channel.receive()
            for src, dst in message.slot_moves:
                runner.copy_slots(src, dst)
            if isinstance(message, _Stop):
                break
            if isinstance(message, _Step):
                runner.execute(message.seqs)
            else:
                kv = runner.read_kv(message.slots)[0]
                dist.gather(kv, None, dst=0, group=shard.group)
        dist.destroy_process_group()
    except Exception:
        logging.getLogger(__name__).exception("rank %d failed", rank)
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)  # nothing left to clean up; interpreter teardown could wait on pool threads


def start_sharded_runner(config: EngineConfig, memory: MemoryGauge | None = None) -> LeaderRunner:
    """Start ranks 1..N-1 (N = `config.tensor_parallel_size`) and return rank 0's runner, in
    this process. Each rank gets 1/N of torch's threads. `memory` (picklable: every rank gets
    a copy) replaces each rank's default gauge of its device (see `ModelRunner`). ValueError,
    before any process starts, when N cannot split the model or exceeds the visible CUDA
    devices."""
    size = config.tensor_parallel_size
    check_shardable(LlamaConfig.from_folder(Path(config.model_path)), size)
    if config.device.startswith("cuda"):
        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(
                f"{size} shards need {size} CUDA devices, {visible} are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
        if config.cuda_graphs:
            logger.info("tensor parallelism: every step runs eagerly (no CUDA graphs)")
    config = replace(config, cuda_graphs=False)
    num_threads = max(1, torch.get_num_threads() // size)
    ranks = ShardProcesses(size, _follow, (size, config, num_threads, os.getpid(), memory))
    try:
        shard, channel = _init_group(0, size, config, num_threads, ranks)
        runner = LeaderRunner(config, shard, channel, ranks, memory)
    except BaseException:
        ranks.stop(0.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    logger.info(
        "tensor parallelism: %d ranks over %s (MASTER_ADDR %s, MASTER_PORT %d)",
        size,
        dist.get_backend(),
        config.master_addr,
        config.master_port,
    )
    return runner
